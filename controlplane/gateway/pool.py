"""The backends in memory and every decision about them, as plain synchronous code with an injected clock:
which backend takes a request, what a failure or a readiness check changes. The async shell (forward.py, health.py)
only moves requests and results; nothing here awaits, so each call is atomic on the event loop.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from controlplane.gateway.backend import BackendSpec, BackendState, Transition
from controlplane.gateway.errors import NoBackend, NoCapacity, NoHealthyBackend, TenantQuota
from controlplane.gateway.outlier import OutlierDetector, OutlierPolicy
from controlplane.gateway.picker import BackendPicker, PowerOfTwoChoices
from controlplane.gateway.readiness import ReadinessPolicy, apply_checks

_NONE: tuple[BackendState, ...] = ()


class BackendPool:
    """Backends by id, and by protocol and model; `acquire` picks one for a request, `release` reports how it went.

    A V2 request and an OpenAI-compatible one for the same model name go to different backends (those of its
    protocol: a V2 one to `v2` and `v2_grpc` backends alike), and outlier ejection counts a backend's peers among
    those of its request protocol."""

    def __init__(
        self,
        outlier: OutlierPolicy | None = None,
        readiness: ReadinessPolicy | None = None,
        picker: BackendPicker | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.clock = clock
        self.rng = rng or random.Random()  # noqa: S311 - load spreading, not secrets
        self.picker = picker or PowerOfTwoChoices()
        self.readiness = readiness or ReadinessPolicy()
        self.outlier = OutlierDetector(outlier or OutlierPolicy(), self.serving)
        self.states: dict[str, BackendState] = {}
        self.by_protocol: dict[str, dict[str, tuple[BackendState, ...]]] = {"v2": {}, "openai": {}}
        self.by_model = self.by_protocol["v2"]  # the V2 ones
        self.transitions: list[Transition] = []  # drained by the shell into the events table

    # ---- the registered backends ------------------------------------------------------------------

    def replace(self, specs: Iterable[BackendSpec]) -> list[BackendState]:
        """The backends now registered; a backend whose id stays keeps its state. Returns the removed ones."""
        states: dict[str, BackendState] = {}
        for spec in specs:
            state = self.states.get(spec.id)
            if state is None:
                state = BackendState(spec)
            else:
                old = state.spec
                if (old.url, old.protocol, old.model_map) != (spec.url, spec.protocol, spec.model_map):
                    # another server (or other names on it) behind the same id: what was learnt is void
                    state.checked.clear()
                    state.unhealthy.clear()
                for model in set(state.checked) - set(spec.models):
                    state.checked.discard(model)
                    state.unhealthy.discard(model)
                state.spec = spec
            states[spec.id] = state
        removed = [s for ident, s in self.states.items() if ident not in states]
        grouped: dict[str, dict[str, list[BackendState]]] = {protocol: {} for protocol in self.by_protocol}
        for state in states.values():
            by_model = grouped.setdefault(state.spec.request_protocol, {})
            for model in state.spec.models:
                by_model.setdefault(model, []).append(state)
        self.states = states
        self.by_protocol = {protocol: {m: tuple(sorted(group, key=lambda s: s.id)) for m, group in by_model.items()}
                            for protocol, by_model in grouped.items()}  # fmt: skip
        self.by_model = self.by_protocol["v2"]
        return removed

    def serving(self, model: str, protocol: str = "v2") -> tuple[BackendState, ...]:
        return self.by_protocol.get(protocol, {}).get(model, _NONE)

    def knows(self, model: str, protocol: str = "v2") -> bool:
        return model in self.by_protocol.get(protocol, {})

    # ---- requests ---------------------------------------------------------------------------------

    def acquire(
        self, model: str, exclude: Collection[str] = (), protocol: str = "v2", tenant: str | None = None
    ) -> BackendState:
        """A backend of `protocol` for one request to `model`, counted as outstanding until `release`; never one
        in `exclude`. With `tenant`, never one where that tenant holds its `tenant_share` already, and the request
        counts towards its share until `left`.

        Raises NoBackend (none registered), NoHealthyBackend (all failing checks or ejected), NoCapacity (all at
        their max_concurrency), TenantQuota (the tenant holds its share of every one with room); at once, without
        waiting for a slot.
        """
        peers = (self.by_model if protocol == "v2" else self.by_protocol.get(protocol, {})).get(model)
        if not peers:
            kind = "" if protocol == "v2" else f"{protocol} "
            raise NoBackend(f"no {kind}backend is registered for model '{model}'")
        now = self.clock()
        healthy: list[BackendState] = []
        for state in peers:
            if state.id in exclude:
                continue
            if state.ejected_until is not None:
                if now < state.ejected_until:
                    continue
                self._note(self.outlier.due(state, now))
            if model not in state.unhealthy:
                healthy.append(state)
        if not healthy:
            left = len(peers) - len(exclude)
            raise NoHealthyBackend(f"none of the {left} backends of model '{model}' is healthy and in the pool")
        free = [s for s in healthy if s.outstanding < s.spec.max_concurrency]
        if not free:
            raise NoCapacity(f"every healthy backend of model '{model}' is at its max_concurrency")
        if tenant is not None:
            free = self._within_share(free, model, tenant)
        chosen = free[self.picker.pick(free, self.rng)]
        chosen.outstanding += 1
        if tenant is not None:
            chosen.tenants[tenant] = chosen.tenants.get(tenant, 0) + 1
        return chosen

    @staticmethod
    def _within_share(free: list[BackendState], model: str, tenant: str) -> list[BackendState]:
        """The backends of `free` where `tenant` is below its share; TenantQuota if none."""
        within = [s for s in free if s.within_share(tenant)]
        if within:
            return within
        for state in free:  # each caps this tenant: the names counted are those of its tenant_share
            state.tenant_refused[tenant] = state.tenant_refused.get(tenant, 0) + 1
        held = ", ".join(f"'{s.name}' {s.tenants.get(tenant, 0)} of {s.spec.tenant_limit(tenant)}" for s in free[:5])
        raise TenantQuota(
            f"tenant '{tenant}' holds its share of every backend of model '{model}' with room ({held}); retry later",
            {"tenant": tenant, "quota": "tenant_share", "retry_after_s": 1},
        )

    def left(self, state: BackendState, tenant: str | None) -> None:
        """A request of `tenant` that `acquire` gave `state` no longer holds a part of its share (after `release`,
        or on its own where the request was never sent)."""
        if tenant is None:
            return
        held = state.tenants.get(tenant, 0) - 1
        if held > 0:
            state.tenants[tenant] = held
        else:
            state.tenants.pop(tenant, None)

    def release(
        self,
        state: BackendState,
        *,
        failure: str | None = None,
        error: str | None = None,
        seconds: float | None = None,
        busy: bool = False,
    ) -> None:
        """The request `acquire` gave `state` is over: `failure` is None (answered, not 5xx) or its kind
        (connect, reset, timeout, status_5xx), which counts towards an ejection. `busy`: the backend shed the
        request (503 with Retry-After): not a failure, and, like a success, it ends a streak of failures (the
        backend answers: it is busy, not broken)."""
        state.outstanding -= 1
        state.requests += 1
        if seconds is not None:
            state.recent.append(seconds)
        if busy and failure is None:
            state.busy += 1
        if failure is None:
            self.outlier.succeeded(state)
            return
        state.errors += 1
        state.last_error = error or failure
        if self.states.get(state.id) is state:  # not for a backend deleted while the request ran
            self._note(self.outlier.failed(state, self.clock()))

    # ---- checks and time --------------------------------------------------------------------------

    def checked(self, backend_id: str, ready: Mapping[str, bool], error: str | None = None) -> None:
        """One round of readiness checks of a backend: model -> passed."""
        state = self.states.get(backend_id)
        if state is not None:
            self.transitions.extend(apply_checks(self.readiness, state, ready, error))

    def sweep(self) -> None:
        """Return the backends whose ejection is over and decay multipliers (the shell calls it now and then, so
        that `backend.returned` is recorded even for a model nobody asks for)."""
        now = self.clock()
        for state in self.states.values():
            self._note(self.outlier.due(state, now))
            self.outlier.decay(state, now)

    def drain(self) -> list[Transition]:
        taken, self.transitions = self.transitions, []
        return taken

    def _note(self, transition: Transition | None) -> None:
        if transition is not None:
            self.transitions.append(transition)

    # ---- status -----------------------------------------------------------------------------------

    def snapshot(self) -> list[dict[str, Any]]:
        """Per backend, what the status page shows; `ejected_for_s` is how long the ejection still lasts."""
        now = self.clock()
        rows = []
        for state in sorted(self.states.values(), key=lambda s: s.name):
            spec = state.spec
            ejected = state.ejected(now)
            rows.append({
                "id": spec.id, "name": spec.name, "url": spec.url, "protocol": spec.protocol,
                "models": list(spec.models), "model_map": dict(spec.model_map),
                "healthy": not state.unhealthy, "unhealthy_models": sorted(state.unhealthy),
                "ejected": ejected, "ejected_for_s": (state.ejected_until or now) - now if ejected else None,
                "times_ejected": state.times_ejected, "consecutive_failures": state.consecutive_failures,
                "outstanding": state.outstanding, "max_concurrency": spec.max_concurrency, "weight": spec.weight,
                "requests": state.requests, "errors": state.errors, "busy": state.busy,
                "p50_ms": state.percentile_ms(0.5), "p99_ms": state.percentile_ms(0.99), "last_error": state.last_error,
                "tenant_share": dict(spec.tenant_share), "tenants": dict(sorted(state.tenants.items())),
                "tenant_refused": dict(sorted(state.tenant_refused.items())),
            })  # fmt: skip
        return rows
