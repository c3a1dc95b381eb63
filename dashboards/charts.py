"""Altair charts for the pages: outcome mixes, latency percentiles, burn rates against their thresholds."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

from dashboards.fmt import event_kind

AnyChart = alt.Chart | alt.LayerChart | alt.FacetChart

OUTCOME_COLOURS = {
    "local": "#2e7d32",
    "overflow": "#1565c0",
    "fallback_cache": "#6a1b9a",
    "fallback_default": "#8e24aa",
    "queued_async": "#00838f",
    "rejected": "#ef6c00",
    "error": "#c62828",
}
# What the legend says for each outcome an agent reports (the `outcome` attribute of its request metrics).
OUTCOME_LABELS = {
    "local": "served on the device",
    "overflow": "overflowed to the cloud",
    "fallback_cache": "fallback: cached answer",
    "fallback_default": "fallback: default answer",
    "queued_async": "queued for later (async)",
    "rejected": "rejected (shed or refused)",
    "error": "error",
}
UNKNOWN_OUTCOME_COLOUR = "#757575"


def outcome_label(outcome: str) -> str:
    """The legend's words for an outcome; one this dashboard does not know yet shows under its own name."""
    return OUTCOME_LABELS.get(outcome, outcome)


def outcome_bars(rows: list[dict[str, Any]], group: str = "group", title: str = "Outcomes") -> AnyChart:
    """Requests per outcome, one stacked bar per group (e.g. model/priority); the legend in words, in the order
    of OUTCOME_COLOURS (served first, errors last), outcomes not known here after them in grey."""
    frame = pd.DataFrame(rows, columns=[group, "outcome", "requests"])
    present = set(frame["outcome"])
    domain = [o for o in OUTCOME_COLOURS if o in present] + sorted(present - set(OUTCOME_COLOURS))
    frame["label"] = frame["outcome"].map(outcome_label)
    frame["rank"] = frame["outcome"].map({o: i for i, o in enumerate(domain)})  # stacked in the legend's order
    labels = [outcome_label(o) for o in domain]
    colours = [OUTCOME_COLOURS.get(o, UNKNOWN_OUTCOME_COLOUR) for o in domain]
    return (
        alt.Chart(frame, title=title)
        .mark_bar()
        .encode(
            x=alt.X("requests:Q", stack="normalize", title="share of requests", axis=alt.Axis(format="%")),
            y=alt.Y(f"{group}:N", title=None),
            color=alt.Color("label:N", title="outcome", scale=alt.Scale(domain=labels, range=colours)),
            order=alt.Order("rank:Q"),
            tooltip=[group, alt.Tooltip("label:N", title="outcome"), alt.Tooltip("requests:Q", format=",.0f")],
        )
        .properties(height=alt.Step(26))
    )


def percentile_bars(rows: list[dict[str, Any]]) -> AnyChart:
    """p50/p95/p99 latency in ms per group, side by side."""
    frame = pd.DataFrame(rows, columns=["group", "percentile", "ms"])
    order = ["p50", "p95", "p99"]
    return (
        alt.Chart(frame, title="Latency of served requests (ms)")
        .mark_bar()
        .encode(
            x=alt.X("ms:Q", title="ms"),
            y=alt.Y("group:N", title=None),
            yOffset=alt.YOffset("percentile:N", sort=order),
            color=alt.Color("percentile:N", sort=order, title=None),
            tooltip=["group", "percentile", alt.Tooltip("ms:Q", format=".2f")],
        )
        .properties(height=alt.Step(16, **{"for": "offset"}))
    )


# Line charts draw as SVG (each point a mark a browser test can count; Streamlit's default for small charts too).
SVG = {"embedOptions": {"renderer": "svg"}}


def time_format(frame: pd.DataFrame) -> str:
    """The time axis' labels: hours and minutes within a day, the date too beyond one."""
    if len(frame) and frame["time"].max() - frame["time"].min() > pd.Timedelta(days=1):
        return "%m-%d %H:%M"
    return "%H:%M"


def lines(frame: pd.DataFrame, title: str, y_title: str, series: str = "series", height: int = 220,
          y_format: str = ",.3~f") -> alt.Chart:  # fmt: skip
    """Values over time (a `history` frame: time, series, value, segment), one line per series; a gap (a step
    without a figure) breaks its line: each (series, segment) is its own path."""
    return _lines(frame, title, y_title, series, height, y_format).properties(usermeta=SVG)


def _lines(frame: pd.DataFrame, title: str, y_title: str, series: str = "series", height: int = 220,
           y_format: str = ",.3~f") -> alt.Chart:  # fmt: skip
    """`lines` without the embed options (a layer states them once, at its top)."""
    if "segment" not in frame.columns:
        frame = frame.assign(segment=1)
    return (
        alt.Chart(frame, title=title)
        .mark_line(point=alt.OverlayMarkDef(size=18))
        .encode(
            x=alt.X("time:T", title=None, axis=alt.Axis(format=time_format(frame))),
            y=alt.Y("value:Q", title=y_title, axis=alt.Axis(format=y_format)),
            color=alt.Color(f"{series}:N", title=None),
            detail="segment:N",
            tooltip=[alt.Tooltip("time:T", format="%Y-%m-%d %H:%M"), series,
                     alt.Tooltip("value:Q", format=y_format)],
        )
        .properties(height=height)
    )  # fmt: skip


