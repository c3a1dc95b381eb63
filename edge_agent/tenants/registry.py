"""Who a request belongs to and whether its tenant may send it now: tokens to tenant names, the tenants' weights for
the schedulers, priority ceilings, quotas (a `Lease` per admitted request, released once when it is answered), and
the bounded name telemetry uses. The agent config's tenants, with the policy document's merged over them live."""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from edge_agent.tenants.quota import TenantState
from spillway.contract.tenants import DEFAULT_TENANT, MAX_TENANTS, OTHER_TENANT, Tenant, TenantLimits, check_unique

log = logging.getLogger("spillway.agent")
_NO_LIMITS = TenantLimits()
_BEARER = b"bearer"


class Lease:
    """One admitted request's hold on its tenant's quotas: `release` when it is answered (only the first call
    counts), `add_tokens` for the tokens it generates (generative requests)."""

    __slots__ = ("_registry", "_state", "generative", "released", "tenant")

    def __init__(self, registry: TenantRegistry, tenant: str, state: TenantState, generative: bool) -> None:
        self._registry = registry
        self._state = state
        self.tenant = tenant
        self.generative = generative
        self.released = False

    def release(self) -> None:
        with self._registry._lock:
            if self.released:
                return
            self.released = True
            self._state.in_flight -= 1
            if self.generative:
                self._state.streams -= 1

    def add_tokens(self, n: int) -> None:
        """Debit `n` generated tokens from the tenant's tokens_per_s balance (it may go below zero: the next request
        waits until it is paid back)."""
        with self._registry._lock:
            bucket = self._state.tokens
            if bucket is not None and n > 0:
                bucket.refill(self._registry._clock())
                bucket.level -= n


