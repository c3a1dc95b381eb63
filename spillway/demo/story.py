"""The control loop's story on one machine, for `make demo`, the end-to-end test and bench/reaction.py: a real
control plane and a real edge agent (separate processes, loopback), a degradation rule, and a load ramp that
pushes the agent past it and back.

The rule watches the agent's queue depth for `mlp` (a gauge exported every second) and switches the model to its
lite variant (version 2) while the queue is deep; requests name no version, so they go wherever the policy says.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from spillway.demo.harness import Process, stop, stop_all
from spillway.demo.progress import waiting

INTERVAL_S = 1.0  # export, poll and loop interval of the story: reactions in seconds, not minutes
QUEUE_THRESHOLD = 12
RULE = {
    "name": "lite-when-queue-deep",
    "description": "a deep mlp queue switches mlp to its lite variant until the queue stays short",
    "selector": {"labels": {"site": "berlin"}, "model": "mlp"},
    "condition": {"kind": "gauge", "metric": "queue_depth", "op": ">", "threshold": QUEUE_THRESHOLD},
    "action": {"kind": "switch_variant", "version": 2},
    "hysteresis": {"for": "0s", "recover_after": "8s"},
}
READY_TIMEOUT_S = 120.0  # how long a process of the story may take to answer its readiness check
STOP_GRACE_S = 5.0  # at the end (or Ctrl-C), how long the story's processes get after SIGTERM before SIGKILL


@dataclass
class Sample:
    at: float  # seconds since the ramp began
    status: int
    version: str | None


@dataclass
class Phase:
    name: str
    clients: int
    seconds: float
    samples: list[Sample] = field(default_factory=list)
    until: str | None = None  # end the phase early at the first answer from this model version
    ended_early: bool = False

    def versions(self) -> Counter[str]:
        return Counter(s.version or f"HTTP {s.status}" for s in self.samples)


class Story:
    """A control plane and an agent playing an enrolled agent; `with Story(root) as story:` stops both, and every
    other process started through it (`start_agent_process`, `track`): SIGTERM to all at once, SIGKILL to any still
    running after `STOP_GRACE_S`."""

    def __init__(self, root: Path, *, port: int, agent_port: int, interval_s: float = INTERVAL_S) -> None:
        self.root = root
        self.base = f"http://127.0.0.1:{port}"
        self.agent_base = f"http://127.0.0.1:{agent_port}"
        self.port, self.agent_port, self.interval_s = port, agent_port, interval_s
        self.cp: Process | None = None
        self.agent: Process | None = None
        self.admin_key = ""
        self.agent_id = ""
        self.agent_token = ""
        self.rule_id = ""
        self.cleanup = ExitStack()
        self.children: list[Process] = []  # every process the story started, stopped together at its end
        self.cli = [sys.executable, "-m", "spillway.cli"]
        self.cp_log, self.agent_log = root / "controlplane.log", root / "agent.log"

    # ---- processes ---------------------------------------------------------------------------

    def prepare(self) -> str:
        """A fresh SQLite database, migrated, with an admin key (returned; shown once by the demo)."""
        from controlplane.access import issue_api_key
        from controlplane.db import make_engine, make_sessionmaker, migrate_to, transaction
        from controlplane.db.repository import Actor

        self.root.mkdir(parents=True, exist_ok=True)
        for old in self.root.glob("demo.db*"):  # a fresh story every run; never the default `spillway.db`
            old.unlink()
        url = self.env()["SPILLWAY_DATABASE_URL"]
        migrate_to(url)
        engine = make_engine(url)
        try:
            with transaction(make_sessionmaker(engine)) as session:
                self.admin_key = issue_api_key(session, "demo-admin", "admin", Actor("cli", "spillway demo"))[1]
        finally:
            engine.dispose()
        return self.admin_key

    def env(self) -> dict[str, str]:
        interval = str(self.interval_s)
        return {**{k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")},
                "SPILLWAY_DATABASE_URL": f"sqlite:///{self.root / 'demo.db'}", "SPILLWAY_PORT": str(self.port),
                "SPILLWAY_HOST": "127.0.0.1", "SPILLWAY_CONTROL_LOOP_INTERVAL_S": str(self.interval_s / 2),
                "SPILLWAY_EVALUATION_INTERVAL_S": interval, "SPILLWAY_POLICY_POLL_INTERVAL_S": interval,
                "SPILLWAY_AGENT_EXPORT_INTERVAL_S": interval,
                # The gateway notices a dead or returning backend within a second; an ejection lasts seconds.
                "SPILLWAY_GATEWAY_HEALTH_INTERVAL_S": str(self.interval_s / 2),
                "SPILLWAY_GATEWAY_BASE_EJECTION_S": str(self.interval_s * 3),
                "SPILLWAY_GATEWAY_REFRESH_S": interval}  # fmt: skip

    def start_control_plane(self, *, migrate: bool = False) -> None:
        args = [*self.cli, "controlplane", "serve"] + ([] if migrate else ["--no-migrate"])
        self.cp = self.track(Process.start(args, name="the control plane", log=self.cp_log, env=self.env()))
        with waiting(f"the control plane ({self.base}/readyz)"):
            self.cp.wait_ready(f"{self.base}/readyz", timeout_s=READY_TIMEOUT_S)

    def agent_config(self, models: Path, agent: dict[str, Any]) -> Path:
        path = self.root / "agent.yaml"
        config = {
            "model_repository": str(models), "port": self.agent_port, "agent_id": agent["id"],
            "control_plane": self.base, "export_interval_s": self.interval_s,
            "policy_poll_interval_s": self.interval_s, "device_class": agent["device_class"],
            "labels": agent["labels"], "state_dir": str(self.root / "state"), "default_versions": {"mlp": 1},
        }  # fmt: skip
        path.write_text(yaml.safe_dump(config))
        return path

    def start_agent(self, models: Path, agent: dict[str, Any], token: str) -> None:
        config = self.agent_config(models, agent)
        env = {**self.env(), "SPILLWAY_AGENT_TOKEN": token}  # not on the command line: `ps` would show it
        self.agent = self.start_agent_process("the edge agent", config, self.agent_log, env)
        with waiting(f"the edge agent to load its models ({self.agent_base}/v2/health/ready)"):
            self.agent.wait_ready(f"{self.agent_base}/v2/health/ready", timeout_s=READY_TIMEOUT_S)

    def start_agent_process(self, name: str, config: Path, log: Path, env: dict[str, str]) -> Process:
        """`spillway agent serve --config CONFIG` with its output appended to `log` (not waited for)."""
        return self.track(Process.start([*self.cli, "agent", "serve", "--config", str(config)], name=name, log=log,
                                        env=env))  # fmt: skip

    def track(self, process: Process) -> Process:
        """Stop `process` with the story's other processes at its end; returns it."""
        self.children.append(process)
        return process

    def stop_children(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to every process of the story at once, then SIGKILL to those still running after `grace_s`."""
        stop_all(self.children, grace_s=grace_s)

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=10)

    def enrol_and_add_rule(self, rule: dict[str, Any] | None = None) -> dict[str, Any]:
        """The agent this story's agent plays, and the rule; returns the agent as created."""
        with self.api() as client:
            created = client.post("/api/v1/agents", json={"name": "jetson-berlin-01", "device_class": "jetson",
                                                            "labels": {"site": "berlin", "tier": "edge"}})  # fmt: skip
            created.raise_for_status()
        body = created.json()
        self.agent_id, self.agent_token = body["agent"]["id"], body["token"]
        self.add_rule(rule)
        return dict(body["agent"])

    def add_rule(self, rule: dict[str, Any] | None = None) -> str:
        with self.api() as client:
            made = client.post("/api/v1/rules", json=rule or RULE)
            made.raise_for_status()
        self.rule_id = made.json()["id"]
        return self.rule_id

    def agent_status(self) -> dict[str, Any]:
        response = httpx.get(f"{self.agent_base}/v2/spillway/status", timeout=5)
        response.raise_for_status()
        return dict(response.json())

    def events(self, since_id: int = 0) -> list[dict[str, Any]]:
        with self.api() as client:
            items = client.get("/api/v1/events", params={"limit": 500}).json()["items"]
        return sorted((e for e in items if e["id"] > since_id), key=lambda e: e["id"])

    def __enter__(self) -> Story:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_children()
        self.cleanup.close()

    # ---- load ----------------------------------------------------------------------------------

    async def ramp(self, phases: list[Phase], *, on_tick: Any = None) -> list[Phase]:
        """Run each phase's closed-loop clients for its seconds (no version named: the policy decides). A lean
        keep-alive HTTP/1.1 client, as in `spillway agent burst`: a Python HTTP library would be the bottleneck."""
        body = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32",
                                       "data": [0.25] * 512}], "parameters": {"priority": 2}}).encode()  # fmt: skip
        request = (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
        started = time.monotonic()
        for phase in phases:
            end = time.monotonic() + phase.seconds

            async def worker(phase: Phase = phase, end: float = end) -> None:
                reader = writer = None
                while time.monotonic() < end and not phase.ended_early:
                    try:
                        if writer is None:
                            reader, writer = await asyncio.open_connection("127.0.0.1", self.agent_port)
                        assert reader is not None
                        writer.write(request)
                        status, _, answer = await read_response(reader)
                        found = _VERSION.search(answer[:200]) if status == 200 else None
                        version = found.group(1).decode() if found else None
                        phase.samples.append(Sample(time.monotonic() - started, status, version))
                        if phase.until is not None and version == phase.until:
                            phase.ended_early = True
                    except (OSError, asyncio.IncompleteReadError, ValueError):
                        phase.samples.append(Sample(time.monotonic() - started, 0, None))
                        if writer is not None:
                            writer.close()
                        reader = writer = None
                        await asyncio.sleep(0.05)
                    if phase.clients <= 2:
                        await asyncio.sleep(0.02)  # light load: a trickle
                if writer is not None:
                    writer.close()

            async def ticker(phase: Phase = phase, end: float = end) -> None:
                while on_tick is not None and time.monotonic() < end and not phase.ended_early:
                    await asyncio.sleep(1.0)
                    on_tick(time.monotonic() - started)

            await asyncio.gather(*(worker() for _ in range(phase.clients)), ticker())
        return phases


_VERSION = re.compile(rb'"model_version"\s*:\s*"(\d+)"')


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length: status, headers (lower-case names) and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))


def first_at(phase: Phase, version: str, after: float = 0.0) -> float | None:
    """When the first answer from `version` came in this phase (seconds since the ramp began)."""
    return next((s.at for s in phase.samples if s.version == version and s.at >= after), None)


__all__ = [
    "INTERVAL_S",
    "READY_TIMEOUT_S",
    "RULE",
    "STOP_GRACE_S",
    "Phase",
    "Sample",
    "Story",
    "first_at",
    "read_response",
    "stop",
]
