"""The admission verdict: what happens to a request on arrival, decided without awaiting anything.

Two pure functions of the active policy (a `ModelPlan`), the request's priority level and what the level's scheduler
predicts:

- `on_arrival(plan, level, draw)`: the policy's word before the scheduler is asked: serve (and, with overflow on,
  overflow what the scheduler cannot take in time), overflow, fall back, or refuse (shed);
- `on_refusal(verdict, rejection)`: what a `serve` becomes when the scheduler refuses at admission (its prediction
  says the deadline cannot be met, the level's queue is full, or the agent drains): overflow, where the policy
  overflows and the reason is one the cloud can help with, else a refusal with the scheduler's reason.

The scheduler's own admission stays one step with its enqueueing (no await between prediction and queueing), so the
verdict comes in these two steps. The verdicts are frozen values; the pipeline (`pipeline.py`) acts on them, for
V2 inference now and for the generative APIs, which share this seam.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from edge_agent.policy.plan import ModelPlan
    from edge_agent.scheduling.core import Rejection

Action = Literal["serve", "overflow", "fallback", "refuse"]

# Scheduler refusals that overflow turns into a trip to the cloud (the device cannot serve them in time).
OVERFLOWING = frozenset({"deadline_unmeetable", "queue_full"})


@dataclass(frozen=True)
class Verdict:
    """What to do with one request.

    action: serve here, overflow to the gateway, answer with a fallback, or refuse.
    reason: a refusal's stable code (`shed`, `queue_full`, ...).
    message: for a person: why.
    retry_after_s: a refusal's Retry-After.
    fallback: a fallback's mode, `cache` or `default`.
    overflow_if_refused: serve, but overflow what the scheduler refuses for time or room.
    """

    action: Action
    reason: str | None = None
    message: str = ""
    retry_after_s: float = 1.0
    fallback: Literal["cache", "default"] | None = None
    overflow_if_refused: bool = False


SERVE = Verdict("serve")


def on_arrival(plan: ModelPlan | None, level: int, draw: float = 1.0) -> Verdict:
    """The policy's verdict for a request at priority `level` (1 highest); `draw` is uniform in [0, 1) and decides
    an overflow `fraction`. No plan: serve as configured."""
    if plan is None:
        return SERVE
    admission = plan.admission(level, draw)
    if admission == "fallback":
        assert plan.fallback is not None
        return Verdict("fallback", fallback=plan.fallback.mode)
    if admission == "shed":
        assert plan.shed is not None
        message = f"priority {level} is shed for now (levels {plan.shed.at_or_below} and below)"
        return Verdict("refuse", "shed", message, float(plan.shed.retry_after_s))
    if admission == "overflow":
        return Verdict("overflow", message="the policy overflows this request")
    return Verdict("serve", overflow_if_refused=True) if plan.overflow is not None else SERVE


def on_refusal(verdict: Verdict, rejection: Rejection) -> Verdict:
    """What a `serve` verdict becomes when the scheduler refuses the request at admission."""
    if verdict.overflow_if_refused and rejection.reason in OVERFLOWING:
        return Verdict("overflow", message=rejection.message)
    return Verdict("refuse", rejection.reason, rejection.message, rejection.retry_after_s)
