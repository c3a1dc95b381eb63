"""Cloud backend schemas: where overflow goes. The auth header is write-only."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, StringConstraints, TypeAdapter, ValidationError, field_validator

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


class BackendSpec(Strict):
    name: Name
    url: str = Field(max_length=2048, description="base URL of a V2 (KServe / Triton) inference server")
    models: list[ModelName] = Field(min_length=1, max_length=1000, description="models this backend serves")
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


class BackendCreate(BackendSpec):
    auth_header: SecretStr | None = Field(
        default=None, max_length=4096, description="sent as Authorization to the backend; never returned"
    )


BackendPatch = partial(BackendCreate)


class BackendRead(BackendSpec, Stored):
    auth_header_set: bool = Field(description="whether an auth header is stored")
