"""The overflow story on one machine, for `make demo`, the end-to-end test and bench: a control plane (the gateway),
an edge agent whose capacity is deliberately small, and cloud backends that are Spillway agents in cloud role,
all separate processes on loopback, under an open-loop load of mixed priorities with deadlines.

Phases: normal load served locally; a burst at 3x the device's capacity, where what would miss its deadline goes
to the cloud and high priorities stay local; the cloud killed mid-burst, where the agent's breaker opens and the
fallback chain answers (cached answers, else the async queue); the cloud back, overflow again; calm.
Every request gets exactly one answer, and the story counts them by outcome per phase.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from spillway.demo.harness import Process, stop
from spillway.demo.story import READY_TIMEOUT_S, Story, read_response

OUTCOMES = ("local", "overflow", "fallback_cache", "fallback_default", "queued_async", "rejected", "error")
IDLE_S = 1.0  # the load generator drops a keep-alive connection idle longer than this (the server may close it)
DEADLINE_US = 100_000  # every request's `timeout` on a machine as fast as the slow model's nominal 20 ms a request
# ... and on a slower or busier one, this many of its measured service times: a deadline the device can meet when
# it is not overloaded (100 ms is five of the nominal 20 ms), so the story is about overload, not the machine.
DEADLINE_SERVICE_TIMES = 5
DISTINCT_INPUTS = 16  # the load cycles through these, so earlier local answers can be served from the cache
HIGH_SHARE = 0.2  # share of requests at priority 1; the rest are priority 2
# A cloud agent answers one request at a time: more than 4 in flight cannot meet a deadline of 5 service times,
# so the gateway answers `no_capacity` at once instead of a round trip to a refusal.
CLOUD_CONCURRENCY = 4


def small_repository(out: Path) -> Path:
    """The slow `mlp` (spillway/demo/models.py `build_slow_repository`): ~20 ms a request on one thread,
    one request at a time, the demo's priority levels and deadlines."""
    from spillway.demo.models import build_slow_repository

    return build_slow_repository(out)


@dataclass
class Answer:
    phase: str
    priority: int
    status: int  # 0: no HTTP answer at all (a transport error: lost)
    outcome: str
    latency_s: float
    reason: str = ""  # spillway-reason: why a request was not served locally (or not at all)


@dataclass
class LoadPhase:
    name: str
    rate: float  # requests per second, open loop
    seconds: float
    answers: list[Answer] = field(default_factory=list)
    sent: int = 0
    before: Any = None  # called (in a thread) when the phase starts: kill or restart a backend
    deadline_s: float = DEADLINE_US / 1e6  # the requests' deadline (set by the story when the phase runs)

    def outcomes(self) -> Counter[str]:
        return Counter(a.outcome for a in self.answers)

    def reasons(self) -> Counter[str]:
        return Counter(f"{a.outcome}:{a.reason}" for a in self.answers if a.reason)

    def good_within_deadline(self) -> int:
        return sum(1 for a in self.answers if a.status == 200 and a.latency_s <= self.deadline_s)

    def local_share(self, priority: int) -> str:
        """The share of this priority's answers that the device served itself, as a percentage ("-": none sent)."""
        mine = [a for a in self.answers if a.priority == priority]
        return f"{sum(a.outcome == 'local' for a in mine) / len(mine):.0%}" if mine else "-"

    def p(self, priority: int, q: float) -> float | None:
        values = sorted(a.latency_s for a in self.answers if a.priority == priority and a.status)
        if not values:
            return None
        return values[min(len(values) - 1, int(q * len(values)))]


class Cloud:
    """A cloud backend: a Spillway agent in cloud role with its own token, registered through the REST API."""

    def __init__(self, story: OverflowStory, name: str, port: int, models: Path) -> None:
        self.story, self.name, self.port, self.models = story, name, port, models
        self.url = f"http://127.0.0.1:{port}"
        self.token = f"cloud-token-{name}-{random.getrandbits(64):x}"
        self.log = story.base.root / f"{name}.log"
        self.proc: Process | None = None
        self.id = ""

    def start(self) -> None:
        config = self.story.base.root / f"{self.name}.yaml"
        config.write_text(yaml.safe_dump({
            "model_repository": str(self.models), "port": self.port, "role": "cloud", "token": self.token,
            "intra_op_threads": 1, "agent_id": self.name, "state_dir": str(self.story.base.root / f"state-{self.name}"),
        }))  # fmt: skip
        self.proc = self.story.base.start_agent_process(f"cloud backend {self.name}", config, self.log,
                                                        self.story.base.env())  # fmt: skip

    def wait(self) -> None:
        assert self.proc is not None
        self.proc.wait_ready(f"{self.url}/v2/health/live", timeout_s=READY_TIMEOUT_S)

    def register(self) -> None:
        with self.story.base.api() as client:
            made = client.post("/api/v1/backends", json={
                "name": self.name, "url": self.url, "models": ["mlp"], "max_concurrency": CLOUD_CONCURRENCY,
                "timeout_ms": 10_000, "binary_tensors": True, "auth_header": f"Bearer {self.token}",
            })  # fmt: skip
            made.raise_for_status()
            self.id = made.json()["id"]

    def kill(self) -> None:
        stop(self.proc, signal.SIGKILL)


