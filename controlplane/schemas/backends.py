"""Cloud backend schemas: where overflow goes. The auth header is write-only.

A backend speaks one protocol: `v2` (the Open Inference Protocol: Triton, KServe, MLServer, a Spillway agent) or
`openai` (an OpenAI-compatible server: vLLM, TGI, llama.cpp's server, a Spillway agent), whose `model_map` names the
cloud's model for an edge model it serves (the edge's `tiny-lm` may be the cloud's `Qwen2.5-7B-Instruct`).
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    SecretStr,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from controlplane.schemas.common import Name, Stored, Strict, partial

ModelName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
_MODEL_NAME: TypeAdapter[str] = TypeAdapter(ModelName)


def is_model_name(value: str) -> bool:
    """Whether a backend can register `value` as a model it serves: the one rule for a model name."""
    try:
        _MODEL_NAME.validate_python(value)
    except ValidationError:
        return False
    return True


BackendProtocol = Literal["v2", "openai"]


class BackendSpec(Strict):
    name: Name
    url: str = Field(
        max_length=2048,
        description="base URL: of a V2 (KServe / Triton) inference server, or of an OpenAI-compatible server "
        "(without /v1: the gateway adds /v1/completions, /v1/chat/completions and /v1/models)",
    )
    protocol: BackendProtocol = Field(
        default="v2", description="v2: Open Inference Protocol infer requests; openai: completions and chat completions"
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
    binary_tensors: bool = Field(default=True, description="accepts the binary tensor data extension")

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("url must be an absolute http:// or https:// URL")
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
