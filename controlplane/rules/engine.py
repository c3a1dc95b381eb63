"""A rule's state machine for one agent, with hysteresis, step-wise recovery and a flap limit. Pure: the clock is
an argument, so every transition is checked with an injected time and no sleeping.

    ok --met--> pending --met for `for`--> firing --clear--> recovering --clear for `recover_after`--> ...
       (`for` = 0: straight to firing)      ^                      |
                                            +-------met------------+

Recovery happens in `recovery_steps` steps, each after `recover_after` clear: the action gets milder one step at
a time (for `shed`: one priority level fewer each step) and the rule is `ok` again after the last one. A rule
whose recoveries within the last hour reach `max_flaps_per_hour` does not recover: it stays firing, latched,
and says so once (`rule.flapping`), until enough of those recoveries are more than an hour old.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from controlplane.schemas.rules import Hysteresis as RuleHysteresis

HOUR_S = 3600.0


@dataclass(frozen=True)
class Hysteresis:
    for_s: float = 0.0
    recover_after_s: float = 0.0
    recovery_steps: int = 1
    max_flaps_per_hour: int = 4

    @classmethod
    def of(cls, rule: RuleHysteresis) -> Hysteresis:
        """The timings of a rule's (parsed) hysteresis, in seconds."""
        return cls(
            for_s=float(rule.for_),
            recover_after_s=float(rule.recover_after),
            recovery_steps=rule.recovery_steps,
            max_flaps_per_hour=rule.max_flaps_per_hour,
        )


@dataclass(frozen=True)
class State:
    """Where a rule stands for one agent. `step` counts recovery steps taken (0: the action in full)."""

    state: str = "ok"  # ok | pending | firing | recovering
    since: float = 0.0  # when `state` began (recovering: when the current step's clear period began)
    fired_at: float | None = None
    step: int = 0
    flaps: tuple[float, ...] = ()  # recoveries within the last hour
    latched: bool = False

    @property
    def active(self) -> bool:
        """Whether the rule's action is in force (in full or partly recovered)."""
        return self.state in ("firing", "recovering")


@dataclass(frozen=True)
class Transition:
    kind: str  # fired | recovered | stepped_down | flapping | refired
    state: State
    data: dict[str, Any] = field(default_factory=dict)


def advance(state: State, met: bool, now: float, h: Hysteresis) -> tuple[State, Transition | None]:
    """The state after observing `met` at `now` (seconds), and the transition worth an event, if any."""
    flaps = tuple(t for t in state.flaps if now - t < HOUR_S)
    if flaps != state.flaps:
        state = replace(state, flaps=flaps)
    if state.state == "ok":
        if not met:
            return state, None
        if h.for_s <= 0:
            fired = _fire(now, flaps)
            return fired, Transition("fired", fired)
        return State("pending", now, flaps=flaps), None
    if state.state == "pending":
        if not met:
            return State("ok", now, flaps=flaps), None
        if now - state.since >= h.for_s:
            fired = _fire(now, flaps)
            return fired, Transition("fired", fired)
        return state, None
    if state.state == "firing":
        if met:
            return state, None
        return replace(state, state="recovering", since=now), None
    # recovering: `since` is when the current clear period began
    if met:
        refired = replace(state, state="firing", since=now, step=0)
        return refired, (Transition("refired", refired) if state.step > 0 else None)
    if now - state.since < h.recover_after_s:
        return state, None
    if state.step + 1 < h.recovery_steps:
        stepped = replace(state, step=state.step + 1, since=now)
        return stepped, Transition("stepped_down", stepped)
    if len(flaps) + 1 >= h.max_flaps_per_hour:  # recovering now would be one flap too many
        if state.latched:
            return replace(state, since=now), None
        latched = replace(state, state="firing", since=now, step=0, latched=True)
        return latched, Transition("flapping", latched, {"recoveries_last_hour": len(flaps) + 1})
    recovered = State("ok", now, flaps=(*flaps, now))
    return recovered, Transition("recovered", recovered)


def _fire(now: float, flaps: tuple[float, ...] = ()) -> State:
    return State("firing", now, fired_at=now, flaps=flaps)


__all__ = ["Hysteresis", "State", "Transition", "advance"]
