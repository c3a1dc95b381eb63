"""Passive outlier detection with Envoy's defaults: consecutive failures eject a backend for a while.

- `consecutive_failures` (5) 5xx answers or transport failures (connect, reset, timeout) in a row eject it; any
  other answer resets the count.
- An ejection lasts `base_ejection_s` (30 s) x the times the backend has been ejected, at most `max_ejection_s`
  (300 s). The multiplier decays as Envoy's does: each `interval_s` (10 s, Envoy's `interval`) a backend spends
  back in the pool takes one off it.
- At most `max_ejection_percent` (10 %) of the backends of any model it serves are out at once, except that one
  may always be (Envoy's `always_eject_one_host`): a pool of two can lose one, never both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controlplane.gateway.backend import BackendState, Transition


@dataclass(frozen=True)
class OutlierPolicy:
    consecutive_failures: int = 5
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    max_ejection_percent: float = 10.0
    interval_s: float = 10.0  # the multiplier decays by one per interval spent back in the pool

    def ejection_s(self, times_ejected: int) -> float:
        return min(self.base_ejection_s * times_ejected, max(self.max_ejection_s, self.base_ejection_s))


class OutlierDetector:
    """Decides ejections and returns; the pool applies them. Times are the pool's monotonic clock."""

    def __init__(self, policy: OutlierPolicy, peers: Callable[[str, str], Sequence[BackendState]]) -> None:
        self.policy = policy
        self.peers = peers  # (model, request protocol) -> the backends that take its requests

    def succeeded(self, state: BackendState) -> None:
        state.consecutive_failures = 0

    def failed(self, state: BackendState, now: float) -> Transition | None:
        """Count one failure; an ejection when this one reaches the threshold and the percentage allows it."""
        state.consecutive_failures += 1
        if state.consecutive_failures < self.policy.consecutive_failures or state.ejected(now):
            return None
        if not self.may_eject(state, now):
            return None  # still counted: the next failure tries again, once another backend is back
        return self._eject(state, now)

    def may_eject(self, state: BackendState, now: float) -> bool:
        for model in state.spec.models:
            peers = self.peers(model, state.spec.request_protocol)
            out = sum(1 for p in peers if p is not state and p.ejected(now))
            if out and (out + 1) * 100 > self.policy.max_ejection_percent * len(peers):
                return False
        return True

    def _eject(self, state: BackendState, now: float) -> Transition:
        self.decay(state, now)
        state.times_ejected += 1
        seconds = self.policy.ejection_s(state.times_ejected)
        failures = state.consecutive_failures
        state.ejected_at, state.ejected_until = now, now + seconds
        state.consecutive_failures = 0
        state.decay_at = None
        data = {"consecutive_failures": failures, "times_ejected": state.times_ejected, "ejection_s": seconds,
                "last_error": state.last_error}  # fmt: skip
        reason = f"{failures} consecutive failures; out for {seconds:g} s (ejection {state.times_ejected})"
        return Transition("backend.ejected", state.id, state.name, reason, data)

    def due(self, state: BackendState, now: float) -> Transition | None:
        """Back in the pool if its ejection is over (a lazy check: the pool calls it when it looks)."""
        if state.ejected_until is None or now < state.ejected_until:
            return None
        assert state.ejected_at is not None
        back_at = state.ejected_until
        data = {"ejected_for_s": round(back_at - state.ejected_at, 3), "times_ejected": state.times_ejected}
        state.ejected_at = state.ejected_until = None
        state.consecutive_failures = 0
        state.decay_at = back_at + self.policy.interval_s
        self.decay(state, now)
        reason = f"ejection of {data['ejected_for_s']:g} s over"
        return Transition("backend.returned", state.id, state.name, reason, data)

    def decay(self, state: BackendState, now: float) -> None:
        """One off the multiplier per whole `interval_s` spent back in the pool."""
        if state.ejected_until is not None:
            return
        while state.times_ejected > 0 and state.decay_at is not None and now >= state.decay_at:
            state.times_ejected -= 1
            state.decay_at += self.policy.interval_s
        if state.times_ejected == 0:
            state.decay_at = None
