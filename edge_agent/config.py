"""The agent's configuration: a YAML file, with command-line options on top; nonsense is refused at start."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class AgentConfig(BaseModel):
    """Everything `spillway agent serve` needs; field names are the YAML keys."""

    model_config = ConfigDict(extra="forbid")

    model_repository: Path
    host: str = "127.0.0.1"
    port: int = Field(default=8001, ge=0, le=65535)
    token: SecretStr | None = Field(default=None, description="bearer token the inference API requires")
    allow_unauthenticated: bool = False
    max_body_bytes: int = Field(default=64 << 20, gt=0)
    intra_op_threads: int = Field(default=0, ge=0, description="onnxruntime threads per run; 0: all cores")
    inter_op_threads: int = Field(default=1, ge=1)
    providers: list[str] | None = Field(
        default=None, description="onnxruntime providers to try in order; default TensorRT, CUDA, CPU as installed"
    )
    device_id: int = Field(default=0, ge=0, description="GPU to use")
    gpu_mem_limit: int | None = Field(default=None, gt=0, description="bytes the CUDA arena may take per session")
    max_queued_requests: int = Field(default=4096, ge=1)
    aging_s: float | None = Field(default=None, gt=0, description="serve a request waiting this long first")
    allow_non_finite: bool = Field(default=True, description="accept NaN/Inf in float inputs")
    drain_timeout_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _auth_beyond_loopback(self) -> AgentConfig:
        if not is_loopback(self.host) and self.token is None and not self.allow_unauthenticated:
            raise ValueError(
                f"host {self.host} is beyond loopback: set a token (agent config `token`) "
                "or start with --allow-unauthenticated"
            )
        return self

    @classmethod
    def load(cls, path: Path | None, **overrides: Any) -> AgentConfig:
        data: dict[str, Any] = {}
        if path is not None:
            loaded = yaml.safe_load(path.read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: expected a mapping of settings")
            data.update(loaded)
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
