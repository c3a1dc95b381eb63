"""An SLO over time, for charts: per step the events within it, and the SLO window's SLI, the budget left and every
alert pair's burn rates as the status would have said them at the step's end.

Counted from the evaluator's in-memory windows (`SloWindows.counts`): exact from the minutes of the last six hours,
from whole hours beyond (so a history longer than six hours takes steps of whole hours, ending on whole hours, and a
window shorter than an hour that reaches back beyond the six hours cannot be counted: its burn rate and whether its
pair fires are null there). Hours a window reaches
back to that the evaluator does not keep (an SLO window's far edge, some days ago) are read from the minute rollups
here, once per answer, at hour resolution.
"""

from __future__ import annotations

import math
from collections import defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from controlplane.history import Steps, epoch_minute, minute_start
from controlplane.query import RollupReader
from controlplane.slo.maths import Counts, budget_remaining, burn_rate, firing, sli
from controlplane.slo.windows import FINE_MINUTES, SloCounts, minutes_of

MIN_LONG_STEP_S = 3600
"""Histories longer than the minutes kept (six hours) take steps of at least an hour: older minutes are in hours."""


def _first_hour(counts: SloCounts, steps: Steps) -> int:
    """The oldest hour any figure of the history counts."""
    seconds = [counts.spec.window, *(a["long"] for a in counts.spec.alerts), *(a["short"] for a in counts.spec.alerts)]
    end = steps.start(0) + steps.minutes - 1  # the first step's last minute
    firsts = [steps.start(0)]
    for s in seconds:
        m = minutes_of(s)
        firsts.append(end - m + 1 if m <= FINE_MINUTES else (end // 60 - math.ceil(m / 60) + 1) * 60)
    return -(-min(firsts) // 60)


def older_hours(session: Session, counts: SloCounts, first_hour: int) -> dict[int, tuple[float, float]]:
    """Good and total per hour from `first_hour` to the oldest hour the windows keep, from the minute rollups."""
    if first_hour >= counts.first_hour or not counts.agents:
        return {}
    metric, kind = counts.spec.rollups
    hours: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    rows = RollupReader().read(session, since=minute_start(first_hour * 60),
                               until=minute_start(counts.first_hour * 60 - 1), agents=counts.agents,
                               metrics=(metric,), kinds=(kind,))  # fmt: skip
    for rollup in rows:
        judged = counts.spec.counts(rollup)
        if judged is not None:
            cell = hours[epoch_minute(rollup.minute) // 60]
            cell[0] += judged[0]
            cell[1] += judged[1]
    return {hour: (good, total) for hour, (good, total) in hours.items()}


def slo_history(session: Session, counts: SloCounts, steps: Steps, now: datetime) -> list[dict[str, Any]]:
    """Per step (oldest first): its events, and the window and alert figures at its end (`now` for the last)."""
    counts = counts.with_older_hours(older_hours(session, counts, _first_hour(counts, steps)))
    spec = counts.spec
    points = []
    for index in range(steps.count):
        first = steps.start(index)
        last = first + steps.minutes - 1
        step = counts.between(first, last)
        window = counts.window(spec.window, last) if counts.countable(spec.window, last) else Counts()
        alerts = []
        for pair in spec.alerts:
            known = counts.countable(pair["long"], last) and counts.countable(pair["short"], last)
            long, short = (burn_rate(counts.window(pair[w], last), spec.objective)
                           if counts.countable(pair[w], last) else None for w in ("long", "short"))  # fmt: skip
            alerts.append({
                "long": pair["long"], "short": pair["short"], "threshold": pair["burn_rate"],
                "severity": pair.get("severity", "page"), "long_burn_rate": long, "short_burn_rate": short,
                "firing": firing(long, short, pair["burn_rate"]) if known else None,
            })  # fmt: skip
        points.append({
            "ts": min(minute_start(last + 1), now), "good": step.good, "total": step.total, "sli": sli(step),
            "window_sli": sli(window), "budget_remaining": budget_remaining(window, spec.objective), "alerts": alerts,
        })  # fmt: skip
    return points


__all__ = ["MIN_LONG_STEP_S", "older_hours", "slo_history"]
