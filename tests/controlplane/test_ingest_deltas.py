"""Cumulative-to-delta conversion: restarts, duplicates and out-of-order exports never double count or lose."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.ingest.deltas import DeltaTracker, Point


def sum_point(start: int, time: int, value: float, stream: str = "s") -> Point:
    return Point(stream=stream, kind="sum", start=start, time=time, value=value)


def test_plain_cumulative_becomes_differences() -> None:
    tracker = DeltaTracker()
    deltas = [tracker.delta(sum_point(0, t, v)) for t, v in ((1, 5), (2, 9), (3, 9), (4, 20))]
    assert [d.value if d else None for d in deltas] == [5, 4, 0, 11]


def test_restart_duplicate_and_late_points() -> None:
    tracker = DeltaTracker()
    assert tracker.delta(sum_point(0, 1, 5)).value == 5  # type: ignore[union-attr]
    assert tracker.delta(sum_point(0, 1, 5)) is None  # duplicate export
    assert tracker.delta(sum_point(10, 11, 3)).value == 3  # type: ignore[union-attr]  # restarted: new start
    assert tracker.delta(sum_point(0, 2, 8)).value == 3  # type: ignore[union-attr]  # late point of the old run
    assert tracker.delta(sum_point(10, 12, 1)).value == 1  # type: ignore[union-attr]  # went down: a reset


def test_after_a_control_plane_restart_old_runs_are_a_baseline_not_counted_again() -> None:
    before = DeltaTracker(horizon_ns=10)  # the first process was up before the run began
    assert before.delta(sum_point(50, 110, 7)).value == 7  # type: ignore[union-attr]
    after = DeltaTracker(horizon_ns=200)  # the restarted process: 7 were counted already
    assert after.delta(sum_point(50, 210, 9)) is None  # a baseline
    assert after.delta(sum_point(50, 220, 12)).value == 3  # type: ignore[union-attr]  # what follows counts
    assert after.delta(sum_point(205, 230, 4)).value == 4  # type: ignore[union-attr]  # a run begun since: in full


def test_histograms_subtract_bucket_by_bucket() -> None:
    tracker = DeltaTracker()
    first = Point("h", "histogram", 0, 1, count=3, total=0.3, buckets=(1, 2, 0), bounds=(0.1, 0.5))
    second = Point("h", "histogram", 0, 2, count=7, total=1.0, buckets=(2, 3, 2), bounds=(0.1, 0.5))
    tracker.delta(first)
    d = tracker.delta(second)
    assert d is not None and (d.count, d.buckets) == (4, (1, 1, 2)) and abs(d.total - 0.7) < 1e-9
    other_bounds = Point("h", "histogram", 0, 3, count=8, total=1.1, buckets=(8, 0), bounds=(1.0,))
    assert tracker.delta(other_bounds).count == 8  # type: ignore[union-attr]  # new layout: counted from zero


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=8), min_size=1, max_size=3),
    duplicates=st.integers(min_value=0, max_value=5),
    seed=st.integers(min_value=0, max_value=10_000),
)
def test_totals_are_never_double_counted_or_lost(runs: list[list[int]], duplicates: int, seed: int) -> None:
    """An agent restarts len(runs) times; its exports arrive shuffled and some twice; each run's last point last."""
    exports: list[Point] = []
    finals: list[Point] = []
    truth = 0
    for r, increments in enumerate(runs):
        start, cumulative = r * 1000, 0
        for i, inc in enumerate(increments):
            cumulative += inc
            exports.append(sum_point(start, start + i + 1, cumulative))
        truth += cumulative
        finals.append(exports.pop())  # the run's last export arrives after the others
    rng = random.Random(seed)
    exports += rng.choices(exports, k=duplicates) if exports else []
    rng.shuffle(exports)
    tracker = DeltaTracker()
    counted = 0.0
    for point in exports + finals:
        delta = tracker.delta(point)
        if delta is not None:
            counted += delta.value
    assert counted == truth


def test_delta_points_pass_through_and_memory_is_bounded() -> None:
    tracker = DeltaTracker(max_streams=10)
    delta = Point("d", "sum", 0, 1, value=4, cumulative=False)
    assert tracker.delta(delta) is delta
    for i in range(100):
        tracker.delta(sum_point(0, 1, 1, stream=f"s{i}"))
    assert len(tracker) == 10