def burn_rate_bars(alerts: list[dict[str, Any]]) -> AnyChart:
    """Each alert pair's long and short burn rate now, with the pair's threshold as a red tick."""
    rows, limits = [], []
    for alert in alerts:
        pair = f"{alert['long']}/{alert['short']} ({alert.get('severity', '')})"
        limits.append({"pair": pair, "threshold": alert["threshold"]})
        for window in ("long", "short"):
            rows.append({"pair": pair, "window": window, "span": alert[window],
                         "burn rate": alert.get(f"{window}_burn_rate") or 0.0})  # fmt: skip
    frame, limit = pd.DataFrame(rows), pd.DataFrame(limits)
    pairs = list(limit["pair"])
    bars = (
        alt.Chart(frame, title="Burn rate now (red tick: the pair's threshold)")
        .mark_bar()
        .encode(
            x=alt.X("burn rate:Q", title="burn rate (x budget)"),
            y=alt.Y("pair:N", title=None, sort=pairs),
            yOffset=alt.YOffset("window:N", sort=["long", "short"]),
            color=alt.Color("window:N", sort=["long", "short"], title="window"),
            tooltip=["pair", "window", "span", alt.Tooltip("burn rate:Q", format=".2f")],
        )
    )
    ticks = (
        alt.Chart(limit)
        .mark_tick(color="#c62828", thickness=3)
        .encode(x="threshold:Q", y=alt.Y("pair:N", sort=pairs), tooltip=["pair", "threshold"])
    )
    return alt.layer(bars, ticks).properties(height=alt.Step(16, **{"for": "offset"}))


def burn_rate_history(frame: pd.DataFrame, thresholds: dict[str, float]) -> AnyChart:
    """Each alert pair's long and short burn rate over time (from the SLO's history), with each pair's threshold as
    a dashed red line."""
    base = _lines(frame, "Burn rate over time (dashed: each pair's threshold)", "burn rate (x budget)")
    rules = pd.DataFrame([{"threshold": t, "pair": p} for p, t in thresholds.items()], columns=["threshold", "pair"])
    marks = (
        alt.Chart(rules)
        .mark_rule(strokeDash=[6, 4], color="#c62828")
        .encode(y="threshold:Q", tooltip=["pair", "threshold"])
    )
    return alt.layer(base, marks).properties(usermeta=SVG)


def budget_history(frame: pd.DataFrame, objective: float | None) -> AnyChart:
    """The error budget left and the SLI over the SLO window over time (ratios, drawn in %), with the objective as
    a dashed line and 0 % budget as a grey one."""
    base = _lines(frame, "Budget left and SLI over time", "%", y_format=".2%")
    marks = [alt.Chart(pd.DataFrame([{"y": 0.0}])).mark_rule(color="#424242").encode(y="y:Q")]
    if objective is not None:
        target = pd.DataFrame([{"y": objective / 100, "what": "objective"}])
        line = alt.Chart(target).mark_rule(strokeDash=[6, 4], color="#2e7d32")
        marks.append(line.encode(y="y:Q", tooltip=["what"]))
    return alt.layer(base, *marks).properties(usermeta=SVG)


def budget_bars(states: list[dict[str, Any]]) -> AnyChart:
    """Error budget left per SLO (1 = untouched, 0 = spent, below 0 = overspent), worst first."""
    rows = [{"slo": s["name"], "budget left": s["budget_remaining"]}
            for s in states if s["budget_remaining"] is not None]  # fmt: skip
    frame = pd.DataFrame(rows, columns=["slo", "budget left"])
    order = list(frame.sort_values("budget left")["slo"])
    bars = (
        alt.Chart(frame, title="Error budget left")
        .mark_bar()
        .encode(
            x=alt.X("budget left:Q", axis=alt.Axis(format="%"), title=None),
            y=alt.Y("slo:N", sort=order, title=None),
            color=alt.condition("datum['budget left'] < 0", alt.value("#c62828"), alt.value("#2e7d32")),
            tooltip=["slo", alt.Tooltip("budget left:Q", format=".1%")],
        )
        .properties(height=alt.Step(26))
    )
    zero = alt.Chart(pd.DataFrame([{"x": 0}])).mark_rule(color="#424242").encode(x="x:Q")
    return alt.layer(bars, zero)


def event_timeline(events: list[dict[str, Any]]) -> AnyChart:
    """Events as points on a time axis, one row per kind."""
    frame = pd.DataFrame(
        [{"time": e["ts"], "kind": event_kind(e["kind"]), "actor": e["actor"], "id": e["id"]} for e in events],
        columns=["time", "kind", "actor", "id"],
    )
    frame["time"] = pd.to_datetime(frame["time"], utc=True, format="ISO8601")
    return (
        alt.Chart(frame, title="Timeline")
        .mark_circle(size=80)
        .encode(
            x=alt.X("time:T", title=None, axis=alt.Axis(format="%H:%M:%S")),
            y=alt.Y("kind:N", title=None),
            color=alt.Color("kind:N", legend=None),
            tooltip=[alt.Tooltip("time:T", format="%Y-%m-%d %H:%M:%S"), "kind", "actor", "id"],
        )
        .properties(height=alt.Step(24))
    )
