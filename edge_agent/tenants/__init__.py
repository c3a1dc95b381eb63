"""Tenants: the applications sharing one agent. Their tokens resolve a request to a tenant name; each has a weight
(the schedulers' fair share within a priority level), quotas checked at admission (`TenantRegistry.admit` hands out
a `Lease`, released once when the request is answered; over a quota is `QuotaExceeded`, a 429) and a priority
ceiling. The agent config's tenants, with the policy document's merged over them live."""

from edge_agent.tenants.quota import QuotaExceeded
from edge_agent.tenants.registry import Lease, TenantRegistry

__all__ = ["Lease", "QuotaExceeded", "TenantRegistry"]
