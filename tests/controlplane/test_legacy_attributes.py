"""For one release the control plane reads the agents' old attribute names (`model`, `model.version`, `priority`,
`outcome`, `policy.source`) as the new, namespaced ones, and the old name of the KV budget gauge
(`spillway.kv.blocks.total`) as `spillway.kv.blocks.limit`: renamed at ingest, and in rows stored before the upgrade,
so an agent that still sends the old names and one that sends the new ones land in the same numbers."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from controlplane.db import make_engine, make_sessionmaker
from controlplane.db.models import MetricRollup, utcnow
from controlplane.ingest.attributes import current_metric, current_names, series_key, with_legacy_metrics
from controlplane.ingest.bounds import BATCH_SIZE_BUCKETS
from controlplane.query import agent_metrics, read_rollups
from controlplane.rules.observe import read_gauges
from spillway.contract import names
from tests.conftest import Plane
from tests.utils.builders import make_agent, make_slo
from tests.utils.rollups import add_agent

OLD = {new: old for old, new in names.LEGACY_ATTRIBUTES.items()}  # new name -> the name agents before 0.2 sent
OLD_KV_LIMIT = "spillway.kv.blocks.total"  # the KV budget gauge's name before 0.2
OLD_METRIC = {new: old for old, new in names.LEGACY_METRICS.items()}
LATENCY_S = tuple(ms / 1000 for ms in names.DEFAULT_LATENCY_BUCKETS_MS)


def test_legacy_names_are_renamed_and_a_point_with_both_keeps_the_new_one() -> None:
    legacy = {"model": "mlp", "model.version": "1", "priority": 2, "outcome": "local", "policy.source": "file",
              "hw.id": "gpu0"}  # fmt: skip
    assert current_names(legacy) == {
        names.ATTR_MODEL: "mlp", names.ATTR_VERSION: "1", names.ATTR_PRIORITY: 2, names.ATTR_OUTCOME: "local",
        names.ATTR_POLICY_SOURCE: "file", "hw.id": "gpu0",
    }  # fmt: skip
    assert current_names({"model": "old", names.ATTR_MODEL: "new"}) == {names.ATTR_MODEL: "new"}
    assert current_names({names.ATTR_MODEL: "new", "model": "old"}) == {names.ATTR_MODEL: "new"}
    current = {names.ATTR_MODEL: "mlp", "gen_ai.request.model": "tiny-lm"}
    assert current_names(current) is current  # nothing to rename: nothing copied


def test_the_old_kv_budget_metric_name_is_read_as_the_new_one() -> None:
    assert names.LEGACY_METRICS == {OLD_KV_LIMIT: names.KV_BLOCKS_TOTAL} and names.KV_BLOCKS_TOTAL.endswith(".limit")
    assert current_metric(OLD_KV_LIMIT) == names.KV_BLOCKS_TOTAL
    assert current_metric(names.KV_BLOCKS_USED) == names.KV_BLOCKS_USED
    assert with_legacy_metrics([names.KV_BLOCKS_TOTAL, names.REQUESTS]) == [
        names.KV_BLOCKS_TOTAL, names.REQUESTS, OLD_KV_LIMIT
    ]  # fmt: skip


def _export(url: str, agent_id: str, token: str, name: Any, metric: Any = lambda new_name: new_name) -> None:
    """The same minute of traffic through the real OTel SDK and OTLP/HTTP exporter, its attributes named by `name`
    and its metrics by `metric` (the new names, or the old ones): requests by outcome, served latencies, batches,
    queue depths, a refused policy, a generative model's KV-cache gauges."""
    exporter = OTLPMetricExporter(endpoint=f"{url}/v1/metrics", headers={"Authorization": f"Bearer {token}"},
                                  timeout=10)  # fmt: skip
    views = [View(instrument_name=metric, aggregation=ExplicitBucketHistogramAggregation(LATENCY_S))
             for metric in names.DURATIONS]  # fmt: skip
    views.append(View(instrument_name=names.BATCH_SIZE, aggregation=ExplicitBucketHistogramAggregation(
        BATCH_SIZE_BUCKETS)))  # fmt: skip
    provider = MeterProvider(resource=Resource.create({"service.instance.id": agent_id}), views=views,
                             metric_readers=[PeriodicExportingMetricReader(exporter, 3_600_000)])  # fmt: skip
    meter = provider.get_meter("agent-of-some-version")
    requests = meter.create_counter(names.REQUESTS, unit="{request}")
    durations = {metric: meter.create_histogram(metric, unit="s") for metric in names.DURATIONS}
    batches = meter.create_histogram(names.BATCH_SIZE, unit="{row}")

    def depths(_options: CallbackOptions) -> Iterable[Observation]:
        for priority, depth in ((1, 4), (3, 9)):
            yield Observation(depth, {name(names.ATTR_MODEL): "mlp", name(names.ATTR_VERSION): "1",
                                      name(names.ATTR_PRIORITY): priority})  # fmt: skip

    meter.create_observable_gauge(names.QUEUE_DEPTH, callbacks=[depths], unit="{request}")
    for gauge, blocks in ((names.KV_BLOCKS_USED, 16), (names.KV_BLOCKS_TOTAL, 64)):
        meter.create_observable_gauge(metric(gauge), unit="{block}", callbacks=[
            lambda _options, blocks=blocks: [Observation(blocks, {name(names.ATTR_MODEL): "tiny-lm"})]])  # fmt: skip
    for priority, outcome, n, seconds in ((1, "local", 40, 0.004), (1, "local", 10, 0.03), (3, "local", 5, 0.3),
                                          (3, "rejected", 7, 0.0), (2, "overflow", 3, 0.0)):  # fmt: skip
        attributes = {name(names.ATTR_MODEL): "mlp", name(names.ATTR_VERSION): "1",
                      name(names.ATTR_PRIORITY): priority, name(names.ATTR_OUTCOME): outcome}  # fmt: skip
        for _ in range(n):
            requests.add(1, attributes)
            if outcome == "local":
                for metric, histogram in durations.items():
                    histogram.record(seconds if metric == names.REQUEST_DURATION else seconds / 4, attributes)
    for size in (1, 4, 4, 8):
        batches.record(size, {name(names.ATTR_MODEL): "mlp", name(names.ATTR_VERSION): "1"})
    meter.create_counter(names.POLICY_REFUSALS).add(1, {name(names.ATTR_POLICY_SOURCE): "control_plane"})
    assert provider.force_flush(10_000)
    provider.shutdown()


