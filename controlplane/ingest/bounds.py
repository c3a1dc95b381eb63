"""The bucket bounds each histogram the control plane reads must arrive with, and exact re-bucketing onto them.

Percentiles and latency SLOs come from bucket counts, and counts mean nothing without the right bounds in the right
unit: an OTel SDK's default bounds (0, 5, 10, 25, ... 10000, meant for milliseconds) on `spillway.request.duration`
(seconds) put every request under 5 ms into a bucket read as "0 to 5 s", so a mean of 4 ms came with a p50 of
2500 ms. So a data point of one of those histograms (`Layouts.expected`) is stored only when its explicit bounds are:
  - the expected ones;
  - finer: a superset of them. Each sent bucket then lies inside one expected bucket, so its count is added to that
    one (exact, no interpolation) and the point is stored on the expected bounds;
  - for the latency histograms only, coarser: a non-empty subset of the control plane's latency boundaries, as an
    agent whose own `latency_buckets_ms` lists fewer of them sends until its policy sets the control plane's. Stored
    as sent, and exact: each bucket is still a range of the expected layout; a stored row holds one layout (a
    histogram's row key includes its bounds, `attributes.layout_key`, so the minute in which an agent switches
    layouts gets a row per layout rather than buckets added across layouts); and readers merge layouts by moving
    every bucket whole onto the boundaries all of them share. So percentiles and SLO counts over a window that mixes
    points on the full bounds and on a subset are exactly those of every observation on the shared bounds (as
    tests/controlplane/test_ingest_bounds.py counts by hand); an SLO threshold on a bound that only some layouts
    have counts conservatively there (whole buckets only: never a slow request as good).
Anything else (other values: the SDK's defaults, milliseconds for seconds, an agent's own latency buckets that are
neither) is refused through OTLP's partial_success, with a message naming the metric, the bounds sent and those
expected, and the SDK View that sends them. A histogram in seconds must also say unit `s` (or none). Histograms of
other metrics are stored as sent.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from spillway.contract.names import (
    BATCH_SIZE,
    BATCH_SIZE_BUCKETS,
    DEFAULT_LATENCY_BUCKETS_MS,
    DURATIONS,
    GENAI_DURATION_BUCKETS,
    GENAI_REQUEST_DURATION,
    GENAI_TOKEN_BUCKETS,
    GENAI_TOKEN_USAGE,
    GENAI_TPOT,
    GENAI_TPOT_BUCKETS,
    GENAI_TTFT,
    GENAI_TTFT_BUCKETS,
    STEP_TOKEN_BUCKETS,
    STEP_TOKENS,
)

_REL = 1e-9  # bounds this close are the same bound (ms / 1000 computed on either side, or typed as 0.005)
_SHOWN = 20  # bounds listed in a message, at most
_FITS_KEPT = 10_000  # (metric, unit, bounds) verdicts remembered; cleared when it grows past this
_CACHED_BOUNDS = 64  # longer layouts are judged afresh each time (no agent sends them; they would fill memory)


@dataclass(frozen=True, slots=True)
class Layout:
    """What a histogram metric's data points must bring."""

    bounds: tuple[float, ...]
    unit: str | None = None  # the unit required (or none sent); None: any
    coarser: bool = False  # a non-empty subset of `bounds` is stored as sent (the latency histograms)
    setting: str = ""  # where the bounds come from, for the message


@dataclass(frozen=True, slots=True)
class Fit:
    """How one sent layout is stored: on `bounds`, sent bucket i added to stored bucket `into[i]` (None: the counts
    as sent); or refused, `problem` saying why."""

    bounds: tuple[float, ...] = ()
    into: tuple[int, ...] | None = None
    problem: str | None = None

    def buckets(self, counts: Sequence[int]) -> tuple[int, ...]:
        """The sent bucket counts on the stored bounds (a point without counts keeps none)."""
        if self.into is None or not counts:
            return tuple(counts)
        out = [0] * (len(self.bounds) + 1)
        for target, n in zip(self.into, counts, strict=True):
            out[target] += n
        return tuple(out)


