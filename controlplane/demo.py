"""`spillway demo`: a control plane on SQLite, an admin key, and the example fleet seeded through the REST API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

EXAMPLE_FLEET = Path(__file__).resolve().parent.parent / "examples" / "fleet.yaml"
SEED_ORDER = ("agents", "slos", "rules", "backends")


def _say(line: str = "") -> None:
    print(line, flush=True)


def _wait_ready(client: httpx.Client, proc: subprocess.Popen[bytes], deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the control plane exited with code {proc.returncode}; see the lines above")
        try:
            if client.get("/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the control plane was not ready within {deadline_s:.0f} s")


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


def run_demo(*, port: int, data_dir: str, once: bool) -> int:
    from controlplane.access import issue_api_key
    from controlplane.db import make_engine, make_sessionmaker, migrate_to, transaction
    from controlplane.db.repository import Actor

    root = Path(data_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    db_file = root / "demo.db"  # never the default `spillway.db`, even with --data-dir .
    for stale in root.glob("demo.db*"):
        stale.unlink()  # a fresh story every run
    url = f"sqlite:///{db_file}"
    base = f"http://127.0.0.1:{port}"

    migrate_to(url)
    engine = make_engine(url)
    with transaction(make_sessionmaker(engine)) as session:
        _, admin_key = issue_api_key(session, "demo-admin", "admin", Actor("cli", "spillway demo"))
    engine.dispose()

    env = {**os.environ, "SPILLWAY_DATABASE_URL": url, "SPILLWAY_PORT": str(port), "SPILLWAY_HOST": "127.0.0.1"}
    log_path = root / "controlplane.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "controlplane.cli", "controlplane", "serve", "--no-migrate"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {admin_key}"}, timeout=10) as client:
            try:
                _wait_ready(client, proc)
            except RuntimeError as exc:
                _say(f"error: {exc} (log: {log_path})")
                return 1
            fleet = yaml.safe_load(EXAMPLE_FLEET.read_text())
            created = seed(client, fleet)
            fleet_status = client.get("/api/v1/status").json()
        _report(base, admin_key, created, fleet_status, log_path)
        if once:
            return 0
        _say("Serving until Ctrl-C.")
        signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
        try:
            return proc.wait()
        except KeyboardInterrupt:
            return 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def _report(base: str, key: str, created: dict[str, list[dict[str, Any]]], status: dict[str, Any], log: Path) -> None:
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
    _say(f'  curl -H "Authorization: Bearer $SPILLWAY_API_KEY" {base}/api/v1/status')
    _say(f'  curl -H "Authorization: Bearer $SPILLWAY_API_KEY" {base}/api/v1/slos')
    _say(f'  curl -H "Authorization: Bearer $SPILLWAY_API_KEY" {base}/api/v1/rules')
    _say(f'  curl -H "Authorization: Bearer $SPILLWAY_API_KEY" {base}/api/v1/events')
    _say(f'  curl -H "Authorization: Bearer $SPILLWAY_API_KEY" {base}/api/v1/openapi.json')
    _say()
