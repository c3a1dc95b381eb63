"""A rule's hysteresis with an injected clock: `for`, `recover_after`, step-wise recovery, the flap limit; and
how active rules compose into one policy document."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from pydantic import TypeAdapter

from controlplane.rules.engine import Hysteresis, State, advance
from controlplane.rules.policy import Active, compose, document, same_content, stepped_action
from controlplane.schemas.rules import Action, FallbackAction
from controlplane.schemas.rules import Hysteresis as RuleHysteresis
from spillway.contract.policy import PolicyDocument

ACTION: TypeAdapter[Action] = TypeAdapter(Action)


def run(h: Hysteresis, timeline: list[tuple[float, bool]], state: State | None = None) -> list[tuple[float, str, str]]:
    """Feed (time, met) observations; returns (time, state, transition kind or '') for each."""
    state = state or State()
    seen = []
    for now, met in timeline:
        state, transition = advance(state, met, now, h)
        seen.append((now, state.state, transition.kind if transition else ""))
    return seen


def test_for_delays_firing_and_a_blip_does_not_fire() -> None:
    h = Hysteresis(for_s=30, recover_after_s=60)
    assert run(h, [(0, True), (10, True), (20, False), (25, True), (50, True), (55, True), (60, True)]) == [
        (0, "pending", ""), (10, "pending", ""), (20, "ok", ""),  # cleared before `for`: never fired
        (25, "pending", ""), (50, "pending", ""), (55, "firing", "fired"), (60, "firing", ""),
    ]  # fmt: skip


def test_recover_after_must_be_clear_throughout() -> None:
    h = Hysteresis(for_s=0, recover_after_s=60)
    assert run(h, [(0, True), (10, False), (50, True), (60, False), (100, False), (120, False)]) == [
        (0, "firing", "fired"), (10, "recovering", ""), (50, "firing", ""),  # met again: the clock restarts
        (60, "recovering", ""), (100, "recovering", ""), (120, "ok", "recovered"),
    ]  # fmt: skip


def test_step_wise_recovery_and_refiring_in_the_middle() -> None:
    h = Hysteresis(recover_after_s=10, recovery_steps=3)
    steps = []
    state = State()
    for now, met in [(0, True), (1, False), (11, False), (21, False), (25, True), (26, False), (36, False),
                     (46, False), (56, False)]:  # fmt: skip
        state, transition = advance(state, met, now, h)
        steps.append((now, state.state, state.step, transition.kind if transition else ""))
    assert steps == [
        (0, "firing", 0, "fired"), (1, "recovering", 0, ""), (11, "recovering", 1, "stepped_down"),
        (21, "recovering", 2, "stepped_down"), (25, "firing", 0, "refired"),  # back to the full action
        (26, "recovering", 0, ""), (36, "recovering", 1, "stepped_down"), (46, "recovering", 2, "stepped_down"),
        (56, "ok", 0, "recovered"),
    ]  # fmt: skip


def test_a_flapping_rule_stays_fired_and_says_so_once() -> None:
    h = Hysteresis(recover_after_s=5, max_flaps_per_hour=3)
    timeline = []
    for cycle in range(3):  # fire and clear three times within minutes
        base = cycle * 100.0
        timeline += [(base, True), (base + 1, False), (base + 10, False)]
    seen = run(h, [*timeline, (400, False), (410, False)])
    kinds = [k for _, _, k in seen if k]
    assert kinds == ["fired", "recovered", "fired", "recovered", "fired", "flapping"]
    assert seen[-1][1] in ("firing", "recovering")  # latched: still in force, no second "flapping" event
    # An hour after the first recoveries the rule may recover again.
    state = State()
    for now, met in timeline:
        state, _ = advance(state, met, now, h)
    later, transition = advance(state, False, 3700, h)
    later, transition = advance(later, False, 3710, h)
    assert (later.state, transition and transition.kind) == ("ok", "recovered")


def test_hysteresis_reads_the_stored_rule() -> None:
    stored = {"for": 90, "recover_after": 600, "recovery_steps": 2, "max_flaps_per_hour": 5}
    h = Hysteresis.of(RuleHysteresis.model_validate(stored))
    assert h == Hysteresis(90, 600, 2, 5)
    assert Hysteresis.of(RuleHysteresis.model_validate({})) == Hysteresis()


NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


def _active(name: str, action: dict[str, Any] | Action, model: str | None = "mlp", step: int = 0) -> Active:
    typed = ACTION.validate_python(action) if isinstance(action, dict) else action
    return Active(f"id-{name}", name, typed, model, step, NOW)


def test_rules_compose_along_the_ladder_and_conflicts_resolve_deterministically() -> None:
    active = [
        _active("b-shed", {"kind": "shed", "priority_at_or_below": 3, "retry_after_s": 5}),
        _active("a-shed", {"kind": "shed", "priority_at_or_below": 2, "retry_after_s": 30}, step=1),  # now 3
        _active("c-lite", {"kind": "switch_variant", "version": 2}),
        _active("a-lite", {"kind": "switch_variant", "version": 3}),
        _active("tune", {"kind": "tune_batching", "max_queue_delay_us": 500, "preferred_batch_sizes": [8]}),
        _active("tune2", {"kind": "tune_batching", "max_queue_delay_us": 200}),
        _active("everyone", {"kind": "fallback", "priority_at_or_below": 3, "mode": "cache"}, model=None),
    ]
    content = compose("agent1", active, buckets_ms=[10, 50], export_interval_s=5, poll_interval_s=2)
    assert content.model_dump(exclude_unset=True)["models"] == {
        "mlp": {"shed": {"at_or_below": 3, "retry_after_s": 30}, "variant": 3,
                "max_queue_delay_us": 200, "preferred_batch_sizes": [8]},
        "*": {"fallback": {"at_or_below": 3, "mode": "cache"}},
    }  # fmt: skip
    assert [c.name for c in content.causes] == ["a-lite", "a-shed", "b-shed", "c-lite", "everyone", "tune",
                                                      "tune2"]  # fmt: skip
    full, etag = document(content, 7)
    parsed = PolicyDocument.model_validate(full)  # what the agent will accept
    assert parsed.version == 7 and parsed.for_model("mlp").fallback is not None
    assert same_content(full, content) and not same_content(full, content.model_copy(update={"models": {}}))
    again, etag_again = document(compose("agent1", list(reversed(active)), buckets_ms=[50, 10], export_interval_s=5,
                                         poll_interval_s=2), 7)  # fmt: skip
    assert (again, etag_again) == (full, etag)  # order of rules and buckets does not matter
    assert etag.startswith('"') and document(content, 8)[1] != etag


def test_an_invalid_composition_is_never_published() -> None:
    unchecked = FallbackAction.model_construct(kind="fallback", priority_at_or_below=1, mode="default")
    with pytest.raises(ValueError, match="default_outputs"):
        document(compose("a", [_active("x", unchecked)], buckets_ms=[10], export_interval_s=5, poll_interval_s=5), 1)


def test_overflow_rules_compose_as_a_union_and_step_down_by_halving_or_by_level() -> None:
    active = [
        _active("deadline", {"kind": "overflow", "mode": "deadline"}),
        _active("share", {"kind": "overflow", "mode": "fraction", "fraction": 0.8}, step=2),  # now 0.2
        _active("share2", {"kind": "overflow", "mode": "fraction", "fraction": 0.1}),
        _active("low", {"kind": "overflow", "mode": "priority", "priority_at_or_below": 2}, step=1),  # now 3
        _active("lower", {"kind": "overflow", "mode": "priority", "priority_at_or_below": 3}, model=None),
    ]
    content = compose("agent1", active, buckets_ms=[10], export_interval_s=5, poll_interval_s=2)
    assert content.model_dump(exclude_unset=True)["models"] == {
        "mlp": {"overflow": {"fraction": 0.2, "at_or_below": 3}},
        "*": {"overflow": {"fraction": 0.0, "at_or_below": 3}},
    }
    parsed = PolicyDocument.model_validate(document(content, 1)[0])
    assert parsed.for_model("mlp").overflow == parsed.models["mlp"].overflow
    only_deadline = compose("a", [_active("d", {"kind": "overflow"})], buckets_ms=[10], export_interval_s=5,
                            poll_interval_s=2)  # fmt: skip
    assert only_deadline.model_dump(exclude_unset=True)["models"] == {
        "mlp": {"overflow": {"fraction": 0.0, "at_or_below": None}}
    }
    halved = stepped_action(ACTION.validate_python({"kind": "overflow", "mode": "fraction", "fraction": 0.5}), 3)
    assert halved.model_dump()["fraction"] == 0.0625
    shed = stepped_action(ACTION.validate_python({"kind": "shed", "priority_at_or_below": 63}), 5)
    assert shed.model_dump()["priority_at_or_below"] == 64


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ({"kind": "overflow", "mode": "fraction"}, "needs fraction"),
        ({"kind": "overflow", "mode": "priority"}, "needs priority_at_or_below"),
        ({"kind": "overflow", "mode": "deadline", "fraction": 0.5}, "fraction is for mode 'fraction'"),
        ({"kind": "overflow", "mode": "fraction", "fraction": 1.5}, "less than or equal to 1"),
        ({"kind": "overflow", "mode": "everything"}, "deadline"),
    ],
)
def test_an_overflow_action_that_misses_its_parameter_is_refused_naming_it(action: dict, message: str) -> None:
    from pydantic import TypeAdapter, ValidationError

    from controlplane.schemas.rules import Action

    with pytest.raises(ValidationError, match=message):
        TypeAdapter(Action).validate_python(action)
