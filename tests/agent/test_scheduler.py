"""The scheduler core with an injected clock: priorities, admission, batching, deadlines, aging, draining."""

from __future__ import annotations

import pytest

from edge_agent.scheduling.core import LevelPolicy, Pending, Scheduler, SchedulerConfig


class Linear:
    """Compute time = base + per_row * rows (like the demo model: ~3 ms at 1, ~9 ms at 32)."""

    def __init__(self, base: float = 0.003, per_row: float = 0.0002) -> None:
        self.base, self.per_row = base, per_row

    def predict(self, batch_size: int) -> float:
        return self.base + self.per_row * batch_size


def make(**over: object) -> Scheduler:
    config = {
        "max_batch_size": 8,
        "preferred_batch_sizes": (4,),
        "max_queue_delay_s": 0.002,
        "levels": (LevelPolicy(), LevelPolicy(), LevelPolicy()),
        "default_level": 2,
    }
    config.update(over)
    return Scheduler(SchedulerConfig(**config), Linear())  # type: ignore[arg-type]


def req(level: int = 2, now: float = 0.0, rows: int = 1, deadline: float | None = None, tag: str = "") -> Pending:
    return Pending(rows=rows, level=level, arrival=now, deadline=deadline, payload=tag)


def tags(batch: object) -> list[str]:
    return [r.payload for r in batch.requests]  # type: ignore[attr-defined]


def test_higher_levels_fill_the_batch_first_and_fifo_within_a_level() -> None:
    s = make(max_batch_size=4, preferred_batch_sizes=())
    for i, level in enumerate([3, 2, 1, 3, 1, 2]):
        assert s.admit(req(level, tag=f"{level}.{i}"), 0.0) is None
    step = s.step(0.0)
    assert [tags(b) for b in step.dispatch] == [["1.2", "1.4", "2.1", "2.5"]]
    assert s.depth() == [0, 0, 2]


def test_a_full_batch_leaves_at_once_and_nothing_leaves_while_the_instance_is_busy() -> None:
    s = make()
    for i in range(4):
        s.admit(req(tag=str(i)), 0.0)
    first = s.step(0.0)
    assert len(first.dispatch) == 1 and first.dispatch[0].rows == 4
    for i in range(6):
        s.admit(req(now=0.001, tag=str(i)), 0.001)
    assert s.step(0.002).dispatch == ()  # the only instance is busy
    s.complete(first.dispatch[0].id, 0.01)
    second = s.step(0.01)
    assert tags(second.dispatch[0]) == ["0", "1", "2", "3"]  # the preferred size leaves at once
    s.complete(second.dispatch[0].id, 0.02)
    for i in range(6, 12):
        s.admit(req(now=0.02, tag=str(i)), 0.02)
    assert s.step(0.02).dispatch[0].rows == 8  # 8 queued: a full batch, not the preferred 4


def test_a_lone_request_probes_the_window_once_then_leaves_at_once_when_nobody_comes() -> None:
    s = make()
    s.admit(req(tag="a"), 0.0)
    waiting = s.step(0.0)
    assert waiting.dispatch == () and waiting.wake_at == pytest.approx(0.002)
    left = s.step(0.002)
    assert tags(left.dispatch[0]) == ["a"]
    s.complete(left.dispatch[0].id, 0.006)
    # The wait gained nothing: the next lone request does not wait at all.
    s.admit(req(now=0.01, tag="b"), 0.01)
    assert tags(s.step(0.01).dispatch[0]) == ["b"]
    assert s.wait_rate == 0.0


def test_waiting_continues_while_requests_keep_coming_and_stops_when_the_burst_ends() -> None:
    s = make(max_batch_size=16, preferred_batch_sizes=(16,), max_queue_delay_s=0.010)
    s.admit(req(tag="0"), 0.0)
    assert s.step(0.0).dispatch == ()  # first wait: probing
    for i in range(1, 5):  # four more, 0.5 ms apart
        now = i * 0.0005
        s.admit(req(now=now, tag=str(i)), now)
        assert s.step(now).dispatch == ()
    gone = s.step(0.010)
    assert gone.dispatch[0].rows == 5
    s.complete(gone.dispatch[0].id, 0.012)
    # Now the rate is known (~500/s): a new burst waits while arrivals come, and stops ~2 gaps after the last.
    s.admit(req(now=0.020), 0.020)
    step = s.step(0.020)
    assert step.dispatch == ()
    s.admit(req(now=0.0203), 0.0203)
    step = s.step(0.0203)
    assert step.dispatch == ()
    assert step.wake_at is not None and step.wake_at < 0.030  # before the 10 ms window ends
    assert s.step(step.wake_at).dispatch[0].rows == 2


def test_no_slack_left_sends_the_batch_before_the_window_ends() -> None:
    s = make(max_queue_delay_s=0.050)
    s.admit(req(deadline=0.010, tag="urgent"), 0.0)
    step = s.step(0.0)
    # Compute for 1 row is predicted 3.2 ms, so the batch must leave by 10 - 3.2 = 6.8 ms.
    assert step.dispatch == () and step.wake_at == pytest.approx(0.0068)
    assert s.step(0.0067).dispatch == ()
    assert tags(s.step(step.wake_at).dispatch[0]) == ["urgent"]


