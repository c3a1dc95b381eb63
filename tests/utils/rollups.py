"""Minute rollups written straight into the database, as the OTLP receiver would have written them: for tests
whose subject is what the control plane does with telemetry, not how it receives it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select

from controlplane.db.models import Agent, MetricRollup
from spillway.contract import names

BOUNDS = [0.01, 0.1]  # 10 ms and 100 ms


def add_agent(session: Any, ident: str, site: str) -> None:
    session.add(Agent(id=ident, name=ident, version=1, labels={"site": site}, device_class="cpu", token_hash="x"))


def add_rollup(session: Any, agent: str, minute: datetime, metric: str, outcome: str, n: int, fast: int = 0,
               model: str = "mlp") -> None:  # fmt: skip
    """`n` requests of `model` with `outcome` in `minute` (`fast` of them within 10 ms); a later call for the same
    minute adds to it, as a later export of the same minute does."""
    series = f"{metric}|{model}|{outcome}"
    where = (MetricRollup.agent_id == agent, MetricRollup.series == series, MetricRollup.minute == minute)
    existing = session.scalars(select(MetricRollup).where(*where)).first()
    if metric == "spillway.requests":
        values: dict[str, Any] = {"kind": "sum", "count": 0, "total": float(n), "buckets": [], "bounds": []}
    else:
        values = {"kind": "histogram", "count": n, "total": 0.0, "buckets": [fast, n - fast, 0], "bounds": BOUNDS}
    if existing is not None:
        existing.total += values["total"]
        existing.count += values["count"]
        existing.buckets = [a + b for a, b in zip(existing.buckets, values["buckets"], strict=True)]
        return
    attributes = {names.ATTR_MODEL: model, names.ATTR_PRIORITY: 1, names.ATTR_OUTCOME: outcome}
    session.add(MetricRollup(agent_id=agent, metric=metric, series=series, attributes=attributes, minute=minute,
                             **values))  # fmt: skip


def add_requests(session: Any, agent: str, minute: datetime, n: int, fast: int, bad: int = 0) -> None:
    """`n` served requests (`fast` within 10 ms) and `bad` refused ones."""
    add_rollup(session, agent, minute, "spillway.request.duration", "local", n, fast=fast)
    add_rollup(session, agent, minute, "spillway.requests", "local", n)
    if bad:
        add_rollup(session, agent, minute, "spillway.requests", "rejected", bad)


def add_gauge(session: Any, agent: str, minute: datetime, metric: str, value: float, **given: Any) -> None:
    """A gauge reading; `model=`, `priority=` ... stand for the attributes' names (`spillway.model`, ...)."""
    attributes = {names.LEGACY_ATTRIBUTES.get(key, key): value for key, value in given.items()}
    series = f"{metric}|{sorted(attributes.items())}"
    session.add(MetricRollup(agent_id=agent, metric=metric, series=series[:64], attributes=attributes,
                             minute=minute, kind="gauge", count=1, total=value, buckets=[], bounds=[], last=value,
                             min=value, max=value))  # fmt: skip
