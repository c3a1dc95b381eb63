"""Tenants: the applications that share one agent. Defined once, here: the agent's config (`tenants:`), the policy
document (so the control plane manages them live) and the control plane's REST API all use these types.

A tenant is a name, its bearer tokens (only their SHA-256 digests are kept anywhere but the config file the
operator wrote), a weight for weighted fair share within a priority level, optional quotas and an optional priority
ceiling. Requests authenticated with the agent's own `token` (or with none, where the agent needs none) belong to
the `default` tenant, the operator's. Telemetry names at most the configured tenants plus `other`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The operator's tenant (the agent's own `token`, or no token where none is needed) and the telemetry name of a
# tenant the agent no longer knows (removed while its requests were in flight): neither may be configured.
DEFAULT_TENANT = "default"
OTHER_TENANT = "other"
RESERVED_NAMES = frozenset({DEFAULT_TENANT, OTHER_TENANT})
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
MAX_TENANTS = 256


def hash_token(token: str) -> str:
    """The SHA-256 hex digest a token is known by (tokens are long random secrets: no salt or stretching needed to
    make the digest useless to someone who reads it; an agent compares digests in constant time)."""
    return hashlib.sha256(token.encode()).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TenantLimits(_Strict):
    """A tenant's share and quotas; a limit left out (null) is no limit."""

    weight: float = Field(default=1.0, gt=0, le=1000, description="share within a priority level, relative to others")
    max_in_flight: int | None = Field(default=None, ge=1, le=1_000_000, description="requests admitted and unanswered")
    rate_rps: float | None = Field(default=None, gt=0, le=1_000_000, description="requests per second (1 s of burst)")
    tokens_per_s: float | None = Field(
        default=None, gt=0, le=100_000_000, description="generative models: prompt plus generated tokens per second"
    )
    max_streams: int | None = Field(
        default=None, ge=1, le=100_000, description="generative models: requests generating at once"
    )
    max_priority: int | None = Field(
        default=None, ge=1, le=64,
        description="the highest level (smallest number) this tenant may use; asking higher is served at this level",
    )  # fmt: skip


class Tenant(TenantLimits):
    """A tenant as the policy document and the agent carry it: tokens as digests only."""

    name: str = Field(pattern=NAME_PATTERN, description="lower case letters, digits, '_', '.', '-'")
    token_sha256: list[Annotated[str, Field(pattern=_DIGEST.pattern)]] = Field(
        default_factory=list, max_length=16, description="SHA-256 hex digests of the tenant's bearer tokens"
    )

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value in RESERVED_NAMES:
            raise ValueError(
                f"'{value}' is reserved ('default': the operator's own token; 'other': telemetry's name "
                "for tenants the agent does not know)"
            )
        return value


def check_unique(tenants: list[Tenant]) -> list[Tenant]:
    """Refuse two tenants of one name, or one token digest given to two tenants."""
    seen: dict[str, str] = {}
    names: set[str] = set()
    for tenant in tenants:
        if tenant.name in names:
            raise ValueError(f"tenant '{tenant.name}' is listed twice")
        names.add(tenant.name)
        for digest in tenant.token_sha256:
            if digest in seen and seen[digest] != tenant.name:
                raise ValueError(f"tenants '{seen[digest]}' and '{tenant.name}' share a token")
            seen[digest] = tenant.name
    return tenants


__all__ = [
    "DEFAULT_TENANT",
    "MAX_TENANTS",
    "NAME_PATTERN",
    "OTHER_TENANT",
    "RESERVED_NAMES",
    "Tenant",
    "TenantLimits",
    "check_unique",
    "hash_token",
]
