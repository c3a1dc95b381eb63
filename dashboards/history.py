"""Readings over time from the control plane's history API, shaped for the charts.

`GET /api/v1/agents/{id}/metrics/history`, `GET /api/v1/metrics/history` (the fleet) and `GET /api/v1/slos/{id}/history`
answer every step of a window, oldest first, from the minute rollups: a chart opened now shows the last hours. Each
shaper here turns an answer into long form (time, series, value), one row per series and step. A step where a series
has no figure (null) is a gap in its line, never a zero: the rows around a gap carry different `segment` numbers,
and the charts draw one path per (series, segment).

Plain functions over the API's JSON (no Streamlit), so they are tested on their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd

from dashboards.describe import labels_text
from dashboards.fmt import seconds

MAX_POINTS = 360  # per chart: the history API answers at most 720
STEPS = (("1m", 60), ("5m", 300), ("15m", 900), ("1h", 3600), ("6h", 21600))  # the API's step choices, smallest first
GIB = 2**30
COLUMNS = ["time", "series", "value", "segment"]

Picker = Callable[[dict[str, Any]], dict[str, Any]]


def step_for(window: str, max_points: int = MAX_POINTS) -> str:
    """The smallest step that draws `window` in at most `max_points` points (the coarsest one beyond that)."""
    span = seconds(window)
    for name, size in STEPS:
        if span <= size * max_points:
            return name
    return STEPS[-1][0]


SLO_MINUTES_S = 6 * 3600  # an SLO's history beyond this is counted from whole hours: the API wants a step of 1h


def slo_step_for(window: str) -> str:
    """`step_for` an SLO's history: at least 1h for a window beyond 6 h (the API answers 422 naming `step` else)."""
    step = step_for(window)
    return "1h" if seconds(window) > SLO_MINUTES_S and seconds(step) < 3600 else step


def long_form(points: Iterable[dict[str, Any]], pick: Picker) -> pd.DataFrame:
    """One row per (step, series) for every series `pick` names in any step, null where a step lacks it; each
    series' runs of figures numbered as `segment`s (a null ends a run), and the null rows left out."""
    steps = [(pd.Timestamp(p["ts"]), pick(p)) for p in points]
    names: list[str] = []
    for _, values in steps:
        names += [n for n in values if n not in names]
    rows = []
    for name in names:
        segment, gap = 0, True
        for at, values in steps:
            value = values.get(name)
            if value is None or pd.isna(value):
                gap = True
                continue
            if gap:
                segment, gap = segment + 1, False
            rows.append({"time": at, "series": name, "value": float(value), "segment": segment})
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame["time"] = pd.to_datetime(frame["time"], utc=True)
    return frame


def _group(group: dict[str, Any]) -> str:
    return f"{group['model']} p{group['priority']}"


def latency(points: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """p50/p95/p99 of locally served requests per model and priority (ms)."""
    return long_form(points, lambda p: {f"{_group(g)} {q}": g.get(f"{q}_ms") for g in p.get("groups") or []
                                        for q in ("p50", "p95", "p99")})  # fmt: skip


def queue_depth(points: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """The last queue-depth reading of each step per model and priority."""
    return long_form(points, lambda p: {_group(g): g.get("queue_depth") for g in p.get("groups") or []})


def _gauges(point: dict[str, Any], wanted: Callable[[str], bool], scale: float = 1.0) -> dict[str, Any]:
    return {f"{d['metric']} {labels_text(d.get('attributes'))}".strip():
            None if d.get("last") is None else d["last"] / scale
            for d in point.get("device") or [] if wanted(d["metric"])}  # fmt: skip


def gpu_memory(points: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """GPU memory used and its limit per GPU (GiB)."""
    return long_form(points, lambda p: _gauges(p, lambda m: m.startswith("hw.gpu.memory"), GIB))


def temperature(points: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Temperatures per sensor (°C)."""
    return long_form(points, lambda p: _gauges(p, lambda m: m.startswith("hw.temperature")))


def generation_latency(points: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """TTFT and TPOT p99 per generative model (ms)."""
    return long_form(points, lambda p: {f"{g['model']} {what} p99": g.get(f"{what.lower()}_p99_ms")
                                        for g in p.get("generation") or [] for what in ("TTFT", "TPOT")})  # fmt: skip


def tokens_out(points: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Output tokens per second per generative model."""
    return long_form(points, lambda p: {g["model"]: g.get("tokens_out_per_s") for g in p.get("generation") or []})


def fleet(points: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """The fleet's requests/s and p99 (ms), series `requests/s` and `p99 ms`."""
    return long_form(points, lambda p: {"requests/s": p.get("rps"), "p99 ms": p.get("p99_ms")})


def burn_rates(points: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Each alert pair's long and short burn rate at each step (`56m/5m long`, `56m/5m short`)."""
    return long_form(points, lambda p: {f"{a['long']}/{a['short']} {w}": a.get(f"{w}_burn_rate")
                                        for a in p.get("alerts") or [] for w in ("long", "short")})  # fmt: skip


def thresholds(points: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Each alert pair's threshold (the last one stated)."""
    found: dict[str, float] = {}
    for point in points:
        for alert in point.get("alerts") or []:
            if alert.get("threshold") is not None:
                found[f"{alert['long']}/{alert['short']}"] = float(alert["threshold"])
    return found


def budget(points: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """The error budget left and the SLI over the SLO window at each step, as ratios (`budget left`, `SLI`)."""
    return long_form(points, lambda p: {"budget left": p.get("budget_remaining"), "SLI": p.get("window_sli")})
