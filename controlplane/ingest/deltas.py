"""Cumulative OTLP streams become deltas, aware of restarts, duplicates and out-of-order exports.

A stream is one metric's points with one attribute set from one agent. Exporters send cumulative values since
a start time; the control plane needs what happened between exports. For each stream and start time the last
point seen is kept:
  - a point at or before the last one of its run (same start) is a duplicate or late: it adds nothing;
  - a point of a new run (a new start time: the agent restarted) counts from zero;
  - a value that went down within a run is a reset (a counter cannot go down): it counts from zero;
  - a run older than the newest few is forgotten, so memory stays bounded.
Delta-temporality points pass through unchanged. Totals are thus never counted twice and never lost, whatever
order the exports arrive in, as long as each run's last point arrives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

RUNS_KEPT = 4


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

    def minus(self, earlier: Point) -> Point:
        # Built field by field (not `dataclasses.replace`): this runs for every point of every export.
        if self.kind == "sum":
            return Point(self.stream, self.kind, self.start, self.time, self.value - earlier.value, self.count,
                         self.total, self.buckets, self.bounds, cumulative=False)  # fmt: skip
        buckets = tuple(a - b for a, b in zip(self.buckets, earlier.buckets, strict=True))
        return Point(self.stream, self.kind, self.start, self.time, self.value, self.count - earlier.count,
                     self.total - earlier.total, buckets, self.bounds, cumulative=False)  # fmt: skip

    def as_delta(self) -> Point:
        """This point as a delta from zero (the first of a run, or after a reset)."""
        return Point(self.stream, self.kind, self.start, self.time, self.value, self.count, self.total, self.buckets,
                     self.bounds, cumulative=False)  # fmt: skip

    def went_down_from(self, earlier: Point) -> bool:
        if self.kind == "sum":
            return self.value < earlier.value
        if self.bounds != earlier.bounds or len(self.buckets) != len(earlier.buckets):
            return True  # new bucket layout: a new series as far as deltas go
        return self.count < earlier.count or any(a < b for a, b in zip(self.buckets, earlier.buckets, strict=True))


class DeltaTracker:
    """Turns cumulative points into deltas; bounded to `max_streams` streams (least recently seen dropped).

    `horizon_ns` (the control plane's start): a run that started before it and that this tracker has not seen
    may have been counted by the process before this one (a restart), so its first point is only a baseline:
    what it adds from then on counts, what it held does not. Without a horizon every new run counts in full.
    A stream dropped for the bound moves the horizon to the time it was dropped, for the same reason.
    """

    def __init__(self, max_streams: int = 1_000_000, *, horizon_ns: int | None = None) -> None:
        self.max_streams = max_streams
        self.horizon_ns = horizon_ns
        self._runs: OrderedDict[Hashable, OrderedDict[int, Point]] = OrderedDict()

    def delta(self, point: Point) -> Point | None:
        """What this point adds since the last one of its run; None when it adds nothing."""
        if not point.cumulative:
            return point
        runs = self._runs.get(point.stream)
        if runs is None:
            runs = OrderedDict()
            self._runs[point.stream] = runs
            if len(self._runs) > self.max_streams:
                self._runs.popitem(last=False)
                if self.horizon_ns is not None:
                    self.horizon_ns = max(self.horizon_ns, point.time)
        else:
            self._runs.move_to_end(point.stream)
        last = runs.get(point.start)
        if last is None:
            if runs and point.start < min(runs) and len(runs) >= RUNS_KEPT:
                return None  # a run so old it was forgotten: counting it again could double count
            runs[point.start] = point
            while len(runs) > RUNS_KEPT:
                runs.pop(min(runs))
            if self.horizon_ns is not None and point.start < self.horizon_ns:
                return None  # begun before this process: perhaps counted by the one before; a baseline
            return point.as_delta()
        if point.time <= last.time:
            return None  # duplicate or late: the newer point already covered it
        runs[point.start] = point
        if point.went_down_from(last):
            return point.as_delta()  # reset within a run: count from zero
        return point.minus(last)

    def __len__(self) -> int:
        return len(self._runs)
