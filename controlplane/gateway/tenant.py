"""The tenant of an overflowed request: the agent names it in `spillway-tenant` (names.H_TENANT), the gateway passes
it on to the backend and counts it against the backend's `tenant_share`.

A name that is not a tenant name (the contract's NAME_PATTERN) is `other`, as the agents' telemetry names a tenant
they do not know, so what the gateway counts and passes on stays a bounded set of valid names. A request without the
header (an agent from before tenants, or one without tenants) is the `default` tenant's, and nothing is passed on.
"""

from __future__ import annotations

import re

from spillway.contract.tenants import DEFAULT_TENANT, NAME_PATTERN, OTHER_TENANT

_NAME = re.compile(NAME_PATTERN)


def request_tenant(raw: bytes | None) -> str | None:
    """The tenant a `spillway-tenant` header names (`other` for anything but a tenant name); None without one."""
    if raw is None:
        return None
    name = raw.decode("latin-1").strip()
    return name if is_tenant_name(name) else OTHER_TENANT


def is_tenant_name(name: str) -> bool:
    """Whether `name` is a tenant name (the contract's NAME_PATTERN; `default` and `other` are)."""
    return _NAME.fullmatch(name) is not None


def quota_tenant(tenant: str | None) -> str:
    """Whose share a request counts against: its tenant, `default` without one."""
    return DEFAULT_TENANT if tenant is None else tenant


__all__ = ["is_tenant_name", "quota_tenant", "request_tenant"]
