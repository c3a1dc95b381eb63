"""Cloud backend schemas: where overflow goes. The auth header is write-only.

A backend speaks one protocol: `v2` (the Open Inference Protocol over HTTP: Triton, KServe, MLServer, a Spillway
agent), `v2_grpc` (the same protocol's GRPCInferenceService: Triton's or KServe's gRPC port, a Spillway agent's
`grpc_port`; the gateway still takes the agents' V2 HTTP requests and speaks gRPC to the backend) or `openai` (an
OpenAI-compatible server: vLLM, TGI, llama.cpp's server, a Spillway agent), whose `model_map` names the cloud's model
for an edge model it serves (the edge's `tiny-lm` may be the cloud's `Qwen2.5-7B-Instruct`).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    SecretStr,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from controlplane.schemas.common import Name, Stored, Strict, partial
from spillway.contract.tenants import MAX_TENANTS, NAME_PATTERN

ModelName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
_MODEL_NAME: TypeAdapter[str] = TypeAdapter(ModelName)


def is_model_name(value: str) -> bool:
    """Whether a backend can register `value` as a model it serves: the one rule for a model name."""
    try:
        _MODEL_NAME.validate_python(value)
    except ValidationError:
        return False
    return True


TenantName = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=NAME_PATTERN)]
"""A tenant as the gateway counts it: the name an agent sends in `spillway-tenant` (`default`: requests naming
none, as from agents without tenants; `other`: what the agents call a tenant they do not know)."""
Share = Annotated[float, Field(gt=0, le=1)]

BackendProtocol = Literal["v2", "v2_grpc", "openai"]
_GRPC_URL = re.compile(r"^(?:(grpcs?)://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?):(\d{1,5})/?$")
GRPC_URL_FORMS = "grpc://host:port, grpcs://host:port (TLS) or host:port"


def grpc_target(url: str) -> tuple[str, bool]:
    """A `v2_grpc` backend's url as (gRPC target `host:port`, TLS or not); ValueError naming the forms it may take."""
    match = _GRPC_URL.match(url)
    port = int(match.group(3)) if match else 0
    if match is None or not 0 < port < 65536:
        raise ValueError(f"a v2_grpc backend's url is {GRPC_URL_FORMS}, with no path or credentials; got {url[:80]!r}")
    return f"{match.group(2)}:{port}", match.group(1) == "grpcs"


class BackendSpec(Strict):
    name: Name
    protocol: BackendProtocol = Field(
        default="v2",
        description="v2: Open Inference Protocol infer requests over HTTP; v2_grpc: the same over gRPC "
        "(GRPCInferenceService ModelInfer); openai: completions and chat completions",
    )
    url: str = Field(
        max_length=2048,
        description="v2: the base URL of a V2 (KServe / Triton) inference server; v2_grpc: its gRPC address, "
        f"{GRPC_URL_FORMS}; openai: the base URL of an OpenAI-compatible server (without /v1: the gateway adds "
        "/v1/completions, /v1/chat/completions and /v1/models)",
    )
    models: list[ModelName] = Field(min_length=1, max_length=1000, description="models this backend serves")
    model_map: dict[ModelName, ModelName] = Field(
        default_factory=dict,
        max_length=1000,
        description="openai backends: edge model name -> the backend's name for it (each key one of `models`); "
        "a served model without an entry keeps its name",
    )
    weight: float = Field(default=1.0, gt=0, le=1000)
    max_concurrency: int = Field(default=64, ge=1, le=100_000)
    timeout_ms: int = Field(default=10_000, ge=1, le=600_000)
    binary_tensors: bool = Field(
        default=True, description="accepts the binary tensor data extension (v2; gRPC tensors always travel raw)"
    )
    tenant_share: dict[TenantName, Share] = Field(
        default_factory=dict,
        max_length=MAX_TENANTS,
        description="tenant -> the most of this backend's in-flight requests (a fraction of max_concurrency, at "
        "least one request) that tenant may hold; over it, its request tries another backend, else 429 "
        "tenant_quota. A tenant not named is not capped; 'default' is the requests that name no tenant",
    )

    @field_validator("url")
    @classmethod
    def _url_fits_the_protocol(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("protocol") == "v2_grpc":  # declared before `url`, so judged first
            grpc_target(value)
            return value.rstrip("/")
        parts = urlsplit(value)
        if parts.scheme in ("grpc", "grpcs"):
            raise ValueError(f"{parts.scheme}:// is a gRPC address: set protocol 'v2_grpc' (else use http://)")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be an absolute http:// or https:// URL (a v2_grpc backend's: {GRPC_URL_FORMS})")
        if parts.username or parts.password:
            raise ValueError("url must not carry credentials; use auth_header")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _map_fits(self) -> BackendSpec:
        if self.model_map and self.protocol != "openai":
            raise ValueError("model_map: applies only to backends with protocol 'openai'")
        if self.protocol == "openai" and self.url.endswith("/v1"):
            raise ValueError("url: an openai backend's base URL comes without '/v1' (the gateway adds /v1/...)")
        unknown = sorted(set(self.model_map) - set(self.models))
        if unknown:
            raise ValueError(f"model_map: {unknown[0]!r} is not one of this backend's models")
        return self


class BackendCreate(BackendSpec):
    auth_header: SecretStr | None = Field(
        default=None, max_length=4096, description="sent as Authorization to the backend; never returned"
    )


BackendPatch = partial(BackendCreate)


class BackendRead(BackendSpec, Stored):
    auth_header_set: bool = Field(description="whether an auth header is stored")
