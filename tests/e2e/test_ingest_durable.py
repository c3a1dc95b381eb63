"""An acknowledged export is never lost: `spillway controlplane serve` killed (-9) right after answering exports it
had not applied yet, restarted on the same database and ingest log, holds exactly what the answers promised."""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from sqlalchemy import func, select

from controlplane.db import MetricRollup, make_engine, make_sessionmaker
from spillway.contract import names
from spillway.demo.harness import Process, stop_all
from tests.conftest import make_keys
from tests.utils.builders import make_agent
from tests.utils.otlp import cumulative_export
from tests.utils.server import free_port

AGENTS = 3
EXPORTS = 40  # per agent, acknowledged while nothing can be applied


def stored(url: str) -> dict[str, tuple[float, int]]:
    """Per agent: the sum of its stored `spillway.requests` and the count of its `spillway.request.duration`."""
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            rows = session.execute(
                select(MetricRollup.agent_id, MetricRollup.metric, func.sum(MetricRollup.total),
                       func.sum(MetricRollup.count)).group_by(MetricRollup.agent_id, MetricRollup.metric)
            ).all()  # fmt: skip
    finally:
        engine.dispose()
    out: dict[str, tuple[float, int]] = {}
    for agent, metric, total, count in rows:
        requests, durations = out.get(agent, (0.0, 0))
        if metric == names.REQUESTS:
            requests = float(total)
        elif metric == names.REQUEST_DURATION:
            durations = int(count)
        out[agent] = (requests, durations)
    return out


def test_exports_acknowledged_before_a_kill_9_are_applied_once_after_the_restart(sqlite_url: str,
                                                                                  tmp_path: Path) -> None:  # fmt: skip
    admin = make_keys(sqlite_url)["admin"]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")}
    env |= {"SPILLWAY_DATABASE_URL": sqlite_url, "SPILLWAY_INGEST_LOG_DIR": str(tmp_path / "ingest-log"),
            "SPILLWAY_INGEST_ACK": "logged", "SPILLWAY_CONTROL_LOOP_INTERVAL_S": "0",
            "SPILLWAY_AGENT_AUTH_CACHE_S": "300"}  # fmt: skip
    command = [sys.executable, "-m", "spillway.cli", "controlplane", "serve", "--port", str(port)]

    def serve(name: str) -> Process:
        proc = Process.start(command, name="the control plane", log=tmp_path / name, env=env, grace_s=15)
        proc.wait_ready(f"{base}/readyz", timeout_s=60)
        return proc

    first = serve("first.log")
    procs = [first]
    try:
        agents = [httpx.post(f"{base}/api/v1/agents", json=make_agent(), headers={"Authorization": f"Bearer {admin}"},
                             timeout=30).json() for _ in range(AGENTS)]  # fmt: skip
        start_ns = time.time_ns() - 1_000_000_000
        clients = [httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {a['token']}",
                                "Content-Type": "application/x-protobuf"}) for a in agents]  # fmt: skip

        def send(i: int, k: int) -> int:
            body = cumulative_export(agents[i]["agent"]["id"], start_ns, k)
            return clients[i].post("/v1/metrics", content=body).status_code

        viewer = {"Authorization": f"Bearer {admin}"}

        def requests_read(agent_id: str) -> float:
            """What the API says (read-your-writes: it waits until this process's exports are applied)."""
            body = httpx.get(f"{base}/api/v1/agents/{agent_id}/metrics", params={"window": "1h"}, headers=viewer,
                             timeout=30).json()  # fmt: skip
            return float(body["requests"])

        # Export 1 of each agent is applied normally (and the token cached: no database read from here on).
        assert [send(i, 1) for i in range(AGENTS)] == [200] * AGENTS
        assert [requests_read(a["agent"]["id"]) for a in agents] == [4.0] * AGENTS
        # Hold SQLite's write lock: from now on the applier cannot commit, so nothing acknowledged is applied.
        blocker = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), timeout=30, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:

            def agent_loop(i: int) -> list[int]:
                return [send(i, k) for k in range(2, EXPORTS + 2)]

            with ThreadPoolExecutor(AGENTS) as pool:
                answers = list(pool.map(agent_loop, range(AGENTS)))
            assert answers == [[200] * EXPORTS] * AGENTS  # acknowledged: in the ingest log, not in the rollups
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        before = stored(sqlite_url)
        last = EXPORTS + 1
        assert all(before.get(a["agent"]["id"], (0.0, 0)) == (4.0, 2) for a in agents), before  # only export 1

        second = serve("second.log")  # replays the log before it answers /readyz
        procs.append(second)
        after = stored(sqlite_url)
        assert {a["agent"]["id"]: after.get(a["agent"]["id"]) for a in agents} == {
            a["agent"]["id"]: (4.0 * last, 2 * last) for a in agents
        }, "an acknowledged export was lost or counted twice"
        scrape = httpx.get(f"{base}/metrics", headers=viewer, timeout=30).text
        assert f"spillway_ingest_replayed_total {float(AGENTS * EXPORTS)}" in scrape, scrape  # from the log
        # The exporter's retry of an export it already had acknowledged adds nothing; the next one adds its delta.
        assert [send(i, last) for i in range(AGENTS)] == [200] * AGENTS
        assert [send(i, last + 1) for i in range(AGENTS)] == [200] * AGENTS
        assert [requests_read(a["agent"]["id"]) for a in agents] == [4.0 * (last + 1)] * AGENTS
        for client in clients:
            client.close()
    finally:
        stop_all(procs)