def _without_times(value: Any) -> Any:
    """A summary without what depends on when it was read (its window's edges, and rates over them)."""
    if isinstance(value, dict):
        return {k: _without_times(v) for k, v in value.items() if k not in ("agent", "name", "since", "until", "rps")}
    if isinstance(value, list):
        return [_without_times(v) for v in value]
    return value


def test_an_export_with_the_old_names_and_one_with_the_new_land_in_the_same_numbers(plane: Plane) -> None:
    admin = {"Authorization": f"Bearer {plane.admin}"}
    latency = httpx.post(f"{plane.url}/api/v1/slos", headers=admin, json=make_slo(
        name="fast", selector={"labels": {"site": "berlin"}, "model": "mlp"}, threshold_ms=10, objective=90,
        window="1d")).json()["id"]  # fmt: skip
    availability = httpx.post(f"{plane.url}/api/v1/slos", headers=admin, json=make_slo(
        name="up", selector={"labels": {"site": "berlin"}, "model": "mlp"}, sli_kind="availability",
        threshold_ms=None, objective=99, window="1d")).json()["id"]  # fmt: skip
    old = httpx.post(f"{plane.url}/api/v1/agents", json=make_agent(), headers=admin).json()
    _export(plane.url, plane.agent_id, plane.token, lambda new_name: new_name)
    _export(plane.url, old["agent"]["id"], old["token"], lambda new_name: OLD[new_name],
            lambda new_name: OLD_METRIC.get(new_name, new_name))  # fmt: skip
    new_id, old_id = plane.agent_id, old["agent"]["id"]

    # Stored under the new names only.
    stored = {key for metric in (names.REQUESTS, names.QUEUE_DEPTH, names.POLICY_REFUSALS, names.BATCH_SIZE)
              for row in plane.rollups(metric) for key in row.attributes}  # fmt: skip
    assert stored >= {names.ATTR_MODEL, names.ATTR_VERSION, names.ATTR_PRIORITY, names.ATTR_OUTCOME,
                      names.ATTR_POLICY_SOURCE} and not stored & set(names.LEGACY_ATTRIBUTES)  # fmt: skip
    assert plane.rollups(OLD_KV_LIMIT) == []
    assert sorted(row.agent_id for row in plane.rollups(names.KV_BLOCKS_TOTAL)) == sorted([new_id, old_id])

    summaries = [httpx.get(f"{plane.url}/api/v1/agents/{agent}/metrics", headers=admin).json()
                 for agent in (new_id, old_id)]  # fmt: skip
    assert _without_times(summaries[0]) == _without_times(summaries[1])
    traffic = {t["priority"]: t for t in summaries[1]["traffic"]}
    assert traffic[1]["outcomes"] == {"local": 50} and traffic[1]["versions"] == ["1"]
    assert traffic[1]["latency_ms"]["count"] == 50 and 2 < traffic[1]["latency_ms"]["p50"] <= 5
    assert traffic[3]["queue_depth"] == {"last": 9, "max": 9} and traffic[2]["outcomes"] == {"overflow": 3}
    assert summaries[1]["batches"][0]["batches"] == 4
    (generation,) = summaries[1]["generation"]
    assert (generation["model"], generation["kv_blocks_used"], generation["kv_blocks_total"]) == ("tiny-lm", 16, 64)
    assert generation["kv_cache_use"] == 0.25

    for slo, good, total in ((latency, 40, 55), (availability, 58, 65)):
        per_agent = httpx.get(f"{plane.url}/api/v1/slos/{slo}/agents", headers=admin).json()
        assert sorted((r["agent"], r["good"], r["total"]) for r in per_agent) == sorted(
            [(new_id, good, total), (old_id, good, total)]
        )
    engine = make_engine(plane.db)
    with make_sessionmaker(engine)() as session:
        gauges = read_gauges(session, utcnow())
    engine.dispose()
    assert gauges[new_id].queue_depth == gauges[old_id].queue_depth == {"mlp": 13}
    assert gauges[new_id].kv_blocks_total == gauges[old_id].kv_blocks_total == {"tiny-lm": 64}
    assert gauges[old_id].value("kv_cache_use_ratio", "tiny-lm") == 0.25