class TenantRegistry:
    """The tenants the agent knows now: the configured ones, with a policy document's merged over them (`apply`)."""

    def __init__(
        self, configured: Iterable[Tenant], operator_token: str | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Args:
        configured: the agent config's tenants (`AgentConfig.tenant_list()`).
        operator_token: the agent's own `token`: its requests are the `default` tenant's.
        clock: monotonic seconds, for the rate buckets.

        Raises ValueError: two tenants of one name, a token shared, or a tenant token equal to the operator's.
        """
        self._clock = clock
        self._lock = threading.Lock()
        self._operator = hashlib.sha256(operator_token.encode()).hexdigest() if operator_token else None
        self._configured = {t.name: t for t in check_unique(list(configured))}
        self._callbacks: list[Callable[[dict[str, float]], None]] = []
        self._states: dict[str, TenantState] = {}
        self._tenants: dict[str, Tenant] = {}
        self._by_digest: dict[bytes, tuple[str, bytes]] = {}  # raw SHA-256 -> (tenant, the digest stored)
        self.from_policy: frozenset[str] = frozenset()  # names a policy document set
        self.auth_required = False
        self._install(self._merge(None), frozenset())

    # ---- who ----------------------------------------------------------------------------------------------------

    def resolve(self, authorization: bytes | None) -> str | None:
        """The tenant of a request's `Authorization` header; None: unauthorised (401). Without any token configured,
        every request is the `default` tenant's. The token's SHA-256 digest is looked up, then compared in constant
        time (a lookup's timing can say something about a digest, never about the token)."""
        if not self.auth_required:
            return DEFAULT_TENANT
        if not authorization:
            return None
        scheme, _, token = authorization.partition(b" ")
        token = token.strip()
        if scheme.lower() != _BEARER or not token:
            return None
        digest = hashlib.sha256(token).digest()
        found = self._by_digest.get(digest)
        if found is None:
            return None
        name, stored = found
        return name if hmac.compare_digest(digest, stored) else None

    def label(self, name: str) -> str:
        """The tenant's name in telemetry: a tenant known now, `default`, else `other` (bounded cardinality)."""
        return name if name in self._tenants or name == DEFAULT_TENANT else OTHER_TENANT

    def names(self) -> list[str]:
        """The tenants known now, `default` first."""
        return [DEFAULT_TENANT, *sorted(n for n in self._tenants if n != DEFAULT_TENANT)]

    def limits(self, name: str) -> TenantLimits:
        return self._tenants.get(name, _NO_LIMITS)

    # ---- share and priority ---------------------------------------------------------------------------------------

    def weights(self) -> dict[str, float]:
        """Each known tenant's weight (`default` included) for the schedulers' fair share."""
        weights = {DEFAULT_TENANT: 1.0}
        weights.update({name: tenant.weight for name, tenant in self._tenants.items()})
        return weights

    def on_change(self, callback: Callable[[dict[str, float]], None]) -> None:
        """`callback(weights)` after every `apply` (the schedulers' weights follow the tenants)."""
        self._callbacks.append(callback)

    def ceiling(self, name: str, level: int) -> int:
        """The level a request of `name` asking `level` is served at: never above its `max_priority` (levels: 1 is
        the highest)."""
        tenant = self._tenants.get(name)
        if tenant is None or tenant.max_priority is None:
            return level
        return max(level, tenant.max_priority)

    # ---- quotas ---------------------------------------------------------------------------------------------------

    def admit(self, name: str, *, generative: bool = False, tokens: int = 0) -> Lease:
        """Take one request of `name` in, or raise QuotaExceeded (counted as refused). Generative requests also take
        a stream and debit their prompt `tokens`."""
        limits = self._tenants.get(name, _NO_LIMITS)
        with self._lock:
            now = self._clock()
            state = self._states.get(name)
            if state is None:
                state = self._states[name] = TenantState()
                state.fit(limits, now)
            refused = state.check(name, limits, generative, now)
            if refused is not None:
                state.refused[refused.quota] += 1
                raise refused
            state.take(generative, tokens)
        return Lease(self, name, state, generative)

    # ---- live changes -----------------------------------------------------------------------------------------------

    def check(self, from_policy: list[Tenant] | None) -> None:
        """Raise ValueError if a policy document's tenants cannot be merged over the configured ones."""
        self._merge(from_policy)

    def apply(self, from_policy: list[Tenant] | None) -> None:
        """Merge a policy document's tenants over the configured ones (None: the configured ones alone), at once:
        tokens, weights, quotas and ceilings of the next request; the callbacks get the new weights. ValueError (and
        nothing changes) when they cannot be merged."""
        merged = self._merge(from_policy)
        self._install(merged, frozenset(t.name for t in from_policy or ()))
        weights = self.weights()
        for callback in self._callbacks:
            try:
                callback(weights)
            except Exception:  # one consumer's failure must not keep the others on old weights
                log.exception("passing the tenants' weights on failed")

    def _merge(self, from_policy: list[Tenant] | None) -> dict[str, Tenant]:
        """The configured tenants with the policy's over them: an entry replaces the configured tenant of its name
        (keeping the configured tokens when it names none: the control plane may set quotas only), a new name adds
        one."""
        merged = dict(self._configured)
        for tenant in from_policy or ():
            configured = self._configured.get(tenant.name)
            if not tenant.token_sha256 and configured is not None:
                tenant = tenant.model_copy(update={"token_sha256": list(configured.token_sha256)})
            merged[tenant.name] = tenant
        if len(merged) > MAX_TENANTS:
            raise ValueError(f"{len(merged)} tenants: at most {MAX_TENANTS}")
        check_unique(list(merged.values()))
        if self._operator is not None:
            for tenant in merged.values():
                if tenant.name != DEFAULT_TENANT and self._operator in tenant.token_sha256:
                    raise ValueError(f"tenant '{tenant.name}' has the agent's own token (the operator's, the "
                                     f"'{DEFAULT_TENANT}' tenant's): give it a token of its own")  # fmt: skip
        return merged

    def _install(self, merged: dict[str, Tenant], from_policy: frozenset[str]) -> None:
        pairs = [(bytes.fromhex(digest), tenant.name) for tenant in merged.values() for digest in tenant.token_sha256]
        if self._operator is not None and self._operator not in {d for t in merged.values() for d in t.token_sha256}:
            pairs.append((bytes.fromhex(self._operator), DEFAULT_TENANT))
        by_digest = {raw: (name, raw) for raw, name in pairs}
        with self._lock:
            now = self._clock()
            gone = [n for n, s in self._states.items() if n not in merged and n != DEFAULT_TENANT and s.in_flight == 0]
            for name in gone:  # nothing of theirs is out: their counts are forgotten
                del self._states[name]
            for name, state in self._states.items():  # (one removed with requests out has no quotas left)
                state.fit(merged.get(name, _NO_LIMITS), now)
            self._tenants = merged
            self._by_digest = by_digest
            self.from_policy = from_policy
            self.auth_required = bool(by_digest)

    # ---- status ---------------------------------------------------------------------------------------------------

    def json(self) -> dict[str, Any]:
        """Per tenant (known now, or still holding requests): its weight, quotas, ceiling, and what it holds and was
        counted for (admitted, refused by quota)."""
        with self._lock:
            states = {name: state.json() for name, state in self._states.items()}
        names = [*self.names(), *sorted(set(states) - set(self._tenants) - {DEFAULT_TENANT})]
        empty = TenantState().json()
        tenants = {}
        for name in names:
            tenant = self._tenants.get(name)
            # The limits, and how many tokens it has: never the token digests (a weak token could be found from one).
            limits = (tenant or _NO_LIMITS).model_dump(exclude={"name", "token_sha256"})
            limits["tokens"] = 0 if tenant is None else len(tenant.token_sha256)
            source = "policy" if name in self.from_policy else "config" if tenant is not None else None
            tenants[name] = {**limits, "source": source, "known": name in self._tenants or name == DEFAULT_TENANT,
                             **states.get(name, empty)}  # fmt: skip
        return {"auth_required": self.auth_required, "tenants": tenants}
