"""Two control-plane replicas on one database share the cumulative-to-delta state (`ingest_streams`): an agent's
cumulative exports spread over both, in any order, with duplicates and restarts, are counted exactly once."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from sqlalchemy import select, text

from controlplane.db import MetricRollup, make_engine, make_sessionmaker, migrate_to
from controlplane.ingest.receiver import Ingestor
from spillway.contract import names

BOUNDS_S = [b / 1000 for b in names.DEFAULT_LATENCY_BUCKETS_MS]
MINUTE_NS = 60 * 10**9
T0 = 1_800_000_000 * 10**9  # a whole minute


def export(agent_id: str, start: int, at: int, served: int, durations: int) -> ExportMetricsServiceRequest:
    """One cumulative export: `served` requests (`spillway.requests`) and `durations` observations, half of them in
    the third bucket, half in the sixth, since `start` (ns), taken at `at`."""
    message = ExportMetricsServiceRequest()
    resource = message.resource_metrics.add()
    resource.resource.attributes.add(key="service.instance.id", value=AnyValue(string_value=agent_id))
    metrics = resource.scope_metrics.add().metrics
    series = [KeyValue(key=names.ATTR_MODEL, value=AnyValue(string_value="mlp")),
              KeyValue(key=names.ATTR_PRIORITY, value=AnyValue(int_value=1))]  # fmt: skip
    requests = metrics.add(name=names.REQUESTS)
    requests.sum.aggregation_temporality = 2  # cumulative
    requests.sum.is_monotonic = True
    point = requests.sum.data_points.add(start_time_unix_nano=start, time_unix_nano=at, as_int=served)
    point.attributes.extend(series)
    duration = metrics.add(name=names.REQUEST_DURATION, unit="s")
    duration.histogram.aggregation_temporality = 2
    buckets = [0] * (len(BOUNDS_S) + 1)
    buckets[2], buckets[5] = durations // 2, durations - durations // 2
    hist = duration.histogram.data_points.add(start_time_unix_nano=start, time_unix_nano=at, count=durations,
                                              sum=0.01 * durations, bucket_counts=buckets,
                                              explicit_bounds=BOUNDS_S)  # fmt: skip
    hist.attributes.extend(series)
    return message


def history(seed: int, agent_id: str = "a1") -> tuple[list[ExportMetricsServiceRequest], int, int, list[int]]:
    """An agent's exports over three runs (it restarted twice), shuffled except each run's last export (sent last),
    some sent twice; and the truth: requests, durations, buckets."""
    rng = random.Random(seed)
    exports, finals = [], []
    served = observed = 0
    for run in range(3):
        start = T0 + run * 10 * MINUTE_NS
        value = count = 0
        batch = []
        for i in range(rng.randint(4, 9)):
            value += rng.randint(0, 20)
            count += 2 * rng.randint(0, 5)
            batch.append(export(agent_id, start, start + (i + 1) * 7 * 10**9, value, count))
        served, observed = served + value, observed + count
        finals.append(batch.pop())
        exports += batch
    exports += rng.choices(exports, k=4)  # sent twice (a retried export)
    rng.shuffle(exports)
    buckets = [0] * (len(BOUNDS_S) + 1)
    buckets[2] = buckets[5] = observed // 2
    return exports + finals, served, observed, buckets


def totals(factory: Any, agent_id: str = "a1") -> tuple[float, int, list[int]]:
    with factory() as session:
        rows = list(session.scalars(select(MetricRollup).where(MetricRollup.agent_id == agent_id)))
    served = sum(r.total for r in rows if r.metric == names.REQUESTS)
    durations = [r for r in rows if r.metric == names.REQUEST_DURATION]
    buckets = [sum(col) for col in zip(*(r.buckets for r in durations), strict=True)]
    return served, sum(r.count for r in durations), buckets


@pytest.fixture
def replicas(db_url: str) -> Iterator[tuple[Ingestor, Ingestor, Any]]:
    """Two Ingestors on one database, each with its own engine (as two processes would have)."""
    migrate_to(db_url)
    engines = [make_engine(db_url), make_engine(db_url)]
    factories = [make_sessionmaker(engine) for engine in engines]
    one, two = (Ingestor(factory) for factory in factories)
    yield one, two, factories[0]
    for ingestor in (one, two):
        ingestor.close()
    for engine in engines:
        engine.dispose()


@pytest.mark.parametrize("seed", [1, 2])
def test_round_robin_over_two_replicas_counts_exactly_once(replicas: tuple[Ingestor, Ingestor, Any], seed: int) -> None:
    one, two, factory = replicas
    exports, served, observed, buckets = history(seed)
    for i, message in enumerate(exports):
        (one if i % 2 else two).ingest("a1", message)
    assert totals(factory) == (served, observed, buckets)
    assert one.stats()["stale_batches"] > 0  # each found its memory of the streams out of date, and read them


def test_a_reset_and_a_restart_alternating_replicas(replicas: tuple[Ingestor, Ingestor, Any]) -> None:
    one, two, factory = replicas
    run1, run2 = T0, T0 + 10 * MINUTE_NS
    sent = [(run1, 1, 10, 4), (run1, 2, 10, 4), (run1, 3, 25, 8), (run1, 4, 3, 2),  # a duplicate; then a reset
            (run2, 1, 7, 2), (run1, 5, 9, 4), (run2, 2, 7, 2)]  # fmt: skip  # restarted; a late point of run 1
    for i, (start, k, served, durations) in enumerate(sent):
        (one if i % 2 else two).ingest("a1", export("a1", start, start + k * 10**9, served, durations))
    assert totals(factory)[:2] == (25 + 9 + 7, 8 + 4 + 2)


def test_two_replicas_applying_at_once_count_exactly_once(replicas: tuple[Ingestor, Ingestor, Any]) -> None:
    """Each replica's applier thread writes while the other's does: six agents' streams, spread over both."""
    one, two, factory = replicas
    truth, early, finals = {}, [], []
    for n in range(6):
        agent = f"a{n}"
        exports, served, observed, buckets = history(10 + n, agent)
        truth[agent] = (served, observed, buckets)
        early += [(agent, message) for message in exports[:-3]]
        finals += [(agent, message) for message in exports[-3:]]  # each run's last export
    random.Random(5).shuffle(early)

    def send(ingestor: Ingestor, exports: list[tuple[str, ExportMetricsServiceRequest]]) -> None:
        for agent, message in exports:
            ingestor.submit(agent, message)

    for part in (early, finals):  # the finals once everything before them is applied
        threads = [threading.Thread(target=send, args=(ingestor, part[side::2]))
                   for side, ingestor in enumerate((one, two))]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert one.wait_applied(timeout=30) and two.wait_applied(timeout=30)
    assert one.stats()["failed"] == two.stats()["failed"] == 0
    assert {agent: totals(factory, agent) for agent in truth} == truth


def test_a_run_begun_before_the_upgrade_is_a_baseline(factory: Any) -> None:
    """A database that had rollups when 0008 came (the previous version kept the state in memory): a run begun
    before then, seen for the first time, was perhaps counted already; what it adds from then on counts."""
    with factory() as session, session.begin():
        session.execute(text("UPDATE ingest_horizon SET since_ns = :at"), {"at": T0 + 5 * MINUTE_NS})
    ingestor = Ingestor(factory)
    ingestor.ingest("a1", export("a1", T0, T0 + 6 * MINUTE_NS, 40, 10))  # begun before: a baseline
    ingestor.ingest("a1", export("a1", T0, T0 + 7 * MINUTE_NS, 45, 14))
    ingestor.ingest("a1", export("a1", T0 + 8 * MINUTE_NS, T0 + 9 * MINUTE_NS, 3, 2))  # a run begun since: in full
    ingestor.close()
    served, observed, _ = totals(factory)
    assert (served, observed) == (5 + 3, 4 + 2)