def _row(agent: str, minute: Any, metric: str, attributes: dict[str, Any], **values: Any) -> MetricRollup:
    """A rollup as the receiver stores it, keyed by the series of the attributes as they were stored."""
    defaults: dict[str, Any] = {"count": 0, "total": 0.0, "buckets": [], "bounds": []}
    return MetricRollup(agent_id=agent, metric=metric, series=series_key(metric, attributes), minute=minute,
                        attributes=attributes, **{**defaults, **values})  # fmt: skip


def test_rows_stored_before_the_upgrade_are_read_under_the_new_names_as_the_same_series(factory: Any) -> None:
    """The minute of the upgrade holds a row under the old names (before) and one under the new names (after) of
    each series: counts add up, and a gauge read twice in that minute counts once (its higher reading)."""
    now = utcnow().replace(second=30, microsecond=0)
    minute, earlier = now.replace(second=0), now.replace(second=0) - timedelta(minutes=1)
    legacy = {"model": "mlp", "model.version": "1", "priority": 1}
    buckets = [0] * (len(LATENCY_S) + 1)
    buckets[2] = 10  # (2 ms, 5 ms]
    with factory() as session, session.begin():
        add_agent(session, "edge", "berlin")
        for when, attributes, outcome, depth in ((earlier, legacy, "outcome", 2.0), (minute, legacy, "outcome", 5.0),
                                                 (minute, current_names(legacy), names.ATTR_OUTCOME, 3.0)):  # fmt: skip
            served = {**attributes, outcome: "local"}
            session.add(_row("edge", when, names.REQUESTS, served, kind="sum", total=10.0))
            session.add(_row("edge", when, names.REQUEST_DURATION, served, kind="histogram", count=10, total=0.04,
                             buckets=buckets, bounds=list(LATENCY_S)))  # fmt: skip
            session.add(_row("edge", when, names.QUEUE_DEPTH, attributes, kind="gauge", count=1, total=depth,
                             last=depth, min=depth, max=depth))  # fmt: skip
    with factory() as session:
        summary = agent_metrics(session, "edge", 300, retention_s=86400, now=now)
        gauges = read_gauges(session, now)
    (traffic,) = summary["traffic"]
    assert (traffic["model"], traffic["priority"], traffic["versions"]) == ("mlp", 1, ["1"])
    assert traffic["outcomes"] == {"local": 30} and traffic["latency_ms"]["count"] == 30
    assert traffic["latency_ms"]["mean"] == pytest.approx(4.0)
    assert traffic["queue_depth"] == {"last": 5, "max": 5}  # not 8: one series, read twice in the upgrade minute
    assert gauges["edge"].queue_depth == {"mlp": 5}