def test_admission_refuses_a_deadline_it_cannot_meet_at_arrival() -> None:
    s = make(max_batch_size=4, preferred_batch_sizes=())
    for _ in range(12):  # three full batches ahead at level 2: 3 x 3.8 ms
        assert s.admit(req(), 0.0) is None
    assert s.predict_completion(2, 1, 0.0) == pytest.approx(3 * 0.0038 + 0.0032)
    refused = s.admit(req(deadline=0.010), 0.0)
    assert refused is not None and refused.reason == "deadline_unmeetable" and refused.retry_after_s >= 1
    # A higher level does not wait behind level 2, so the same deadline is fine there.
    assert s.admit(req(level=1, deadline=0.010), 0.0) is None


def test_a_stale_estimate_that_refuses_everything_is_checked_once_idle_and_corrected() -> None:
    # The warm-up was taken on a busy machine: 80 ms predicted, while the model really takes 3 ms. Every request
    # has a 50 ms deadline, so without a check nothing would ever run and the estimate would never be corrected.
    from edge_agent.runtime.profile import ComputeProfile

    profile = ComputeProfile({1: 0.080}, alpha=0.2)
    s = Scheduler(SchedulerConfig(max_batch_size=1, recheck_after_s=1.0), profile)
    now = 0.0
    first = req(1, now, deadline=now + 0.050)
    assert s.admit(first, now) is None  # idle and never checked: this one is let through to check the estimate
    assert s.admit(req(1, now, deadline=now + 0.050), now).reason == "deadline_unmeetable"  # type: ignore[union-attr]
    batch = s.step(now).dispatch[0]
    now += 0.003
    s.complete(batch.id, now)
    profile.observe(1, 0.003)  # what the worker does with the measured batch
    # Checked just now: the next refusals stand until the model has been idle and unchecked for recheck_after_s.
    assert s.admit(req(1, now, deadline=now + 0.050), now).reason == "deadline_unmeetable"  # type: ignore[union-attr]
    admitted = 1
    for _ in range(10):  # a request every 1.1 s: each check takes a fifth of the gap to the real 3 ms off
        now += 1.1
        if s.predict_completion(1, 1, now) <= 0.050:
            break
        assert s.admit(req(1, now, deadline=now + 0.050), now) is None
        admitted += 1
        batch = s.step(now).dispatch[0]
        now += 0.003
        s.complete(batch.id, now)
        profile.observe(1, 0.003)
    assert profile.predict(1) < 0.050 and admitted == 3  # 80 -> 64.6 -> 52.3 -> 42.4 ms: admitted on merit again
    assert s.admit(req(1, now, deadline=now + 0.050), now) is None


def test_no_check_while_busy_or_when_turned_off() -> None:
    s = make(max_batch_size=4, preferred_batch_sizes=())
    for _ in range(12):  # not idle: the refusal is about the queue, which is measured, not about a stale estimate
        assert s.admit(req(), 0.0) is None
    assert s.admit(req(deadline=0.010), 5.0).reason == "deadline_unmeetable"  # type: ignore[union-attr]
    off = make(recheck_after_s=0.0)
    assert off.admit(req(deadline=0.001), 0.0).reason == "deadline_unmeetable"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="recheck_after_s"):
        SchedulerConfig(recheck_after_s=-1.0)


def test_queue_full_per_level_and_overall() -> None:
    s = make(levels=(LevelPolicy(), LevelPolicy(max_queue_size=2), LevelPolicy()), max_queued_requests=5)
    assert s.admit(req(2), 0.0) is None and s.admit(req(2), 0.0) is None
    full = s.admit(req(2), 0.0)
    assert full is not None and full.reason == "queue_full" and "priority 2" in full.message
    for _ in range(3):
        assert s.admit(req(3), 0.0) is None
    assert s.admit(req(1), 0.0).reason == "queue_full"  # type: ignore[union-attr]


def test_deadlines_that_pass_in_the_queue_expire_or_are_delayed_by_policy() -> None:
    levels = (LevelPolicy(), LevelPolicy(timeout_action="DELAY"), LevelPolicy(timeout_action="REJECT"))
    s = make(levels=levels, max_batch_size=1, preferred_batch_sizes=())
    s.admit(req(1, tag="busy"), 0.0)
    running = s.step(0.0).dispatch[0]
    s.admit(req(2, deadline=0.1, tag="delayed"), 0.0)
    s.admit(req(3, deadline=0.1, tag="rejected"), 0.0)
    s.admit(req(2, tag="live"), 0.15)
    step = s.step(0.2)
    assert [r.payload for r in step.expired] == ["rejected"]
    assert s.depth() == [0, 2, 0]  # DELAY: kept, without a deadline, behind its level's live requests
    s.complete(running.id, 0.2)
    assert tags(s.step(0.2).dispatch[0]) == ["live"]


