"""SLO evaluation cycle time: N agents x M SLOs over minute rollups, on SQLite and PostgreSQL.

The database is filled directly with the rollups that the receiver writes (the agents' request counter and
request-duration histogram per model, priority and outcome), `--history-min` minutes of them, then the
evaluator (`controlplane.slo.windows.SloWindows`) is timed: the first evaluation reads every SLO's window whole
(a cold start), each later one re-reads the last minutes and sums every window. Between timed cycles the
current minute's rollups of every agent grow, as exports would make them (not timed). Used by bench/ingest.py.

With `--rules`, the whole control-loop cycle is timed. The rules' `for` is 30 s and cycles are 5 simulated seconds
apart, so the cycle 30 s after the first is a fleet-wide firing: every rule whose condition the generated traffic
meets fires for every agent it selects at once (thousands of events, a new document per agent); the table names
that cycle's time and writes.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import insert, text, update

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `bench` from the repository
from bench.common import median
from controlplane.db import make_engine, make_sessionmaker, migrate_to
from controlplane.db.models import Agent, MetricRollup, Rule, Slo
from spillway.contract import names

BOUNDS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]
OUTCOMES = ("local", "rejected", "overflow")
SITES = ("berlin", "paris", "lab", "madrid")


def _slos(count: int) -> list[dict[str, Any]]:
    """A mix: latency and availability, fleet-wide, per site, per model, 28-day windows, workbook alerts."""
    from controlplane.schemas.slos import SloCreate

    specs = []
    for i in range(count):
        site = {} if i % 2 == 0 else {"site": SITES[i % len(SITES)]}
        kind = "latency" if i % 2 == 0 else "availability"
        body = SloCreate.model_validate({
            "name": f"slo-{i}", "selector": {"labels": site, "model": "mlp" if i % 3 else None}, "sli_kind": kind,
            "threshold_ms": 50 if kind == "latency" else None, "objective": 99.0, "window": "28d",
        })  # fmt: skip
        specs.append({"id": f"s{i:04d}", "version": 1, **body.model_dump()})
    return specs


def _rollups(agents: list[str], minute: datetime, rng: random.Random) -> list[dict[str, Any]]:
    rows = []
    for agent in agents:
        for model in ("mlp", "lite"):
            for priority in (1, 2, 3):
                for outcome in OUTCOMES:
                    n = rng.randint(50, 400)
                    attributes = {names.ATTR_MODEL: model, names.ATTR_VERSION: "1", names.ATTR_PRIORITY: priority,
                                  names.ATTR_OUTCOME: outcome}  # fmt: skip
                    key = f"{agent}{model}{priority}{outcome}"
                    rows.append({"agent_id": agent, "metric": "spillway.requests", "series": f"r{key}",
                                 "attributes": attributes, "minute": minute, "kind": "sum", "count": 0,
                                 "total": float(n), "buckets": [], "bounds": []})  # fmt: skip
                    if outcome == "local":
                        buckets = [0] * (len(BOUNDS) + 1)
                        for _ in range(8):
                            buckets[rng.randint(2, 7)] += n // 8
                        rows.append({"agent_id": agent, "metric": "spillway.request.duration", "series": f"d{key}",
                                     "attributes": attributes, "minute": minute, "kind": "histogram",
                                     "count": sum(buckets), "total": 0.01 * n, "buckets": buckets,
                                     "bounds": BOUNDS})  # fmt: skip
    return rows


def _rules(count: int) -> list[dict[str, Any]]:
    """A mix of every condition kind and action, some firing on the generated traffic, fleet-wide or per site."""
    from controlplane.schemas.rules import RuleCreate

    kinds: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"kind": "burn_rate", "slo": "slo-0", "long_window": 3600, "short_window": 300, "threshold": 14.4},
         {"kind": "switch_variant", "version": 2}),
        ({"kind": "error_ratio", "threshold": 0.2, "window": 300}, {"kind": "shed", "priority_at_or_below": 3}),
        ({"kind": "latency", "quantile": 0.99, "threshold_ms": 50, "window": 300},
         {"kind": "tune_batching", "max_queue_delay_us": 500}),
        ({"kind": "gauge", "metric": "queue_depth", "op": ">", "threshold": 64},
         {"kind": "tune_batching", "max_queue_delay_us": 200}),
        ({"kind": "gauge", "metric": "gpu_temperature_c", "op": ">=", "threshold": 85},
         {"kind": "shed", "priority_at_or_below": 2}),
        ({"kind": "stale", "after": 60}, {"kind": "fallback", "priority_at_or_below": 1, "mode": "cache"}),
        ({"kind": "burn_rate", "slo": "slo-1", "long_window": 21600, "short_window": 1800, "threshold": 6},
         {"kind": "shed", "priority_at_or_below": 3}),
    ]  # fmt: skip
    rules = []
    for i in range(count):
        condition, action = kinds[i % len(kinds)]
        site = {} if i % 2 == 0 else {"site": SITES[i % len(SITES)]}
        body = RuleCreate.model_validate({
            "name": f"rule-{i}", "selector": {"labels": site, "model": "mlp"}, "condition": condition,
            "action": action, "hysteresis": {"for": "30s", "recover_after": "2m"},
        })  # fmt: skip
        rules.append({"id": f"r{i:04d}", "version": 1, **body.model_dump()})
    return rules


def run(url: str, *, agents: int, slos: int, history_min: int, cycles: int, rules: int = 0,
        seed: int = 1) -> dict[str, Any]:  # fmt: skip
    """Fill `url` (an empty database) and time the evaluator: the SLO windows alone, or with `rules` the whole
    control loop cycle (windows, every rule for every agent, states, events, policies); returns the figures."""
    from controlplane.rules.loop import ControlLoop, PolicyDefaults
    from controlplane.slo.windows import SloWindows

    rng = random.Random(seed)
    migrate_to(url)
    engine = make_engine(url)
    factory = make_sessionmaker(engine)
    now = datetime.now(timezone.utc).replace(second=30, microsecond=0)
    ids = [f"a{i:05d}" for i in range(agents)]
    with factory() as session, session.begin():
        session.execute(insert(Agent), [
            {"id": a, "name": a, "version": 1, "labels": {"site": SITES[i % len(SITES)], "tier": "edge"},
             "device_class": "cpu", "token_hash": "x"} for i, a in enumerate(ids)])  # fmt: skip
        session.execute(insert(Slo), _slos(slos))
        if rules:
            session.execute(insert(Rule), _rules(rules))
    rows = 0
    fill_started = time.perf_counter()
    for back in range(history_min, -1, -1):
        batch = _rollups(ids, now.replace(second=0) - timedelta(minutes=back), rng)
        with factory() as session, session.begin():
            session.execute(insert(MetricRollup), batch)
        rows += len(batch)
    fill_s = time.perf_counter() - fill_started
    windows = SloWindows()
    loop = ControlLoop(factory, windows, PolicyDefaults([10.0, 50.0, 100.0], 5.0, 5.0, 15.0))

    writes: list[tuple[int, int]] = []  # per timed cycle: events of transitions, documents published

    def evaluate(now: datetime) -> int:
        if rules:
            report = loop.cycle(now)
            writes.append((len(report.transitions), len(report.published)))
            return report.pairs
        with factory() as session:
            return sum(len(e.agents) for e in windows.evaluate(session, now) if e.spec.source == "slo")

    started = time.perf_counter()
    pairs = evaluate(now)
    cold_s = time.perf_counter() - started
    writes.clear()
    times = []
    for _ in range(cycles):
        now += timedelta(seconds=5)  # one export interval later: every agent's current minute grew
        with factory() as session, session.begin():
            session.execute(
                update(MetricRollup)
                .where(MetricRollup.minute == now.replace(second=0), MetricRollup.metric == "spillway.requests")
                .values(total=MetricRollup.total + 1)
            )
        started = time.perf_counter()
        evaluate(now)
        times.append(time.perf_counter() - started)
    if engine.dialect.name == "postgresql":  # leave the database as empty as it came
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE"))
            conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    firing = max(range(len(writes)), key=lambda i: writes[i][0]) if writes else None
    times_in_order = list(times)
    times.sort()
    return {
        "agents": agents, "slos": slos, "rules": rules, "pairs": pairs, "rows": rows, "fill_s": fill_s,
        "cold_s": cold_s,
        "median_s": median(times), "p99_s": times[min(len(times) - 1, int(len(times) * 0.99))],
        "max_s": times[-1], "cycles": cycles,
        "firing_s": None if firing is None else times_in_order[firing],
        "firing_transitions": writes[firing][0] if firing is not None else 0,
        "firing_published": writes[firing][1] if firing is not None else 0,
    }  # fmt: skip


def table(results: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        "| database | what is timed | agents | SLOs | rules | pairs evaluated | rollup rows | cold first cycle | "
        "cycle median | cycle p99 | fleet-wide firing (events + documents written) | cycles |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results:
        what = "control loop cycle" if r["rules"] else "SLO windows refresh + evaluation"
        firing = "-"
        if r["rules"] and r["firing_s"] is not None:
            firing = (f"{r['firing_s'] * 1000:.0f} ms ({r['firing_transitions']:,} rule events + "
                      f"{r['firing_published']:,} documents)")  # fmt: skip
        lines.append(
            f"| {name} | {what} | {r['agents']} | {r['slos']} | {r['rules']} | {r['pairs']} | {r['rows']:,} | "
            f"{r['cold_s']:.2f} s | {r['median_s'] * 1000:.0f} ms | {r['p99_s'] * 1000:.0f} ms | {firing} | "
            f"{r['cycles']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--slos", type=int, default=5)
    parser.add_argument("--rules", type=int, default=0, help="also time the whole control loop with this many rules")
    parser.add_argument("--history-min", type=int, default=30)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--postgres-url", default=None)
    args = parser.parse_args(argv)
    options = {"agents": args.agents, "slos": args.slos, "history_min": args.history_min, "cycles": args.cycles}
    results = []
    for rules in sorted({0, args.rules}):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(("SQLite", run(f"sqlite:///{Path(tmp) / 'slo.db'}", rules=rules, **options)))
        if args.postgres_url:
            results.append(("PostgreSQL", run(args.postgres_url, rules=rules, **options)))
    print(table(results))


if __name__ == "__main__":
    main()
