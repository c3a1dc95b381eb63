"""Cumulative OTLP streams become deltas, aware of restarts, duplicates and out-of-order exports.

A stream is one metric's points with one attribute set from one agent. Exporters send cumulative values since
a start time; the control plane needs what happened between exports. For each stream and start time the last
point seen is kept (its reading):
  - a point at or before the last one of its run (same start) is a duplicate or late: it adds nothing;
  - a point of a new run (a new start time: the agent restarted) counts from zero;
  - a value that went down within a run is a reset (a counter cannot go down): it counts from zero;
  - a run older than the newest few is forgotten, so memory stays bounded.
Delta-temporality points pass through unchanged. Totals are thus never counted twice and never lost, whatever
order the exports arrive in, as long as each run's last point arrives.

`advance` is that rule over one stream's runs; the receiver keeps the runs in the database (`ingest_streams`, read
and written in the transaction that adds the deltas, so replicas share them) and `DeltaTracker` keeps them in memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

RUNS_KEPT = 4

# A reading: the last point of one run, (time_unix_nano, count, total, buckets); a sum's value is its `total`.
Reading = tuple[int, int, float, tuple[int, ...]]
Delta = tuple[int, float, tuple[int, ...]]  # (count, total, buckets) added


def advance(runs: dict[int, Reading], start: int, reading: Reading, histogram: bool, horizon: int = 0) -> Delta | None:
    """What a cumulative point of run `start` adds since the last one of its run (None: nothing), updating `runs`
    (start -> last reading) in place. A run begun before `horizon` and not in `runs` is only a baseline: what it
    held may have been counted before the state was kept."""
    last = runs.get(start)
    if last is None:
        if len(runs) >= RUNS_KEPT and start < min(runs):
            return None  # a run so old it was forgotten: counting it again could double count
        runs[start] = reading
        while len(runs) > RUNS_KEPT:
            del runs[min(runs)]
        if start < horizon:
            return None
        return reading[1], reading[2], reading[3]
    if reading[0] <= last[0]:
        return None  # duplicate or late: the newer point already covered it
    runs[start] = reading
    _, count, total, buckets = reading
    if histogram:
        old = last[3]
        if count < last[1] or len(buckets) != len(old):
            return count, total, buckets  # reset within a run (or another layout): count from zero
        added = tuple([a - b for a, b in zip(buckets, old, strict=True)])  # (a list: faster than a generator)
        if added and min(added) < 0:
            return count, total, buckets  # a bucket went down: a reset
        return count - last[1], total - last[2], added
    if total < last[2]:
        return 0, total, ()  # reset
    return 0, total - last[2], ()


@dataclass(frozen=True, slots=True)
class Point:
    """One data point of a sum or histogram (gauges are not converted)."""

    stream: Hashable
    kind: Literal["sum", "histogram"]
    start: int  # start_time_unix_nano
    time: int  # time_unix_nano
    value: float = 0.0  # sums
    count: int = 0  # histograms
    total: float = 0.0
    buckets: tuple[int, ...] = ()
    bounds: tuple[float, ...] = ()
    cumulative: bool = True


class DeltaTracker:
    """Turns cumulative points into deltas in memory; bounded to `max_streams` streams (least recently seen dropped).

    `horizon_ns`: a run that started before it and that this tracker has not seen is only a baseline (`advance`).
    A stream dropped for the bound moves the horizon to the time it was dropped, for the same reason. A histogram's
    stream must keep one bucket layout (the receiver's streams do: their key includes the bounds).
    """

    def __init__(self, max_streams: int = 1_000_000, *, horizon_ns: int | None = None) -> None:
        self.max_streams = max_streams
        self.horizon_ns = horizon_ns
        self._runs: OrderedDict[Hashable, dict[int, Reading]] = OrderedDict()

    def delta(self, point: Point) -> Point | None:
        """What this point adds since the last one of its run; None when it adds nothing."""
        if not point.cumulative:
            return point
        runs = self._runs.get(point.stream)
        if runs is None:
            runs = self._runs[point.stream] = {}
            if len(self._runs) > self.max_streams:
                self._runs.popitem(last=False)
                if self.horizon_ns is not None:
                    self.horizon_ns = max(self.horizon_ns, point.time)
        else:
            self._runs.move_to_end(point.stream)
        histogram = point.kind == "histogram"
        reading = (point.time, point.count, point.total if histogram else point.value, point.buckets)
        added = advance(runs, point.start, reading, histogram, self.horizon_ns or 0)
        if added is None:
            return None
        count, total, buckets = added
        if histogram:
            return Point(point.stream, "histogram", point.start, point.time, 0.0, count, total, buckets, point.bounds,
                         cumulative=False)  # fmt: skip
        return Point(point.stream, "sum", point.start, point.time, total, cumulative=False)

    def __len__(self) -> int:
        return len(self._runs)


__all__ = ["RUNS_KEPT", "Delta", "DeltaTracker", "Point", "Reading", "advance"]
