"""Tenant schemas: the applications that share the agents a selector picks, with a weight, quotas and tokens.

A tenant's share and quotas are the contract's (`spillway.contract.tenants.TenantLimits`: one definition for the
agent's config, the policy document and this API). Its bearer tokens are made here, on the server, shown once in
the response that creates them, and kept only as SHA-256 digests: what the policy document carries to the agents.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, field_validator

from controlplane.schemas.common import AgentSelector, Stored, Strict, partial
from spillway.contract.tenants import DEFAULT_TENANT, NAME_PATTERN, OTHER_TENANT, RESERVED_NAMES, TenantLimits

MAX_TOKENS_PER_TENANT = 16  # the contract's `Tenant.token_sha256` holds at most 16
_RESERVED = {
    DEFAULT_TENANT: "the operator's own tenant: requests with an agent's own token, or with none where it needs none",
    OTHER_TENANT: "what the agents' telemetry calls a tenant they do not know",
}


class _Named(Strict):
    name: str = Field(
        min_length=1, max_length=63, pattern=NAME_PATTERN,
        description="lower case letters, digits, '_', '.', '-' (starting with a letter or digit); the name the "
        "agents' telemetry and 429 answers use",
    )  # fmt: skip
    description: str = Field(default="", max_length=2000)
    selector: AgentSelector = Field(
        default_factory=AgentSelector,
        description="the agents this tenant is on: those with all of these labels (none: every agent)",
    )

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value in RESERVED_NAMES:
            why = _RESERVED.get(value, "a name the agents give requests themselves")
            raise ValueError(f"'{value}' is reserved ({why}); choose another name")
        return value


class TenantSpec(TenantLimits, _Named):
    """A tenant as the operator writes it: a name, the agents it applies to, and the contract's share and quotas
    (the fields come in that order; the contract's frozen model is made editable here, and the request-body rules
    of `Strict` apply: unknown fields, NaN and NUL refused)."""

    model_config = ConfigDict(frozen=False)


class TenantCreate(TenantSpec):
    pass


TenantPatch = partial(TenantCreate)


class TenantRead(TenantSpec, Stored):
    model_config = ConfigDict(from_attributes=True, populate_by_name=True)


class TenantTokenCreate(Strict):
    label: str = Field(default="", max_length=128, description="what the token is for, e.g. the client using it")


class TenantTokenRead(BaseModel):
    """A token as listed: never its secret nor its digest."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    tenant_id: str
    label: str
    prefix: str = Field(description="the token's first characters, to tell tokens apart")
    created_at: datetime


class TenantTokenCreated(BaseModel):
    tenant_token: TenantTokenRead
    token: str = Field(description="the bearer token for the agents' APIs; shown only in this response")


__all__ = [
    "MAX_TOKENS_PER_TENANT",
    "TenantCreate",
    "TenantPatch",
    "TenantRead",
    "TenantSpec",
    "TenantTokenCreate",
    "TenantTokenCreated",
    "TenantTokenRead",
]