class OverflowStory:
    """Cloud backends and an overflowing edge agent beside a `Story`'s control plane (started by the caller)."""

    def __init__(self, base: Story, *, models: Path, edge_port: int, cloud_ports: list[int]) -> None:
        self.base = base
        self.models = models
        self.edge_port = edge_port
        self.edge_url = f"http://127.0.0.1:{edge_port}"
        self.clouds = [Cloud(self, f"cloud-{i + 1}", port, models) for i, port in enumerate(cloud_ports)]
        self.edge: Process | None = None
        self.edge_log = base.root / "edge-overflow.log"
        self.edge_id = ""
        self.deadline_us = DEADLINE_US
        base.cleanup.callback(self.close)

    def start(self) -> None:
        """Enrol and start the edge agent, start and register the cloud backends."""
        for cloud in self.clouds:
            cloud.start()
        with self.base.api() as client:
            # Labels no example rule or SLO selects: this story is about overflow alone.
            made = client.post("/api/v1/agents", json={"name": "jetson-munich-01", "device_class": "jetson",
                                                        "labels": {"site": "munich", "tier": "burst"}})  # fmt: skip
            made.raise_for_status()
        body = made.json()
        self.edge_id, token = body["agent"]["id"], body["token"]
        config = self.base.root / "edge-overflow.yaml"
        config.write_text(yaml.safe_dump({
            "model_repository": str(self.models), "port": self.edge_port, "agent_id": self.edge_id,
            "control_plane": self.base.base, "export_interval_s": self.base.interval_s,
            "policy_poll_interval_s": self.base.interval_s, "device_class": "jetson", "intra_op_threads": 1,
            "state_dir": str(self.base.root / "state-edge-overflow"),
            # The breaker opens on failures; the gateway ends every forwarded request at its deadline.
            "overflow": {"enabled": True, "breaker": {"min_requests": 5, "open_s": 2.0, "stat_interval_s": 2.0}},
            "async_jobs": {"models": ["mlp"], "max_jobs": 2000, "ttl_s": 600},
        }))  # fmt: skip
        env = {**self.base.env(), "SPILLWAY_AGENT_TOKEN": token}
        self.edge = self.base.start_agent_process("the edge agent (overflow)", config, self.edge_log, env)
        for cloud in self.clouds:
            cloud.wait()
            cloud.register()
        self.edge.wait_ready(f"{self.edge_url}/v2/health/ready", timeout_s=READY_TIMEOUT_S)

    def close(self) -> None:
        stop(self.edge)
        for cloud in self.clouds:
            stop(cloud.proc)

    def edge_status(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.edge_url}/v2/spillway/status", timeout=5).json())

    def edge_outcomes(self) -> Counter[str]:
        counted: Counter[str] = Counter()
        for item in self.edge_status()["outcomes"]:
            counted[item["outcome"]] += item["count"]
        return counted

    def gateway(self) -> list[dict[str, Any]]:
        with self.base.api() as client:
            found = client.get("/api/v1/status").json().get("gateway") or {}
        backends = found.get("backends", []) if isinstance(found, dict) else found
        return list(backends)

    def wait_backend_usable(self, name: str, deadline_s: float = 30.0) -> None:
        """Until the gateway counts the backend healthy and not ejected (after a restart)."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            state = next((b for b in self.gateway() if b["name"] == name), None)
            if state is not None and state.get("healthy") and not state.get("ejected"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the gateway did not take backend {name} back within {deadline_s:.0f} s")

    # ---- load ----------------------------------------------------------------------------------

    def calibrate(self, seconds: float = 2.0) -> float:
        """The edge's capacity (requests/s) measured now, and the story's deadline from it: DEADLINE_US, or
        DEADLINE_SERVICE_TIMES service times where the machine is slower or busy with other work."""
        capacity = self.capacity(seconds)
        self.deadline_us = max(DEADLINE_US, round(DEADLINE_SERVICE_TIMES * 1e6 / max(capacity, 1.0)))
        return capacity

    def capacity(self, seconds: float = 2.0, clients: int = 16) -> float:
        """Requests per second the edge agent answers itself under a closed-loop saturating load (priority 3,
        whose 1 s deadline the queue of `clients` requests meets: nothing overflows)."""
        return asyncio.run(self._closed_loop(seconds, clients))

    async def _closed_loop(self, seconds: float, clients: int) -> float:
        bodies = _bodies(priority=3, timeout_us=None)
        done = 0
        end = time.monotonic() + seconds

        async def client(i: int) -> None:
            nonlocal done
            reader, writer = await asyncio.open_connection("127.0.0.1", self.edge_port)
            try:
                while time.monotonic() < end:
                    writer.write(bodies[i % len(bodies)])
                    status, headers, _ = await read_response(reader)
                    if status == 200 and headers.get("spillway-outcome") == "local":
                        done += 1
            finally:
                writer.close()

        await asyncio.gather(*(client(i) for i in range(clients)))
        return done / seconds

    def run(self, phases: list[LoadPhase], *, on_phase: Any = None) -> list[LoadPhase]:
        return asyncio.run(self._run(phases, on_phase))

    async def _run(self, phases: list[LoadPhase], on_phase: Any) -> list[LoadPhase]:
        high = _bodies(priority=1, timeout_us=self.deadline_us)
        low = _bodies(priority=2, timeout_us=self.deadline_us)
        rng = random.Random(11)  # noqa: S311 (load mix, not secrets)
        idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []
        pending: set[asyncio.Task[None]] = set()

        def reuse() -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
            while idle:
                reader, writer, since = idle.pop()
                if time.monotonic() - since < IDLE_S:
                    return reader, writer
                writer.close()  # it may have been closed by the server: a request sent on it would be lost
            return None

        async def one(phase: LoadPhase, request: bytes, priority: int, scheduled: float) -> None:
            connection = reuse()
            try:
                if connection is None:
                    connection = await asyncio.open_connection("127.0.0.1", self.edge_port)
                reader, writer = connection
                writer.write(request)
                status, headers, _ = await read_response(reader)
                outcome = headers.get("spillway-outcome", f"HTTP {status}")
                reason = headers.get("spillway-reason", "")
                if headers.get("connection", "").lower() == "close":
                    writer.close()
                else:
                    idle.append((reader, writer, time.monotonic()))
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                status, outcome, reason = 0, "lost", type(exc).__name__
                if connection is not None:
                    connection[1].close()
            phase.answers.append(Answer(phase.name, priority, status, outcome, time.monotonic() - scheduled, reason))

        for index, phase in enumerate(phases):
            phase.deadline_s = self.deadline_us / 1e6
            if phase.before is not None:
                await asyncio.to_thread(phase.before)
            if on_phase is not None:
                on_phase(index, phase)
            start = time.monotonic()
            count = int(phase.rate * phase.seconds)
            for i in range(count):
                scheduled = start + i / phase.rate
                delay = scheduled - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                priority = 1 if rng.random() < HIGH_SHARE else 2
                bodies = high if priority == 1 else low
                task = asyncio.create_task(one(phase, bodies[i % len(bodies)], priority, scheduled))
                pending.add(task)
                task.add_done_callback(pending.discard)
                phase.sent += 1
            await asyncio.gather(*list(pending))  # each phase ends when all its answers are in
        for _, writer, _ in idle:
            writer.close()
        return phases


def _bodies(*, priority: int, timeout_us: int | None) -> list[bytes]:
    """Raw HTTP/1.1 requests, one per distinct input."""
    rng = random.Random(5)  # noqa: S311
    requests = []
    for _ in range(DISTINCT_INPUTS):
        parameters: dict[str, Any] = {"priority": priority}
        if timeout_us is not None:
            parameters["timeout"] = timeout_us
        body = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32",
                                       "data": [round(rng.uniform(-1, 1), 3) for _ in range(512)]}],
                           "parameters": parameters}).encode()  # fmt: skip
        requests.append(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
    return requests


def standard_phases(capacity: float, story: OverflowStory) -> list[LoadPhase]:
    """Normal load, a 3x burst, the cloud killed mid-burst, the cloud back (overflow again), calm."""
    cloud = story.clouds[0]

    def back() -> None:
        cloud.start()
        cloud.wait()
        story.wait_backend_usable(cloud.name)

    return [
        LoadPhase("normal (0.5x)", 0.5 * capacity, 4.0),
        LoadPhase("burst (3x)", 3 * capacity, 6.0),
        LoadPhase("cloud down (3x)", 3 * capacity, 6.0, before=cloud.kill),
        LoadPhase("cloud back (3x)", 3 * capacity, 5.0, before=back),
        LoadPhase("calm (0.5x)", 0.5 * capacity, 3.0),
    ]


def format_phases(phases: list[LoadPhase]) -> str:
    shown = [o for o in OUTCOMES if any(p.outcomes()[o] for p in phases)]
    extra = sorted({o for p in phases for o in p.outcomes()} - set(OUTCOMES))
    columns = shown + extra
    lines = [
        "| phase | rps | sent | "
        + " | ".join(columns)
        + " | lost | in deadline | local P1 | local P2 | p99 P1 ms | p99 P2 ms |",
        "|---|---:|---:|" + "---:|" * len(columns) + "---:|---:|---:|---:|---:|---:|",
    ]
    for phase in phases:
        counts = phase.outcomes()
        lost = phase.sent - len(phase.answers) + counts["lost"]
        cells = [str(counts[c]) for c in columns]
        p1, p2 = phase.p(1, 0.99), phase.p(2, 0.99)
        share = phase.good_within_deadline() / max(1, phase.sent)
        lines.append(
            f"| {phase.name} | {phase.rate:.0f} | {phase.sent} | " + " | ".join(cells)
            + f" | {lost} | {share:.0%} | {phase.local_share(1)} | {phase.local_share(2)} | {_ms(p1)} | {_ms(p2)} |"
        )  # fmt: skip
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


__all__ = ["OUTCOMES", "Cloud", "LoadPhase", "OverflowStory", "format_phases", "small_repository", "standard_phases"]
