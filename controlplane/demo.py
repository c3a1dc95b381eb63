"""`spillway demo`: the story so far, on one machine.

1. a control plane on SQLite, an admin key, and the example fleet seeded through the REST API;
2. an edge agent serving the demo models (built from code) as the seeded agent `jetson-berlin-01`, exporting
   its OpenTelemetry metrics to the control plane with that agent's token;
3. a burst of mixed-priority traffic, with outcomes and latency per priority as the clients saw them;
4. the same burst as the control plane saw it through the agent's telemetry: per-priority latency, and each
   SLO's SLI, error budget and burn rates.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

EXAMPLE_FLEET = Path(__file__).resolve().parent.parent / "examples" / "fleet.yaml"
SEED_ORDER = ("agents", "slos", "rules", "backends")


def _say(line: str = "") -> None:
    print(line, flush=True)


@contextmanager
def _process(args: list[str], log_path: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A child process that is always stopped (SIGTERM, then SIGKILL) when the demo ends."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)  # noqa: S603 - our own CLI
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], what: str, log: Path, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {what} exited with code {proc.returncode}; see {log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the {what} was not ready within {deadline_s:.0f} s; see {log}")


def seed(client: httpx.Client, fleet: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """POST every example resource; returns what the API answered, per kind."""
    created: dict[str, list[dict[str, Any]]] = {}
    for kind in SEED_ORDER:
        for item in fleet.get(kind, []):
            response = client.post(f"/api/v1/{kind}", json=item)
            if response.status_code != 201:
                raise RuntimeError(
                    f"seeding {kind} '{item.get('name')}' failed: {response.status_code} {response.text}"
                )
            created.setdefault(kind, []).append(response.json())
    return created


def _admin_key(url: str) -> str:
    from controlplane.access import issue_api_key
    from controlplane.db import make_engine, make_sessionmaker, migrate_to, transaction
    from controlplane.db.repository import Actor

    migrate_to(url)
    engine = make_engine(url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            return issue_api_key(session, "demo-admin", "admin", Actor("cli", "spillway demo"))[1]
    finally:
        engine.dispose()


DEMO_AGENT = "jetson-berlin-01"  # the seeded agent the local agent plays
EXPORT_INTERVAL_S = 1.0


def run_demo(*, port: int, agent_port: int, data_dir: str, once: bool) -> int:
    from edge_agent.burst import DEFAULT_MIX, format_report, run_burst
    from edge_agent.runtime.demo_models import build_demo_repository

    root = Path(data_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("demo.db*"):  # a fresh story every run; never the default `spillway.db`
        stale.unlink()
    url = f"sqlite:///{root / 'demo.db'}"
    base, agent_base = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{agent_port}"
    admin_key = _admin_key(url)
    env = {**os.environ, "SPILLWAY_DATABASE_URL": url, "SPILLWAY_PORT": str(port), "SPILLWAY_HOST": "127.0.0.1",
           "SPILLWAY_EVALUATION_INTERVAL_S": "1"}  # fmt: skip
    cli = [sys.executable, "-m", "controlplane.cli"]

    with ExitStack() as stack:
        cp_log = root / "controlplane.log"
        cp = stack.enter_context(_process([*cli, "controlplane", "serve", "--no-migrate"], cp_log, env))
        models = build_demo_repository(root / "models")
        agent_log = root / "agent.log"
        try:
            _wait_ready(f"{base}/readyz", cp, "control plane", cp_log)
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {admin_key}"}, timeout=10) as client:
                created = seed(client, yaml.safe_load(EXAMPLE_FLEET.read_text()))
                fleet_status = client.get("/api/v1/status").json()
            _report_control_plane(base, admin_key, created, fleet_status, cp_log)
            enrolled = next(a for a in created["agents"] if a["agent"]["name"] == DEMO_AGENT)
            config = _agent_config(root, models, agent_port, base, enrolled["agent"])
            agent_env = {**env, "SPILLWAY_AGENT_TOKEN": enrolled["token"]}  # not on the command line (ps shows it)
            agent = stack.enter_context(_process([*cli, "agent", "serve", "--config", str(config)], agent_log,
                                                 agent_env))  # fmt: skip
            _wait_ready(f"{agent_base}/v2/health/ready", agent, "edge agent", agent_log)
        except RuntimeError as exc:
            _say(f"error: {exc}")
            return 1
        _say(f"Edge agent: {agent_base}  (models: {models}, log: {agent_log})")
        _say(f"  it plays {DEMO_AGENT}: metrics every {EXPORT_INTERVAL_S:.0f} s to {base}/v1/metrics with its token")
        _say()
        _say("A burst of 1000 requests to mlp v1 from 48 concurrent clients, mixed priorities, as the clients saw it:")
        reports = asyncio.run(run_burst(agent_base, model="mlp", version="1", requests=1000, concurrency=48))
        _say(format_report(reports, DEFAULT_MIX))
        _say()
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {admin_key}"}, timeout=10) as client:
            agent_id = enrolled["agent"]["id"]
            seen = _wait_for_telemetry(client, agent_id, expected=sum(r.sent for r in reports.values()))
            _say("The same burst as the control plane saw it, from the agent's OpenTelemetry metrics (latency measured")
            _say("inside the agent, so below what the clients saw; percentiles interpolated within histogram buckets):")
            _say(format_telemetry(seen))
            _say()
            _say("SLOs now (from the same telemetry):")
            for slo in created.get("slos", []):
                _say(format_slo(client.get(f"/api/v1/slos/{slo['id']}/status").json()))
        _say()
        _say(f"  curl {agent_base}/v2/models/mlp/stats")
        _say(f'  curl -H "Authorization: Bearer $SPILLWAY_API_KEY" {base}/api/v1/agents/{agent_id}/metrics?window=5m')
        _say(f"  spillway agent burst --url {agent_base}")
        _say()
        if once:
            return 0
        _say("Serving until Ctrl-C.")
        signal.signal(signal.SIGTERM, lambda *_: cp.terminate())
        try:
            return cp.wait()
        except KeyboardInterrupt:
            return 0
    return 0


def _agent_config(root: Path, models: Path, port: int, control_plane: str, agent: dict[str, Any]) -> Path:
    path = root / "agent.yaml"
    config = {
        "model_repository": str(models), "port": port, "agent_id": agent["id"], "control_plane": control_plane,
        "export_interval_s": EXPORT_INTERVAL_S, "device_class": agent["device_class"], "labels": agent["labels"],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    return path


def _wait_for_telemetry(client: httpx.Client, agent_id: str, expected: int, deadline_s: float = 20.0) -> Any:
    """The agent's metrics once the control plane has counted every request of the burst (or the deadline)."""
    deadline = time.monotonic() + deadline_s
    while True:
        seen = client.get(f"/api/v1/agents/{agent_id}/metrics", params={"window": "5m"}).json()
        if seen.get("requests", 0) >= expected or time.monotonic() > deadline:
            return seen
        time.sleep(EXPORT_INTERVAL_S / 2)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_telemetry(seen: dict[str, Any]) -> str:
    lines = [
        "| model | priority | requests | outcomes | p50 ms | p95 ms | p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in seen.get("traffic", []):
        outcomes = ", ".join(f"{name} {count:.0f}" for name, count in sorted(row["outcomes"].items(),
                                                                           key=lambda kv: -kv[1]))  # fmt: skip
        latency = row["latency_ms"]
        lines.append(f"| {row['model']} | {row['priority']} | {row['requests']:.0f} | {outcomes} | "
                     f"{_ms(latency['p50'])} | {_ms(latency['p95'])} | {_ms(latency['p99'])} |")  # fmt: skip
    lines.append(f"counted by the control plane: {seen.get('requests', 0):.0f} requests")
    return "\n".join(lines)


def format_slo(status: dict[str, Any]) -> str:
    sli = "no traffic" if status["sli"] is None else f"SLI {status['sli'] * 100:.2f} %"
    budget = status["budget_remaining"]
    left = "-" if budget is None else f"{budget * 100:.0f} %"
    objective = f"objective {status['objective']:g} % over {status['window']}"
    line = f"  {status['name']}: {sli} ({objective}), budget left {left}"
    for alert in status["alerts"]:
        rates = [("-" if r is None else f"{r:.1f}x") for r in (alert["long_burn_rate"], alert["short_burn_rate"])]
        state = "FIRING" if alert["firing"] else "ok"
        long, short = _span(alert["long"]), _span(alert["short"])
        line += (f"\n    burn rate over {long}: {rates[0]}, over {short}: {rates[1]} "
                 f"(fires at {alert['threshold']:g}x, {alert['severity']}): {state}")  # fmt: skip
    return line


def _span(duration: str) -> str:
    """'336m' -> '5.6h': the scaled alert windows read better in hours."""
    if duration.endswith("m") and int(duration[:-1]) >= 120:
        return f"{int(duration[:-1]) / 60:g}h"
    return duration


def _report_control_plane(
    base: str, key: str, created: dict[str, list[dict[str, Any]]], status: dict[str, Any], log: Path
) -> None:
    _say()
    _say(f"Spillway control plane: {base}   (log: {log})")
    _say(f"Admin API key (shown once): {key}")
    _say()
    for kind in SEED_ORDER:
        items = created.get(kind, [])
        names = ", ".join((i.get("agent", i))["name"] for i in items)
        _say(f"  seeded {len(items)} {kind}: {names}")
    for item in created.get("agents", []):
        _say(f"  agent token for {item['agent']['name']} (shown once): {item['token']}")
    _say()
    _say(
        f"Fleet status: {status['agents']['total']} agents, {status['slos']} SLOs, "
        f"{status['rules']} rules ({status['rules_enabled']} enabled), {status['backends']} backends"
    )
    _say()
    _say("Where to look:")
    _say(f"  export SPILLWAY_API_KEY={key}")
    for path in ("status", "slos", "rules", "events", "openapi.json"):
        _say(f'  curl -H "Authorization: Bearer $SPILLWAY_API_KEY" {base}/api/v1/{path}')
    _say()