class Layouts:
    """The expected layout of each histogram metric the control plane reads (the latency histograms' from its
    `latency_buckets_ms`, in seconds, the unit the agents export), and the fit of each sent layout, remembered.
    Not thread-safe: the receiver calls it under its lock."""

    def __init__(self, latency_buckets_ms: Iterable[float] = DEFAULT_LATENCY_BUCKETS_MS) -> None:
        latency = tuple(ms / 1000 for ms in sorted(set(latency_buckets_ms)))
        setting = "the control plane's SPILLWAY_LATENCY_BUCKETS_MS, in seconds"
        self.expected: dict[str, Layout] = {name: Layout(latency, "s", True, setting) for name in DURATIONS}
        self.expected |= {
            BATCH_SIZE: Layout(BATCH_SIZE_BUCKETS),
            GENAI_TTFT: Layout(GENAI_TTFT_BUCKETS, "s", setting="the GenAI semantic conventions'"),
            GENAI_TPOT: Layout(GENAI_TPOT_BUCKETS, "s", setting="the GenAI semantic conventions'"),
            GENAI_REQUEST_DURATION: Layout(GENAI_DURATION_BUCKETS, "s", setting="the GenAI semantic conventions'"),
            GENAI_TOKEN_USAGE: Layout(GENAI_TOKEN_BUCKETS, setting="the GenAI semantic conventions'"),
            STEP_TOKENS: Layout(STEP_TOKEN_BUCKETS),
        }
        self._fits: dict[tuple[str, str, tuple[float, ...]], Fit] = {}

    def fit(self, metric: str, unit: str, bounds: tuple[float, ...]) -> Fit:
        """How a data point of `metric` in `unit` with these explicit bounds (finite, increasing) is stored."""
        layout = self.expected.get(metric)
        if layout is None:
            return Fit(bounds)
        if len(bounds) > _CACHED_BOUNDS:
            return fit(metric, unit, bounds, layout)
        key = (metric, unit, bounds)
        found = self._fits.get(key)
        if found is None:
            if len(self._fits) >= _FITS_KEPT:
                self._fits.clear()
            found = self._fits[key] = fit(metric, unit, bounds, layout)
        return found


def fit(metric: str, unit: str, sent: tuple[float, ...], layout: Layout) -> Fit:
    """How a layout sent for `metric` is stored under `layout` (see the module's docstring)."""
    expected = layout.bounds
    if layout.unit is not None and unit not in ("", layout.unit):
        return Fit(problem=f"{metric} in unit '{unit}' refused: it must be in '{layout.unit}'")
    if all(_index(sent, bound) is not None for bound in expected):
        if len(sent) == len(expected):
            return Fit(expected)
        into = []
        for upper in sent:  # sent bucket i, (sent[i-1], sent[i]], lies inside expected bucket j
            j = bisect_left(expected, upper)
            into.append(j - 1 if j > 0 and _same(expected[j - 1], upper) else j)
        return Fit(expected, (*into, len(expected)))  # the +Inf bucket to the +Inf bucket
    if layout.coarser and sent:
        at = [_index(expected, bound) for bound in sent]
        if all(i is not None for i in at):
            return Fit(tuple(expected[i] for i in at if i is not None))
    return Fit(problem=_refusal(metric, sent, layout))


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL, abs_tol=0.0)


def _index(values: tuple[float, ...], x: float) -> int | None:
    """Where `x` is among increasing `values` (within rounding), or None."""
    i = bisect_left(values, x)
    for j in (i - 1, i):
        if 0 <= j < len(values) and _same(values[j], x):
            return j
    return None


def _show(bounds: Sequence[float]) -> str:
    shown = ", ".join(f"{b:.12g}" for b in bounds[:_SHOWN])
    return f"[{shown}, ... ({len(bounds)} bounds)]" if len(bounds) > _SHOWN else f"[{shown}]"


def _refusal(metric: str, sent: tuple[float, ...], layout: Layout) -> str:
    expected = _show(layout.bounds)
    source = f" ({layout.setting})" if layout.setting else ""
    finer = "or finer buckets that include all of them" + (", or some of them" if layout.coarser else "")
    return (
        f"{metric} with explicit bounds {_show(sent)} refused: the control plane reads it on {expected}{source}, "
        f'{finer}. With an OpenTelemetry SDK, send these through a View: View(instrument_name="{metric}", '
        f"aggregation=ExplicitBucketHistogramAggregation({expected}))"
    )


__all__ = ["BATCH_SIZE_BUCKETS", "Fit", "Layout", "Layouts", "fit"]