def test_kv_budget_rows_stored_under_the_old_metric_name_are_read_as_the_new_one_and_the_same_series(
    factory: Any,
) -> None:
    """An agent that reported the KV budget only under the old name is read; one upgraded in this minute has a row
    under each name (and under the old attribute names, then the new ones) of one series: read once, not added."""
    now = utcnow().replace(second=30, microsecond=0)
    minute = now.replace(second=0)
    legacy, current = {"model": "tiny-lm"}, {names.ATTR_MODEL: "tiny-lm"}
    with factory() as session, session.begin():
        for agent in ("upgraded", "old"):
            add_agent(session, agent, "berlin")
        rows = (("upgraded", OLD_KV_LIMIT, legacy, 60.0), ("upgraded", names.KV_BLOCKS_TOTAL, current, 64.0),
                ("upgraded", names.KV_BLOCKS_USED, current, 32.0), ("old", OLD_KV_LIMIT, legacy, 80.0),
                ("old", names.KV_BLOCKS_USED, legacy, 20.0))  # fmt: skip
        for agent, metric, attributes, blocks in rows:
            session.add(_row(agent, minute, metric, attributes, kind="gauge", count=1, total=blocks, last=blocks,
                             min=blocks, max=blocks))  # fmt: skip
    with factory() as session:
        summaries = {agent: agent_metrics(session, agent, 300, retention_s=86400, now=now)
                     for agent in ("upgraded", "old")}  # fmt: skip
        gauges = read_gauges(session, now)
        (row,) = read_rollups(session, since=minute, agents=("old",), metrics=(names.KV_BLOCKS_TOTAL,))
    assert (row.metric, row.series) == (names.KV_BLOCKS_TOTAL, series_key(names.KV_BLOCKS_TOTAL, current))
    for agent, total, use in (("upgraded", 64, 0.5), ("old", 80, 0.25)):
        (generation,) = summaries[agent]["generation"]
        assert (generation["kv_blocks_total"], generation["kv_cache_use"]) == (total, use)  # not 124: one series
        assert gauges[agent].kv_blocks_total == {"tiny-lm": total}
        assert gauges[agent].value("kv_cache_use_ratio", "tiny-lm") == use
