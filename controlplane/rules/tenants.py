"""Tenants in the policy documents: each agent's document carries the tenants whose selector picks it.

The control loop composes them into every document it publishes (`tenants_by_agent`), and a change to a tenant or
its tokens republishes, in the same transaction as the change, the documents whose tenants it changes
(`republish`): a new version for exactly the agents affected, so an agent polling with its ETag sees it at once.

Both lock the stored documents (`locked_policies`, `locked_policy_tags`: `SELECT ... FOR UPDATE` on PostgreSQL, in
agent order) before they read the tenants, so a change and a control-loop cycle take turns and neither publishes a
version the other has already used.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import Agent, Policy, Tenant, TenantToken, utcnow
from controlplane.db.repository import Actor, record_event
from controlplane.rules.policy import compose, document
from controlplane.schemas.common import AgentSelector
from spillway.contract.policy import PolicyDocument
from spillway.contract.tenants import Tenant as PolicyTenant

if TYPE_CHECKING:
    from controlplane.rules.loop import PolicyDefaults

log = logging.getLogger("spillway.controlplane.tenants")
LIMITS = ("weight", "max_in_flight", "rate_rps", "tokens_per_s", "max_streams", "max_priority")


@dataclass(frozen=True)
class Placed:
    """One tenant as the documents carry it, and the agents it is on."""

    selector: AgentSelector
    tenant: PolicyTenant


def placed_tenants(session: Session) -> list[Placed]:
    """Every stored tenant with its token digests, by name."""
    digests: dict[str, list[str]] = {}
    for tenant_id, digest in session.execute(
        select(TenantToken.tenant_id, TenantToken.token_sha256).order_by(TenantToken.created_at, TenantToken.id)
    ):
        digests.setdefault(tenant_id, []).append(digest)
    placed = []
    for row in session.scalars(select(Tenant).order_by(Tenant.name)):
        limits = {name: getattr(row, name) for name in LIMITS}
        tenant = PolicyTenant(name=row.name, token_sha256=digests.get(row.id, []), **limits)
        placed.append(Placed(AgentSelector.model_validate(row.selector or {}), tenant))
    return placed


def tenants_for(labels: Mapping[str, str] | None, placed: Iterable[Placed]) -> list[PolicyTenant] | None:
    """The tenants on an agent with these labels, by name; None when there are none (the document then says what
    it said before tenants existed: the agent's config alone)."""
    found = [p.tenant for p in placed if p.selector.selects(dict(labels or {}))]
    return found or None


def tenants_by_agent(session: Session, agents: Iterable[Agent]) -> dict[str, list[PolicyTenant] | None]:
    placed = placed_tenants(session)
    return {agent.id: tenants_for(agent.labels, placed) for agent in agents}


def locked_policies(session: Session) -> dict[str, Policy]:
    """Every stored document, locked until the transaction ends (PostgreSQL; SQLite has one writer at a time)."""
    query = select(Policy).order_by(Policy.agent_id).with_for_update().execution_options(populate_existing=True)
    return {row.agent_id: row for row in session.scalars(query)}


def locked_policy_tags(session: Session) -> dict[str, tuple[int, str]]:
    """Every stored document's version and ETag, the rows locked as `locked_policies` locks them (the documents
    themselves are not read: the control loop reads only those it cannot tell apart by their ETag)."""
    query = select(Policy.agent_id, Policy.version, Policy.etag).order_by(Policy.agent_id).with_for_update()
    return {agent_id: (version, etag) for agent_id, version, etag in session.execute(query)}


def republish(session: Session, actor: Actor, defaults: PolicyDefaults) -> dict[str, int]:
    """After a change to tenants (not yet committed): a new version of every stored document whose tenants differ
    from what the tenants now say, with an event each. Returns agent id -> the version published.

    A stored document that no longer parses is replaced by one with no rules in force (the control loop's next cycle
    puts the rules back)."""
    stored = locked_policies(session)
    if not stored:
        return {}
    agents = {a.id: a for a in session.scalars(select(Agent).where(Agent.id.in_(list(stored))))}
    placed = placed_tenants(session)
    published: dict[str, int] = {}
    for agent_id, row in stored.items():
        agent = agents.get(agent_id)
        if agent is None:
            continue
        wanted = tenants_for(agent.labels, placed)
        try:
            current = PolicyDocument.model_validate(row.document)
        except ValidationError:
            log.warning("the stored policy of agent %s does not parse; republishing it without rules", agent_id)
            current = compose(agent_id, [], buckets_ms=defaults.buckets_ms, tenants=wanted,
                              export_interval_s=defaults.export_interval_s,
                              poll_interval_s=defaults.poll_interval_s)  # fmt: skip
        else:
            if current.tenants == wanted:
                continue
            current = current.model_copy(update={"tenants": wanted})
        version = row.version + 1
        full, etag = document(current, version)
        row.version, row.etag, row.document, row.updated_at = version, etag, full, utcnow()
        record_event(
            session, kind="policy.published", actor=actor, subject_type="agent", subject_id=agent_id,
            agent_id=agent_id, data={"version": version, "causes": full["causes"], "models": full["models"],
                                     "tenants": [t.name for t in wanted or ()]},
        )  # fmt: skip
        published[agent_id] = version
    session.flush()
    return published


__all__ = [
    "Placed",
    "locked_policies",
    "locked_policy_tags",
    "placed_tenants",
    "republish",
    "tenants_by_agent",
    "tenants_for",
]