def test_deadline_from_level_policy_and_override() -> None:
    levels = (
        LevelPolicy(default_timeout_s=0.5, allow_timeout_override=True),
        LevelPolicy(default_timeout_s=0.5, allow_timeout_override=False),
        LevelPolicy(),
    )
    s = make(levels=levels)
    assert s.deadline_for(1, 10.0, 0.1) == pytest.approx(10.1)
    assert s.deadline_for(1, 10.0, 2.0) == pytest.approx(10.5)  # may shorten, never lengthen
    assert s.deadline_for(2, 10.0, 0.1) == pytest.approx(10.5)  # override not allowed
    assert s.deadline_for(3, 10.0, None) is None
    assert s.resolve_level(0) == 2
    assert s.resolve_level(4) == 2  # as Triton: beyond the levels means the default level
    with pytest.raises(ValueError, match=">= 0"):
        s.resolve_level(-1)


def test_aging_keeps_the_lowest_level_from_starving() -> None:
    s = make(max_batch_size=1, preferred_batch_sizes=(), aging_s=0.5)
    s.admit(req(3, tag="old-low"), 0.0)
    now = 0.0
    served: list[str] = []
    for i in range(10):  # a steady stream of level-1 requests, each served in 0.1 s
        s.admit(req(1, now=now, tag=f"hi{i}"), now)
        batch = s.step(now).dispatch[0]
        served += tags(batch)
        now += 0.1
        s.complete(batch.id, now)
    assert "old-low" in served
    assert served.index("old-low") <= 6


def test_two_instances_run_two_batches_and_drain_refuses_new_work() -> None:
    s = make(instances=2, max_batch_size=2, preferred_batch_sizes=())
    for _ in range(5):
        s.admit(req(), 0.0)
    assert [b.rows for b in s.step(0.0).dispatch] == [2, 2]
    s.drain()
    refused = s.admit(req(), 0.0)
    assert refused is not None and refused.reason == "draining"
    assert not s.idle  # what was queued still runs
    with pytest.raises(ValueError, match="does not fit"):
        make().admit(req(rows=9), 0.0)


def test_multi_row_requests_never_block_the_queue() -> None:
    """A request bigger than a preferred size, but not one, still leaves (at the window end) with what follows."""
    s = make(max_batch_size=64, preferred_batch_sizes=(8, 16, 32))
    s.admit(req(rows=10, tag="ten"), 0.0)
    s.admit(req(rows=1, tag="one"), 0.0)
    step = s.step(0.0)
    assert step.dispatch == () and step.wake_at is not None
    batch = s.step(step.wake_at).dispatch[0]
    assert tags(batch) == ["ten", "one"] and batch.rows == 11
    # With a preferred size reachable as a prefix, that prefix leaves at once.
    s.complete(batch.id, 0.01)
    for rows, tag in ((6, "a"), (2, "b"), (5, "c")):
        s.admit(req(rows=rows, now=0.01, tag=tag), 0.01)
    assert tags(s.step(0.01).dispatch[0]) == ["a", "b"]


def test_only_requests_of_one_shape_share_a_batch() -> None:
    s = make(max_batch_size=8, preferred_batch_sizes=())
    for tag, shape in (("a", (3,)), ("b", (3,)), ("c", (5,)), ("d", (3,))):
        s.admit(Pending(rows=1, level=2, arrival=0.0, deadline=None, payload=tag, shape=shape), 0.0)
    first = s.step(0.0).dispatch[0]
    assert tags(first) == ["a", "b"]  # the batch ends where the shape changes; FIFO is kept
    s.complete(first.id, 0.01)
    second = s.step(0.01).dispatch[0]
    assert tags(second) == ["c"]


def test_delay_at_the_only_level_is_served_late_not_rejected() -> None:
    s = make(levels=(LevelPolicy(timeout_action="DELAY", default_timeout_s=0.01),), default_level=1,
             max_batch_size=1, preferred_batch_sizes=())  # fmt: skip
    s.admit(req(1, tag="busy"), 0.0)
    running = s.step(0.0).dispatch[0]
    # Admission does not refuse what the policy says to serve late, however long the wait.
    assert s.admit(req(1, deadline=0.001, tag="late"), 0.0) is None
    assert s.step(0.5).expired == ()
    s.complete(running.id, 0.5)
    assert tags(s.step(0.5).dispatch[0]) == ["late"]


def test_retuned_batching_takes_effect_on_the_queued_requests_and_none_restores_the_config() -> None:
    s = make(preferred_batch_sizes=(), max_queue_delay_s=1.0)
    for i in range(3):
        s.admit(req(tag=str(i)), 0.0)
    assert s.step(0.0).dispatch == ()  # waiting: a 1 s window, and waiting may grow the batch
    s.retune(preferred_batch_sizes=(2,))
    first = s.step(0.0)
    assert [tags(b) for b in first.dispatch] == [["0", "1"]]  # a queued prefix is now a preferred size
    s.complete(first.dispatch[0].id, 0.001)
    s.retune(max_queue_delay_s=0.0)
    assert [tags(b) for b in s.step(0.001).dispatch] == [["2"]]  # no window any more: it leaves at once
    s.retune()
    assert s.config == s.base_config and s.config.max_queue_delay_s == 1.0 and s.config.preferred_batch_sizes == ()
