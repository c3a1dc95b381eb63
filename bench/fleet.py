"""A fleet on one machine: N simulated agents against real control-plane processes (one on SQLite, or replicas on
PostgreSQL behind a round-robin load balancer), with real exports, policy polls and overflow through the gateway.

One invocation, per fleet size in `--agents` (e.g. `100,300,1000`: a fresh database and fresh processes each):

  1. a fresh database (a SQLite file, or a throwaway PostgreSQL database made on `--postgres-url`'s server and
     dropped afterwards), migrated, with an admin key; `--replicas` control planes (`spillway controlplane serve`,
     the ingest log in the work folder), and with more than one, `--lb` (nginx or HAProxy, `bench/lb.py`) in front,
     round robin per request, no stickiness; a Spillway agent in cloud role serving the demo models, registered as
     the gateway's backend;
  2. N agents enrolled through the REST API (`POST /api/v1/agents`), each with its own token;
  3. what each agent exports, made beforehand (not timed) by the real OpenTelemetry SDK: `--templates` simulated
     agents, each its own `AgentTelemetry` (V2 instruments fed by `ModelStats` for `mlp`, and a generative model's
     GenAI histograms: `gen_ai.server.time_to_first_token`, `time_per_output_token`, `request.duration`,
     `gen_ai.client.token.usage`, its step tokens, KV-block and stream gauges), read by an `InMemoryMetricReader`
     (cumulative) and encoded by the OTLP exporter's `encode_metrics`; every export adds traffic, so successive
     exports grow like a real agent's. Agent i sends template i mod K with its own id in `service.instance.id`
     (the id is spliced into the encoded bytes: same length, same protobuf);
  4. the fleet, from `--shards` asyncio processes (uvloop, raw HTTP/1.1, keep-alive, reconnecting when the server
     closed an idle connection): each agent exports every `--export-interval` s and polls its policy
     (`If-None-Match` with the ETag it holds) every `--poll-interval` s, each at a random phase; an export answered
     502/503/504 or not at all is retried like the OTLP exporter (after 1 s, 2 s, 4 s ...) until its next one is due;
     `--overflow-share` of the fleet's requests (as its exports count them) go through the gateway
     (`POST /v2/models/mlp/versions/2/infer` with a random agent's token), each followed by the same request sent
     to the cloud agent directly: the gateway's added latency is the difference of the two medians under the same
     load;
  5. part-way (`--fire-at`), a rule whose condition every agent's exports meet (queue depth > 0 for `mlp`: a
     switch to version 2) is created: the next control-loop cycle fires it for the whole fleet at once (an event
     and a new policy per agent); the agents' next polls fetch the new documents;
  6. with `--kill-leader-at`, the replica leading the control loop is killed (SIGKILL) then, and restarted
     `--restart-after` s later (it replays its ingest log); the other replica takes the loop over;
  7. the control loop's cycle times, read from each replica's `/metrics` every second
     (`spillway_control_loop_cycle_seconds` sum and count: one cycle between two reads gives its exact duration),
     the CPU of every process over the measured window, and each replica's peak RSS;
  8. after every process stopped (SIGTERM: what was logged is applied), a check that nothing was lost or counted
     twice: per agent, the rollups' sum of `spillway.requests` and the count of `spillway.request.duration` equal
     the cumulative values of its last acknowledged export.

Results go to stdout and, with `--write`, into docs/benchmarks.md between this script's markers: every row is kept
there (in a data comment) with its command and date, and a run replaces the rows of the same scenario (store,
replicas, agents, leader kill).

    flock /tmp/spillway-bench.lock .venv/bin/python bench/fleet.py --agents 1000 --seconds 60 --write
    flock /tmp/spillway-bench.lock .venv/bin/python bench/fleet.py --store postgres --replicas 2 \\
        --agents 100,300,1000 --seconds 40 --write
    .venv/bin/python bench/fleet.py --agents 50 --seconds 5 --export-interval 1 --poll-interval 1   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.common import DOCS, VENV_BIN, bearer, free_port, http_json, log, median, percentile  # noqa: E402
from bench.ingest import (  # noqa: E402
    Database,
    Export,
    collect_export,
    database,
    rejected_points,
    spillway,
    stored_totals,
)
from bench.lb import balancer  # noqa: E402
from bench.load import _Connection  # noqa: E402
from bench.procstat import cpu_seconds, loadavg, machine_busy_seconds, vm_hwm  # noqa: E402
from spillway.contract import names  # noqa: E402
from spillway.demo.harness import Process  # noqa: E402

BEGIN = "<!-- bench/fleet.py: begin (generated; edit outside these markers) -->"
END = "<!-- bench/fleet.py: end -->"
DATA = re.compile(r"<!-- fleet-data: (.*?) -->", re.S)
PLACEHOLDER = b"zzzzzzzzzzzzzzzz"  # an agent id's length (16 hex digits), and never one: spliced per agent
PRIORITIES = (1, 2, 3)
CLOUD_SECRET = "fleet-cloud-agent-secret"  # a loopback benchmark's cloud agent
RETRY_S = 1.0  # the OTLP exporter's first backoff, doubled at each retry
TIMEOUT_S = 30.0
LABELS = {"tier": "edge", "site": "fleet"}
RULE = {
    "name": "fleet-wide-firing",
    "description": "bench/fleet.py: every agent's mlp queue is deeper than 0, so this fires for the whole fleet",
    "selector": {"labels": {"site": "fleet"}, "model": "mlp"},
    "condition": {"kind": "gauge", "metric": "queue_depth", "op": ">", "threshold": 0},
    "action": {"kind": "switch_variant", "version": 2},
    "hysteresis": {"for": "0s", "recover_after": "3600s"},
}


@dataclass(frozen=True)
class Options:
    agents: tuple[int, ...]
    seconds: float
    warmup_s: float
    export_interval_s: float
    poll_interval_s: float
    loop_interval_s: float
    store: str
    postgres_url: str | None
    replicas: int
    lb: str
    kill_leader_at: float | None
    restart_after_s: float
    fire_at: float | None
    overflow_share: float
    templates: int
    shards: int
    cloud: bool
    write: bool
    cp_env: tuple[str, ...]
    reading: Path | None
    render_only: bool
    profile_s: int
    argv: tuple[str, ...]


def parse_args(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", default="1000", help="fleet size, or sizes comma-separated (a run each)")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds first (default: one export interval)")
    parser.add_argument("--export-interval", type=float, default=5.0, help="seconds between an agent's exports")
    parser.add_argument("--poll-interval", type=float, default=5.0, help="seconds between an agent's policy polls")
    parser.add_argument("--loop-interval", type=float, default=5.0, help="the control loop's interval (seconds)")
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("SPILLWAY_TEST_POSTGRES_URL"),
        help="a PostgreSQL server the script may create and drop a database on (default: $SPILLWAY_TEST_POSTGRES_URL)",
    )
    parser.add_argument("--replicas", type=int, default=1, help="control-plane processes (more than 1: PostgreSQL)")
    parser.add_argument("--lb", choices=("nginx", "haproxy"), default="nginx", help="in front of the replicas")
    parser.add_argument("--kill-leader-at", type=float, help="measured second at which the loop's leader is killed")
    parser.add_argument("--restart-after", type=float, default=10.0, help="seconds until the killed one restarts")
    parser.add_argument("--fire-at", type=float, help="measured second of the fleet-wide rule (default: the middle)")
    parser.add_argument("--no-firing", action="store_true", help="no fleet-wide rule")
    parser.add_argument("--overflow-share", type=float, default=0.02, help="share of requests through the gateway")
    parser.add_argument("--templates", type=int, default=8, help="distinct agent histories made with the SDK")
    parser.add_argument("--shards", type=int, default=1, help="load-generating processes")
    parser.add_argument("--no-cloud", action="store_true", help="no cloud agent and no overflow")
    parser.add_argument("--cp-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra setting for the control planes, e.g. SPILLWAY_INGEST_ACK=applied")  # fmt: skip
    parser.add_argument("--write", action="store_true", help=f"write the results into {DOCS.relative_to(ROOT)}")
    parser.add_argument("--profile", type=int, default=0, metavar="SECONDS",
                        help="py-spy control plane 0 this long, from the window's second second")  # fmt: skip
    parser.add_argument("--reading", type=Path, help="a markdown file: the section's Reading paragraphs (kept after)")
    parser.add_argument("--render-only", action="store_true",
                        help="run nothing: the section again from its rows (with --write, --reading)")  # fmt: skip
    args = parser.parse_args(argv)
    agents = tuple(int(a) for a in args.agents.split(",") if a.strip())
    if not agents or min(agents) < 1:
        parser.error("--agents: one or more positive fleet sizes")
    if args.replicas < 1 or (args.replicas > 1 and args.store != "postgres"):
        parser.error("--replicas above 1 needs --store postgres (a SQLite file has one writer)")
    if args.store == "postgres" and not args.postgres_url:
        parser.error("--store postgres needs --postgres-url (or SPILLWAY_TEST_POSTGRES_URL)")
    if args.kill_leader_at is not None and args.replicas < 2:
        parser.error("--kill-leader-at needs --replicas 2 or more")
    if min(args.export_interval, args.poll_interval) <= 0 or args.seconds <= 0:
        parser.error("intervals and --seconds must be positive")
    if any("=" not in e for e in args.cp_env):
        parser.error("--cp-env takes KEY=VALUE")
    fire_at = None if args.no_firing else (args.fire_at if args.fire_at is not None else args.seconds / 2)
    return Options(
        agents=agents,
        seconds=args.seconds,
        warmup_s=args.export_interval if args.warmup is None else args.warmup,
        export_interval_s=args.export_interval,
        poll_interval_s=args.poll_interval,
        loop_interval_s=args.loop_interval,
        store=args.store,
        postgres_url=args.postgres_url,
        replicas=args.replicas,
        lb=args.lb,
        kill_leader_at=args.kill_leader_at,
        restart_after_s=args.restart_after,
        fire_at=fire_at,
        overflow_share=0.0 if args.no_cloud else args.overflow_share,
        templates=max(1, args.templates),
        shards=max(1, args.shards),
        cloud=not args.no_cloud,
        write=args.write,
        cp_env=tuple(args.cp_env),
        reading=args.reading,
        render_only=args.render_only,
        profile_s=args.profile,
        argv=tuple(argv),
    )


# ---- what the agents export: the real SDK's encoding -----------------------------------------------


def make_template(seed: int, count: int, export_interval_s: float) -> list[Export]:
    """`count` successive exports of one simulated agent (id `PLACEHOLDER`), as its periodic reader sends them: an
    `mlp` model fed through `ModelStats` and a generative `tiny-lm` through the GenAI recorder, `export_interval_s`
    of traffic each."""
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from edge_agent.scheduling.stats import ModelStats
    from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
    from edge_agent.telemetry.probes import host_memory

    reader = InMemoryMetricReader()  # cumulative temporality for every instrument kind, like the OTLP exporter's
    settings = TelemetrySettings(agent_id=PLACEHOLDER.decode(), device_class="cpu", labels=LABELS)
    telemetry = AgentTelemetry(settings, readers=[reader], probes=False)

    def memory(_options: CallbackOptions) -> list[Observation]:
        return list(host_memory())

    telemetry.provider.get_meter("spillway.edge_agent.host").create_observable_gauge(
        "system.memory.usage", callbacks=[memory], unit="By", description="host memory by state"
    )
    rng = random.Random(seed)
    depths = dict.fromkeys(PRIORITIES, 1)
    telemetry.watch_queue(
        lambda: [
            ({names.ATTR_MODEL: "mlp", names.ATTR_VERSION: "1", names.ATTR_PRIORITY: p}, depths[p]) for p in PRIORITIES
        ]
    )
    engine: dict[str, Any] = {"active": 0, "preemptions": 0, "kv_blocks": {"used": 0, "total": 512}}
    telemetry.watch_engines(lambda: [("tiny-lm", engine)])
    stats = ModelStats(listener=telemetry.recorder("mlp", 1))
    generation = telemetry.generation("tiny-lm")
    rate = max(1, round(export_interval_s / 5))  # traffic per export in proportion to the interval
    exports = []
    for i in range(count):
        first = i == 0  # every series appears in the first export
        for p in PRIORITIES:
            for _ in range(rate * rng.randint(1, 3)):
                queue_s, compute_s = rng.expovariate(250.0), rng.uniform(0.002, 0.02)
                stats.request(p, "local", queue_s, compute_s, queue_s + compute_s + 0.0004)
            if first or rng.random() < 0.3:  # a deadline that passed in the queue: rejected, with durations
                waited = rng.uniform(0.05, 0.5)
                stats.request(p, "rejected", waited, 0.0, waited)
            if first or rng.random() < 0.1:
                stats.outcome(p, "error")
            depths[p] = rng.randint(1, 40)  # never 0: the fleet-wide rule's condition holds for every agent
        stats.batch(rng.randint(1, 32), 0.01, True)
        for operation in ("chat", "text_completion"):
            for _ in range(rate * rng.randint(1, 2)):
                completion = rng.randint(8, 256)
                ttft = rng.uniform(0.02, 0.4)
                tpot = rng.uniform(0.01, 0.08)
                generation.finished(rng.choice(PRIORITIES[:2]), "local", operation=operation,
                                    prompt_tokens=rng.randint(16, 1024), completion_tokens=completion, ttft_s=ttft,
                                    duration_s=ttft + (completion - 1) * tpot)  # fmt: skip
                generation.step(rng.randint(1, 64))
        engine["active"] = rng.randint(0, 8)
        engine["preemptions"] = int(engine["preemptions"]) + (1 if rng.random() < 0.1 else 0)
        engine["kv_blocks"] = {"used": rng.randint(0, 512), "total": 512}
        export = collect_export(reader)
        assert export.body.count(PLACEHOLDER) == 1, "the placeholder id must occur once, in service.instance.id"
        exports.append(export)
    telemetry.shutdown()
    return exports


def make_templates(count: int, exports: int, export_interval_s: float) -> list[list[Export]]:
    with ProcessPoolExecutor(max_workers=min(count, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(make_template, seed, exports, export_interval_s) for seed in range(count)]
        return [f.result() for f in futures]


# ---- the fleet's load (in shard processes) --------------------------------------------------------


class _Http(_Connection):
    """One keep-alive HTTP/1.1 connection, one request at a time; answers (status, body, etag), and closes when the
    server says `Connection: close`."""

    keep_body = True

    def result(self, head: bytes) -> tuple[int, bytes, str]:
        headers = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
        if headers.get(b"connection", b"").strip() == b"close" and self.transport is not None:
            self.closed = True
            self.transport.close()
        return int(head[9:12]), self.body, headers.get(b"etag", b"").strip().decode()


class _Link:
    """A client's connection to one address, made again when the server closed it (uvicorn closes a keep-alive
    connection idle for 5 s: an agent exporting every 5 s finds it closed about half the time)."""

    reconnects = 0

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.conn: _Http | None = None

    async def call(self, payload: bytes) -> tuple[int, bytes, str]:
        for attempt in range(2):
            if self.conn is None or self.conn.closed:
                _, self.conn = await asyncio.get_running_loop().create_connection(_Http, self.host, self.port)
            try:
                return await asyncio.wait_for(self.conn.send(payload), TIMEOUT_S)
            except ConnectionError:  # closed while idle, as we sent: nothing was read; once more on a new one
                self.conn = None
                if attempt:
                    raise
                _Link.reconnects += 1
            except TimeoutError:
                self.close()
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.close()
        self.conn = None


def _head(method: str, path: str, host: str, token: str, extra: str = "", length: int | None = None) -> bytes:
    lines = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n{extra}"
    if length is not None:
        lines += f"Content-Length: {length}\r\n"
    return (lines + "\r\n").encode()


@dataclass
class ShardSpec:
    index: int
    agents: list[tuple[str, str, int]]  # (agent id, token, template)
    templates: list[list[bytes]]  # bodies with PLACEHOLDER
    points: list[list[int]]
    url: str  # the control plane (or the load balancer): exports, polls and the gateway
    cloud: str | None  # the cloud agent, for the direct requests beside the gateway's
    infer_body: bytes
    overflow_rps: float
    start: float  # time.time() of the run's start (the warm-up's)
    warmup_s: float
    seconds: float
    export_interval_s: float
    poll_interval_s: float
    seed: int


def run_shard(spec: ShardSpec) -> dict[str, Any]:
    """One load-generating process: its agents' exports, polls and overflow; every answer as a record."""
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        import uvloop

        return uvloop.run(_shard(spec))
    except ImportError:
        return asyncio.run(_shard(spec))


async def _shard(spec: ShardSpec) -> dict[str, Any]:
    host_port = spec.url.removeprefix("http://")
    host, port = host_port.split(":")
    rng = random.Random(spec.seed)
    clock = time.perf_counter  # uvloop's clock() counts whole milliseconds
    # The shards agree on the start through the wall clock, read once here.
    t0 = clock() + (spec.start - time.time())
    window_start, end = t0 + spec.warmup_s, t0 + spec.warmup_s + spec.seconds
    exports: list[tuple[float, int, float, int, int]] = []  # (t from t0, status, ms, points, rejected points)
    polls: list[tuple[float, int, float]] = []
    infers: list[tuple[float, str, int, float]] = []  # (t, "gateway" | "direct", status, ms)
    last_ok = [-1] * len(spec.agents)
    sent = [0] * len(spec.agents)  # exports due and sent (retries not counted)
    policy_changes: list[float] = []  # t of each 200 after an agent's first poll (a new policy document)
    errors: list[str] = []
    cpu: dict[str, float] = {}

    def error(text: str) -> None:
        if len(errors) < 8:
            errors.append(text)

    async def exporter(i: int, agent_id: str, token: str, template: int) -> None:
        link = _Link(host, int(port))
        bodies, points = spec.templates[template], spec.points[template]
        head = "Content-Type: application/x-protobuf\r\nUser-Agent: OTel-OTLP-Exporter-Python\r\n"
        due = t0 + rng.uniform(0, spec.export_interval_s)
        k = 0
        try:
            while due < end and k < len(bodies):
                await asyncio.sleep(max(0.0, due - clock()))
                body = bodies[k].replace(PLACEHOLDER, agent_id.encode())
                payload = _head("POST", "/v1/metrics", host_port, token, head, len(body)) + body
                next_due = due + spec.export_interval_s
                sent[i] += 1
                backoff = RETRY_S
                while True:
                    started = clock()
                    try:
                        status, answer, _ = await link.call(payload)
                    except (OSError, TimeoutError) as exc:
                        status, answer = 0, repr(exc).encode()
                    done = clock()
                    rejected = rejected_points(answer) if status == 200 else 0
                    exports.append((done - t0, status, (done - started) * 1e3, points[k], rejected))
                    if status == 200:
                        last_ok[i] = k
                        break
                    if status not in (0, 502, 503, 504):
                        error(f"export {status}: {answer[:160]!r}")
                        break
                    if clock() + backoff >= min(next_due, end):
                        break  # the next export carries the cumulative values anyway
                    await asyncio.sleep(backoff * rng.uniform(0.8, 1.2))  # the exporter's backoff, with jitter
                    backoff *= 2
                due, k = next_due, k + 1
        finally:
            link.close()

    async def poller(agent_id: str, token: str) -> None:
        link = _Link(host, int(port))
        etag = ""
        due = t0 + rng.uniform(0, spec.poll_interval_s)
        path = f"/api/v1/agents/{agent_id}/policy"
        try:
            while due < end:
                await asyncio.sleep(max(0.0, due - clock()))
                extra = f"If-None-Match: {etag}\r\n" if etag else ""
                started = clock()
                try:
                    status, answer, tag = await link.call(_head("GET", path, host_port, token, extra))
                except (OSError, TimeoutError) as exc:
                    status, answer, tag = 0, repr(exc).encode(), ""
                done = clock()
                polls.append((done - t0, status, (done - started) * 1e3))
                if status == 200:
                    if etag:
                        policy_changes.append(done - t0)
                    etag = tag
                elif status not in (304, 0, 502, 503, 504):
                    error(f"poll {status}: {answer[:160]!r}")
                due += spec.poll_interval_s
        finally:
            link.close()

    async def overflow() -> None:
        """Open loop at `overflow_rps`: each due request through the gateway, then the same one direct."""
        if spec.overflow_rps <= 0 or spec.cloud is None:
            return
        cloud_host, cloud_port = spec.cloud.removeprefix("http://").split(":")
        path = "/v2/models/mlp/versions/2/infer"
        free: dict[str, list[_Link]] = {"gateway": [], "direct": []}
        pending: set[asyncio.Task[None]] = set()

        async def one(agent_token: str) -> None:
            for target in ("gateway", "direct"):
                pool = free[target]
                link = pool.pop() if pool else (_Link(host, int(port)) if target == "gateway"
                                                else _Link(cloud_host, int(cloud_port)))  # fmt: skip
                token = agent_token if target == "gateway" else CLOUD_SECRET
                where = host_port if target == "gateway" else f"{cloud_host}:{cloud_port}"
                payload = _head("POST", path, where, token, "Content-Type: application/json\r\n",
                                len(spec.infer_body)) + spec.infer_body  # fmt: skip
                started = clock()
                try:
                    status, answer, _ = await link.call(payload)
                except (OSError, TimeoutError) as exc:
                    status, answer = 0, repr(exc).encode()
                done = clock()
                infers.append((done - t0, target, status, (done - started) * 1e3))
                if status != 200:
                    error(f"infer via {target} {status}: {answer[:160]!r}")
                pool.append(link)

        due = t0 + 1.0 / spec.overflow_rps * rng.random()
        while due < end:
            await asyncio.sleep(max(0.0, due - clock()))
            task = asyncio.create_task(one(rng.choice(spec.agents)[1]))
            pending.add(task)
            task.add_done_callback(pending.discard)
            due += rng.expovariate(spec.overflow_rps)
        await asyncio.gather(*pending)
        for links in free.values():
            for link in links:
                link.close()

    async def window() -> None:
        await asyncio.sleep(max(0.0, window_start - clock()))
        cpu["start"] = time.process_time()
        await asyncio.sleep(max(0.0, end - clock()))
        cpu["end"] = time.process_time()

    tasks = [exporter(i, a, t, k) for i, (a, t, k) in enumerate(spec.agents)]
    tasks += [poller(a, t) for a, t, _ in spec.agents]
    await asyncio.gather(window(), overflow(), *tasks)
    return {"exports": exports, "polls": polls, "infers": infers, "last_ok": last_ok, "sent": sent,
            "policy_changes": policy_changes, "errors": errors, "reconnects": _Link.reconnects,
            "cpu_s": cpu.get("end", time.process_time()) - cpu.get("start", 0.0)}  # fmt: skip


# ---- the system under test ------------------------------------------------------------------------


@dataclass
class Replica:
    index: int
    port: int
    env: dict[str, str]
    log_path: Path
    proc: Process | None = None
    cpu_before: float = 0.0  # CPU of earlier processes of this replica (one killed) within the window
    peak_rss: int = 0
    restarting: bool = False
    log_offset: int = 0  # where its current process's lines start in the log file

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_offset = len(self.log_path.read_text(errors="replace")) if self.log_path.exists() else 0
        command = [str(VENV_BIN / "spillway"), "controlplane", "serve", "--no-migrate"]
        self.proc = Process.start(command, name=f"control plane {self.index}", log=self.log_path, append=True,
                                  env=self.env, group=True, grace_s=30)  # fmt: skip
        self.proc.wait_ready(f"{self.url}/readyz", timeout_s=90, interval_s=0.2)

    def cpu(self) -> float:
        return self.cpu_before + (cpu_seconds([self.proc.pid]) if self.proc is not None else 0.0)

    def rss(self) -> int:
        return max(self.peak_rss, vm_hwm(self.proc.pid) if self.proc is not None else 0)

    def kill(self) -> None:
        """SIGKILL (its process group); the CPU it spent stays counted."""
        assert self.proc is not None
        spent = cpu_seconds([self.proc.pid])
        self.peak_rss = self.rss()
        self.proc.kill()
        self.proc.wait(10)
        self.cpu_before += spent

    def stop(self) -> None:
        if self.proc is not None:
            self.peak_rss = self.rss()
            self.proc.stop()

    def left_unapplied(self) -> bool:
        """Whether its last process stopped before applying everything it logged (killed after its grace, or its
        applier still busy when it closed: the ingest log replays that at the next start)."""
        if self.proc is None:
            return False
        code = self.proc.returncode
        tail = self.log_path.read_text(errors="replace")[self.log_offset :] if self.log_path.exists() else ""
        return code not in (0, None) or "still queued at shutdown" in tail


@dataclass
class System:
    db: Database
    admin: str
    replicas: list[Replica]
    url: str  # where the agents go: the load balancer, or the one replica
    lb_pid: int | None
    cloud: str | None
    cloud_pid: int | None
    agents: list[tuple[str, str]] = field(default_factory=list)


def enrol(system: System, count: int) -> None:
    """`count` agents through the REST API, a few requests at a time."""

    def one(i: int) -> tuple[str, str]:
        body = {"name": f"fleet-agent-{i:05d}", "labels": LABELS, "device_class": "cpu"}
        created = http_json("POST", f"{system.replicas[0].url}/api/v1/agents", body, bearer(system.admin))
        return created["agent"]["id"], created["token"]

    with ThreadPoolExecutor(max_workers=4) as pool:
        system.agents = list(pool.map(one, range(count)))
    assert all(len(a.encode()) == len(PLACEHOLDER) for a, _ in system.agents), "agent ids changed length"


def start_cloud(work: Path) -> tuple[Process, str]:
    """A Spillway agent in cloud role serving the demo models (one intra-op thread), on a free port."""
    import yaml

    from spillway.demo.models import build_demo_repository

    repo = build_demo_repository(work / "models")
    port = free_port()
    config = {"model_repository": str(repo), "host": "127.0.0.1", "port": port, "grpc_port": None,
              "intra_op_threads": 1, "inter_op_threads": 1, "state_dir": str(work / "state-cloud"),
              "default_versions": {"mlp": 1}, "agent_id": "fleet-cloud", "role": "cloud",
              "token": CLOUD_SECRET}  # fmt: skip
    (work / "cloud.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")}
    command = [sys.executable, "-m", "spillway.cli", "agent", "serve", "--config", str(work / "cloud.yaml"),
               "--log-level", "warning"]  # fmt: skip
    proc = Process.start(command, name="the cloud agent", log=work / "cloud.log", append=False, env=env, group=True)
    return proc, f"http://127.0.0.1:{port}"


def _stop_replicas(replicas: list[Replica]) -> None:
    for replica in reversed(replicas):
        replica.stop()


def _stop_started(future: Future[tuple[Process, str]]) -> None:
    with contextlib.suppress(Exception):
        future.result()[0].stop()


@contextlib.contextmanager
def start_system(options: Options, agents: int, work: Path) -> Iterator[System]:
    log(f"{agents} agents: starting {'the cloud agent, ' if options.cloud else ''}{options.replicas} control "
        f"plane(s) on {options.store}")  # fmt: skip
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(max_workers=1) as starter:
        # The cloud agent (its models built, onnxruntime loaded) starts while the control plane does.
        cloud_start = starter.submit(start_cloud, work) if options.cloud else None
        if cloud_start is not None:
            stack.callback(_stop_started, cloud_start)
        db = stack.enter_context(database(options.store, options.postgres_url, work, prefix="fleet"))
        env = {
            **os.environ,
            "SPILLWAY_DATABASE_URL": db.url,
            "SPILLWAY_HOST": "127.0.0.1",
            "SPILLWAY_LOG_LEVEL": "warning",
            "SPILLWAY_CONTROL_LOOP_INTERVAL_S": f"{options.loop_interval_s:g}",
            "SPILLWAY_INGEST_LOG_DIR": str(work / "ingest-log"),
            **dict(e.split("=", 1) for e in options.cp_env),
        }
        admin = spillway("controlplane", "create-key", "--role", "admin", "--name", "fleet", env=env)  # migrates
        replicas = []
        for i in range(options.replicas):
            port = free_port()
            replicas.append(Replica(i, port, {**env, "SPILLWAY_PORT": str(port)}, work / f"controlplane-{i}.log"))
        stack.callback(_stop_replicas, replicas)
        replicas[0].start()
        cloud = cloud_pid = None
        if cloud_start is not None:
            cloud_proc, cloud = cloud_start.result()
            cloud_pid = cloud_proc.pid
            cloud_proc.wait_ready(
                f"{cloud}/v2/health/ready", headers=bearer(CLOUD_SECRET), timeout_s=120, interval_s=0.2
            )
            backend = {"name": "cloud-1", "url": cloud, "models": ["mlp"], "weight": 1.0, "max_concurrency": 1000,
                       "timeout_ms": 10_000, "binary_tensors": True,
                       "auth_header": f"Bearer {CLOUD_SECRET}"}  # fmt: skip
            http_json("POST", f"{replicas[0].url}/api/v1/backends", backend, bearer(admin))
        for replica in replicas[1:]:  # after the backend: each reads the gateway's configuration at its start
            replica.start()
        url, lb_pid = replicas[0].url, None
        if len(replicas) > 1:
            lb = stack.enter_context(balancer([("127.0.0.1", r.port) for r in replicas], work, options.lb))
            url, lb_pid = lb.url, lb.pid
        system = System(db, admin, replicas, url, lb_pid, cloud, cloud_pid)
        log(f"{agents} agents: enrolling through the REST API")
        t = time.monotonic()
        enrol(system, agents)
        log(f"  enrolled in {time.monotonic() - t:.1f} s")
        yield system


# ---- watching the control planes during the run ---------------------------------------------------

_CYCLE = re.compile(rb"^spillway_control_loop_cycle_seconds_(sum|count) ([0-9.e+-]+)$", re.M)
_LEADER = re.compile(rb"^spillway_control_loop_leader ([0-9.e+-]+)$", re.M)


@dataclass
class Cycle:
    t: float  # seconds from the run's start when the scrape saw it end
    replica: int
    seconds: float
    exact: bool  # one cycle between two scrapes (else the mean of several)


class Monitor(threading.Thread):
    """Every second: each live replica's cycle counters and leadership; at its times, the fleet-wide rule and the
    leader's kill (and its restart); CPU marks at the window's start and end."""

    def __init__(self, system: System, options: Options, start: float) -> None:
        super().__init__(name="fleet-monitor", daemon=True)
        self.system, self.options, self.start_at = system, options, start
        self.window = (start + options.warmup_s, start + options.warmup_s + options.seconds)
        self.cycles: list[Cycle] = []
        self.leader: dict[int, float] = {}  # replica -> last leader gauge
        self.last: dict[int, tuple[float, float]] = {}
        self.marks: dict[str, dict[str, float]] = {}
        self.pg_engine: Any = None
        self.pg_seen: dict[int, float] = {}  # PostgreSQL backend -> its CPU when last seen (a gone one keeps it)
        self.fired_at: float | None = None
        self.killed: dict[str, Any] | None = None
        self.errors: list[str] = []
        self.done = threading.Event()
        self.restarter: threading.Thread | None = None
        self.profiler: subprocess.Popen[bytes] | None = None
        self.scrapes: dict[int, threading.Thread] = {}
        self.profile_path = system.replicas[0].log_path.with_name("profile.raw")

    def since(self) -> float:
        return time.time() - self.start_at

    def scrape_safely(self, replica: Replica) -> None:
        try:
            self.scrape(replica)
        except Exception as exc:
            self.error(f"scrape of replica {replica.index}: {exc!r}")

    def scrape(self, replica: Replica) -> None:
        if replica.proc is None or not replica.proc.running or replica.restarting:
            return
        import urllib.request

        request = urllib.request.Request(f"{replica.url}/metrics", headers=bearer(self.system.admin))
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                text = response.read()
        except OSError as exc:
            self.error(f"scrape of replica {replica.index}: {exc!r}")
            return
        values = {m.group(1): float(m.group(2)) for m in _CYCLE.finditer(text)}
        leader = _LEADER.search(text)
        self.leader[replica.index] = float(leader.group(1)) if leader else 0.0
        if b"sum" not in values:
            return
        now = (values[b"sum"], values[b"count"])
        before = self.last.get(replica.index)
        self.last[replica.index] = now
        if before is None or now[1] < before[1]:  # first read, or a new process
            return
        cycles = int(now[1] - before[1])
        if cycles > 0:
            each = (now[0] - before[0]) / cycles
            self.cycles += [Cycle(self.since(), replica.index, each, cycles == 1) for _ in range(cycles)]

    def sample_postgres(self) -> None:
        from sqlalchemy import create_engine, text

        from controlplane.db import normalise_url

        db = self.system.db
        if self.pg_engine is None:  # one pooled connection, not one a second
            self.pg_engine = create_engine(normalise_url(db.admin_url or db.url), pool_size=1)
        query = text("SELECT pid FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()")
        with self.pg_engine.connect() as conn:
            pids = [int(r[0]) for r in conn.execute(query, {"d": db.name})]
        for pid in pids:
            spent = cpu_seconds([pid])
            if spent:
                self.pg_seen[pid] = spent

    def mark(self, name: str) -> None:
        s = self.system
        cpu = {f"control plane {r.index}": r.cpu() for r in s.replicas}
        if s.lb_pid:
            cpu[self.options.lb] = cpu_seconds([s.lb_pid])
        if s.cloud_pid:
            cpu["cloud agent"] = cpu_seconds([s.cloud_pid])
        if s.db.backend == "postgres":
            self.sample_postgres()
            cpu["postgres"] = sum(self.pg_seen.values())
        cpu["machine"] = machine_busy_seconds()
        cpu["wall"] = time.monotonic()
        self.marks[name] = cpu

    def run(self) -> None:
        o = self.options
        fire = None if o.fire_at is None else self.window[0] + o.fire_at
        kill = None if o.kill_leader_at is None else self.window[0] + o.kill_leader_at
        tick = self.start_at
        while not self.done.is_set():
            now = time.time()
            steps: list[tuple[str, Any]] = []
            if "start" not in self.marks and now >= self.window[0]:
                steps.append(("mark start", lambda: self.mark("start")))
            if "end" not in self.marks and now >= self.window[1]:
                steps.append(("mark end", lambda: self.mark("end")))
            if fire is not None and now >= fire and self.fired_at is None:
                self.fired_at = self.since()
                threading.Thread(target=self.fire, name="fleet-rule", daemon=True).start()
            if kill is not None and now >= kill and self.killed is None:
                steps.append(("kill", self.kill_leader))
            if o.profile_s and self.profiler is None and now >= self.window[0] + 1:
                steps.append(("profile", self.profile))
            for replica in self.system.replicas:  # in threads: a saturated replica answers late, the rest goes on
                running = self.scrapes.get(replica.index)
                if running is None or not running.is_alive():
                    self.scrapes[replica.index] = thread = threading.Thread(
                        target=self.scrape_safely, args=(replica,), name=f"fleet-scrape-{replica.index}", daemon=True
                    )
                    thread.start()
            if self.system.db.backend == "postgres" and "start" in self.marks and "end" not in self.marks:
                steps.append(("PostgreSQL backends", self.sample_postgres))
            for name, step in steps:
                try:
                    step()
                except Exception as exc:  # reported with the results; the monitor goes on
                    self.error(f"{name}: {exc!r}")
            tick = max(tick + 1.0, time.time() - 0.5)
            self.done.wait(max(0.0, tick - time.time()))

    def profile(self) -> None:
        pid = self.system.replicas[0].proc.pid  # type: ignore[union-attr]
        command = common.py_spy_command(pid, self.options.profile_s, self.profile_path)
        self.profiler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def error(self, text: str) -> None:
        if len(self.errors) < 8:
            self.errors.append(text)
        log(f"  monitor: {text}")

    def fire(self) -> None:
        """The fleet-wide rule, through the agents' address (the load balancer with replicas)."""
        try:
            http_json("POST", f"{self.system.url}/api/v1/rules", RULE, bearer(self.system.admin), timeout=120)
            took = self.since() - (self.fired_at or 0.0)
            log(f"  {self.fired_at:.1f} s: the fleet-wide rule is in (answered {took:.1f} s later)")
        except Exception as exc:
            self.error(f"the fleet-wide rule: {exc!r}")

    def kill_leader(self) -> None:
        leaders = [i for i, v in self.leader.items() if v >= 1]
        if not leaders:
            self.killed = {"error": "no replica said it leads"}
            return
        replica = self.system.replicas[leaders[0]]
        replica.kill()
        self.last.pop(replica.index, None)
        self.leader[replica.index] = 0.0
        self.killed = {"replica": replica.index, "t": self.since()}
        log(f"  {self.killed['t']:.1f} s: killed control plane {replica.index} (SIGKILL), the loop's leader")

        def restart() -> None:
            time.sleep(self.options.restart_after_s)
            t = self.since()
            replica.restarting = True
            try:
                replica.start()
            finally:
                replica.restarting = False
            assert self.killed is not None
            self.killed.update(restarted=t, ready=self.since())
            log(f"  {t:.1f} s: control plane {replica.index} restarted, ready after {self.since() - t:.1f} s")

        self.restarter = threading.Thread(target=restart, name="fleet-restart", daemon=True)
        self.restarter.start()

    def stop(self) -> None:
        if "end" not in self.marks:
            self.mark("end")
        self.done.set()
        self.join(10)
        for thread in list(self.scrapes.values()):
            thread.join(10)
        if self.pg_engine is not None:
            self.pg_engine.dispose()
        if self.profiler is not None:
            try:
                self.profiler.wait(self.options.profile_s + 30)
            except subprocess.TimeoutExpired:
                self.profiler.kill()
        if self.restarter is not None:
            self.restarter.join(120)


# ---- one run -----------------------------------------------------------------------------------------


@dataclass
class RunResult:
    store: str
    replicas: int
    lb: str
    agents: int
    seconds: float
    export_interval_s: float
    poll_interval_s: float
    loop_interval_s: float
    shards: int
    series_per_agent: int
    export_bytes: int
    exports_sent: int
    exports_ok: int
    export_statuses: dict[str, int]
    exports_refused: int  # answered 503 (every ingest slot busy), retries included
    points_per_s: float
    export_p50_ms: float | None
    export_p99_ms: float | None
    polls: int
    poll_statuses: dict[str, int]
    poll_p50_ms: float | None
    poll_p99_ms: float | None
    share_304: float | None
    policy_changes: int
    cycles: int
    cycle_median_s: float | None
    cycle_worst_s: float | None
    firing_cycle_s: float | None
    fired_events: int
    overflow_rps: float
    infers: int
    infer_errors: int
    gateway_p50_ms: float | None
    gateway_p99_ms: float | None
    direct_p50_ms: float | None
    direct_p99_ms: float | None
    cpu_cores: dict[str, float]
    rss_mib: dict[str, float]
    kill: dict[str, Any] | None
    consistent: bool
    consistency: str
    reconnects: int
    errors: list[str]
    profile: list[str] = field(default_factory=list)  # the first control plane's top functions (py-spy, self time)

    @property
    def control_plane_cores(self) -> float:
        return sum(v for k, v in self.cpu_cores.items() if k.startswith("control plane"))


def check_rollups(db: Database, agents: list[tuple[str, str]], candidates: list[list[Export]]) -> tuple[bool, str]:
    """Per agent, the rollups hold what one of its exports says happened: its last acknowledged one, or a later one
    it sent whose answer never came (applied, but the connection failed or the client gave up): nothing lost of what
    was acknowledged, nothing counted twice. `candidates[i]`: agent i's exports from its last acknowledged (or an
    empty one if none was) to its last sent."""
    stored = stored_totals(db.url)
    wrong, later = [], 0
    for (agent_id, _), exports in zip(agents, candidates, strict=True):
        requests = stored.get((agent_id, "spillway.requests"), (0.0, 0))[0]
        durations = stored.get((agent_id, "spillway.request.duration"), (0.0, 0))[1]
        match = [k for k, e in enumerate(exports) if abs(requests - e.requests) < 1e-6 and durations == e.durations]
        if not match:
            want = exports[0]
            wrong.append(f"{agent_id}: requests {requests:g} vs {want.requests:g}, "
                         f"durations {durations} vs {want.durations}")  # fmt: skip
        elif match[0] > 0:
            later += 1
    if wrong:
        return False, f"{len(wrong)} of {len(agents)} agents differ: " + "; ".join(wrong[:3])
    words = f"all {len(agents)} agents match their last acknowledged export"
    if later:
        words = (f"all {len(agents)} agents match: {len(agents) - later} their last acknowledged export, {later} a "
                 "later one whose answer was lost (applied, not acknowledged)")  # fmt: skip
    return True, words


def fired_events(db: Database) -> int:
    from sqlalchemy import func, select

    from controlplane.db import Event, make_engine, make_sessionmaker

    engine = make_engine(db.url)
    try:
        with make_sessionmaker(engine)() as session:
            return int(session.execute(select(func.count()).select_from(Event)
                                       .where(Event.kind == "rule.fired")).scalar() or 0)  # fmt: skip
    finally:
        engine.dispose()


def infer_body() -> bytes:
    """One row of `mlp` input as V2 JSON (512 values)."""
    draw = random.Random(7)
    data = [round(draw.uniform(-1, 1), 4) for _ in range(512)]
    request = {"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": data}]}
    return json.dumps(request, separators=(",", ":")).encode()


def _noop(_: int = 0) -> int:
    return os.getpid()


def run_fleet(options: Options, agents: int, work: Path) -> tuple[RunResult, dict[str, Any]]:
    run_dir = work / f"{options.store}-{options.replicas}x-{agents}"
    run_dir.mkdir()
    with start_system(options, agents, run_dir) as system:
        exports_each = math.ceil((options.warmup_s + options.seconds) / options.export_interval_s) + 2
        t = time.monotonic()
        templates = make_templates(min(options.templates, agents), exports_each, options.export_interval_s)
        sizes = [len(e.body) for tpl in templates for e in tpl]
        log(f"  {len(templates)} agent histories x {exports_each} exports made with the SDK in "
            f"{time.monotonic() - t:.1f} s: {max(e.points for tpl in templates for e in tpl)} series, "
            f"{statistics.mean(sizes):,.0f} bytes an export on average")  # fmt: skip
        per_export = statistics.mean((tpl[-1].requests - tpl[0].requests) / (len(tpl) - 1) for tpl in templates)
        fleet_rps = agents * per_export / options.export_interval_s
        overflow_rps = options.overflow_share * fleet_rps if system.cloud else 0.0
        assignment = [(a, tok, i % len(templates)) for i, (a, tok) in enumerate(system.agents)]
        chunks = [list(range(s, agents, options.shards)) for s in range(options.shards)]
        with ProcessPoolExecutor(max_workers=options.shards) as pool:
            list(pool.map(_noop, range(options.shards)))  # the shard processes exist before the clock starts
            start = time.time() + 1.0
            specs = [ShardSpec(s, [assignment[i] for i in chunk], [[e.body for e in tpl] for tpl in templates],
                               [[e.points for e in tpl] for tpl in templates], system.url, system.cloud,
                               infer_body(), overflow_rps / options.shards, start, options.warmup_s, options.seconds,
                               options.export_interval_s, options.poll_interval_s, 1000 + s)
                     for s, chunk in enumerate(chunks)]  # fmt: skip
            monitor = Monitor(system, options, start)
            monitor.start()
            log(f"  the fleet runs: {options.warmup_s:g} s warm-up, {options.seconds:g} s measured; "
                f"{fleet_rps:,.0f} requests/s counted by the exports, {overflow_rps:.1f}/s overflowed")  # fmt: skip
            futures = [pool.submit(run_shard, spec) for spec in specs]
            shards = [f.result() for f in futures]
            monitor.stop()
        rss = {f"control plane {r.index}": r.rss() / (1 << 20) for r in system.replicas}
        for replica in system.replicas:  # SIGTERM: what each logged is applied before it exits
            replica.stop()
        unapplied = [r.index for r in system.replicas if r.left_unapplied()]
        if unapplied:  # as a restart would: every replica again on the same log folder replays its slot, then stops
            log(f"  control plane(s) {unapplied} stopped with logged exports unapplied: restarting all to replay")
            for replica in system.replicas:
                replica.start()
            for replica in system.replicas:
                replica.stop()
        log("  the control planes stopped; checking the rollups")
        none = Export(b"", 0, 0.0, 0)
        candidates: list[list[Export]] = [[] for _ in range(agents)]
        for chunk, shard in zip(chunks, shards, strict=True):
            for i, k, sent in zip(chunk, shard["last_ok"], shard["sent"], strict=True):
                history = templates[assignment[i][2]]
                candidates[i] = ([history[k]] if k >= 0 else [none]) + history[k + 1 : sent]
        consistent, consistency = check_rollups(system.db, system.agents, candidates)
        fired = fired_events(system.db)
        log("  checked")
        result = summarise(options, agents, templates, shards, monitor, overflow_rps, rss, fired,
                           consistent, consistency)  # fmt: skip
    raw = {"shards": [{k: v for k, v in s.items() if k != "exports"} for s in shards],
           "cycles": [asdict(c) for c in monitor.cycles], "monitor_errors": monitor.errors}  # fmt: skip
    return result, raw


def summarise(options: Options, agents: int, templates: list[list[Export]], shards: list[dict[str, Any]],
              monitor: Monitor, overflow_rps: float, rss: dict[str, float], fired: int, consistent: bool,
              consistency: str) -> RunResult:  # fmt: skip
    lo, hi = options.warmup_s, options.warmup_s + options.seconds
    exports = [r for s in shards for r in s["exports"]]
    polls = [r for s in shards for r in s["polls"]]
    infers = [r for s in shards for r in s["infers"]]
    in_window = [r for r in exports if lo <= r[0] < hi]
    ok = [r for r in in_window if r[1] == 200]
    poll_window = [r for r in polls if lo <= r[0] < hi]
    poll_statuses = Counter(str(r[1]) for r in poll_window)
    answered = poll_statuses["200"] + poll_statuses["304"]
    cycles = [c for c in monitor.cycles if lo <= c.t < hi + 1]
    firing = None
    if monitor.fired_at is not None:
        until = monitor.fired_at + 2 * options.loop_interval_s + 2
        after = [c.seconds for c in cycles if monitor.fired_at < c.t <= until]
        firing = max(after, default=None)
    gateway = sorted(r[3] for r in infers if r[1] == "gateway" and r[2] == 200 and lo <= r[0] < hi)
    direct = sorted(r[3] for r in infers if r[1] == "direct" and r[2] == 200 and lo <= r[0] < hi)
    start, end = monitor.marks["start"], monitor.marks["end"]
    wall = end["wall"] - start["wall"]
    cores = {k: (end[k] - start[k]) / wall for k in start if k not in ("wall", "machine") and k in end}
    cores["simulator"] = sum(s["cpu_s"] for s in shards) / options.seconds
    cores["other"] = max(0.0, (end["machine"] - start["machine"]) / wall - sum(cores.values()))
    kill = monitor.killed
    if kill is not None and "t" in kill:
        later = [c for c in monitor.cycles if c.t > kill["t"] and c.replica != kill["replica"]]
        kill["takeover_s"] = (later[0].t - kill["t"]) if later else None
        kill["takeover_replica"] = later[0].replica if later else None
        around = [r for r in exports if kill["t"] - 1 <= r[0] < kill["t"] + 10]
        kill["exports_failed_after"] = sum(1 for r in around if r[1] != 200)
        kill["exports_around"] = len(around)
    tpl_points = max(e.points for tpl in templates for e in tpl)
    return RunResult(
        store=options.store,
        replicas=options.replicas,
        lb=options.lb if options.replicas > 1 else "",
        agents=agents,
        seconds=options.seconds,
        export_interval_s=options.export_interval_s,
        poll_interval_s=options.poll_interval_s,
        loop_interval_s=options.loop_interval_s,
        shards=options.shards,
        series_per_agent=tpl_points,
        export_bytes=int(statistics.mean(len(e.body) for tpl in templates for e in tpl)),
        exports_sent=sum(sum(s["sent"]) for s in shards),
        exports_ok=sum(1 for r in exports if r[1] == 200),
        export_statuses=dict(Counter(str(r[1]) for r in exports)),
        exports_refused=sum(1 for r in exports if r[1] == 503),
        points_per_s=sum(r[3] - r[4] for r in ok) / options.seconds,
        export_p50_ms=percentile((r[2] for r in ok), 50),
        export_p99_ms=percentile((r[2] for r in ok), 99),
        polls=len(poll_window),
        poll_statuses=dict(poll_statuses),
        poll_p50_ms=percentile((r[2] for r in poll_window if r[1] in (200, 304)), 50),
        poll_p99_ms=percentile((r[2] for r in poll_window if r[1] in (200, 304)), 99),
        share_304=poll_statuses["304"] / answered if answered else None,
        policy_changes=sum(len(s["policy_changes"]) for s in shards),
        cycles=len(cycles),
        cycle_median_s=median((c.seconds for c in cycles), empty=math.nan) if cycles else None,
        cycle_worst_s=max((c.seconds for c in cycles), default=None),
        firing_cycle_s=firing,
        fired_events=fired,
        overflow_rps=overflow_rps,
        infers=sum(1 for r in infers if lo <= r[0] < hi),
        infer_errors=sum(1 for r in infers if r[2] != 200),
        gateway_p50_ms=percentile(gateway, 50),
        gateway_p99_ms=percentile(gateway, 99),
        direct_p50_ms=percentile(direct, 50),
        direct_p99_ms=percentile(direct, 99),
        cpu_cores=cores,
        rss_mib=rss,
        kill=kill,
        consistent=consistent,
        consistency=consistency,
        reconnects=sum(s["reconnects"] for s in shards),
        errors=[e for s in shards for e in s["errors"]][:8] + monitor.errors,
        profile=_profile(monitor),
    )


def _profile(monitor: Monitor) -> list[str]:
    """Per busy thread of control plane 0: its share of a core, and its top functions by inclusive time."""
    if not monitor.options.profile_s or not monitor.profile_path.exists():
        return []
    summary = common.summarise_profile(monitor.profile_path, monitor.options.profile_s)
    out = []
    for thread, data in list(summary["threads"].items())[:4]:
        cores = data["samples"] / summary["expected_per_thread"]
        top = ", ".join(f"{f} {n / data['samples'] * 100:.0f} %" for f, n in data["inclusive"][:8])
        out.append(f"{thread}: {cores:.2f} cores; {top}")
    return out


# ---- the report ----------------------------------------------------------------------------------


def _f(value: float | None, digits: int = 1, scale: float = 1.0) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * scale:.{digits}f}"


def row(result: RunResult, command: str, date: str, commit: str) -> dict[str, Any]:
    """What the docs keep of a run (the table's cells and the lines under it)."""
    r = result
    replica_cores = [v for k, v in sorted(r.cpu_cores.items()) if k.startswith("control plane")]
    replica_rss = [v for _, v in sorted(r.rss_mib.items())]
    refused = r.exports_refused
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r.export_statuses.items()))
    polls = ", ".join(f"{k}: {v}" for k, v in sorted(r.poll_statuses.items()))
    added = None if r.gateway_p50_ms is None or r.direct_p50_ms is None else r.gateway_p50_ms - r.direct_p50_ms
    kill = r.kill
    return {
        "key": f"{r.store}/{r.replicas}/{r.agents}/{'kill' if kill else 'steady'}",
        "store": r.store + (f", {r.replicas} replicas ({r.lb})" if r.replicas > 1 else ""),
        "agents": r.agents,
        "kill": bool(kill),
        "cells": [
            f"{r.store}{' + leader kill' if kill else ''}",
            str(r.replicas),
            f"{r.agents:,}",
            f"{r.points_per_s:,.0f}",
            f"{_f(r.export_p50_ms)} / {_f(r.export_p99_ms)}",
            f"{refused}",
            f"{_f(r.poll_p99_ms)}",
            _f(r.share_304, 1, 100) + " %",
            f"{_f(r.cycle_median_s, 2)} / {_f(r.cycle_worst_s, 2)}",
            _f(r.firing_cycle_s, 2),
            f"{_f(added, 2)}",
            " / ".join(f"{c:.2f}" for c in replica_cores),
            " / ".join(f"{m:.0f}" for m in replica_rss),
            f"{r.cpu_cores.get('postgres', 0.0):.2f}" if r.store == "postgres" else "-",
            f"{r.cpu_cores.get('simulator', 0.0):.2f}",
            f"{1000 * r.control_plane_cores / r.agents:.2f}",
            "ok" if r.consistent else "**WRONG**",
        ],
        "notes": (
            f"{r.store}, {r.replicas} replica(s), {r.agents:,} agents, {r.seconds:g} s measured "
            f"({date}, {commit}; `{command}`): {r.series_per_agent} series an agent, {r.export_bytes:,} bytes an "
            f"export; exports sent {r.exports_sent:,}, answers {statuses}; polls {polls} "
            f"({r.policy_changes:,} new policy documents fetched); {r.cycles} control-loop cycles, "
            f"{r.fired_events:,} `rule.fired` events; overflow {r.overflow_rps:.1f}/s: gateway p50/p99 "
            f"{_f(r.gateway_p50_ms, 2)} / {_f(r.gateway_p99_ms, 2)} ms, the cloud agent directly "
            f"{_f(r.direct_p50_ms, 2)} / {_f(r.direct_p99_ms, 2)} ms, {r.infer_errors} failed; CPU (cores) "
            + ", ".join(f"{k} {v:.2f}" for k, v in r.cpu_cores.items())
            + f"; {r.reconnects:,} reconnections (idle keep-alive closed by the server); rollups: {r.consistency}"
            + (f"; leader kill: {_kill_words(kill)}" if kill else "")
            + (f"; first errors: {'; '.join(r.errors[:3])}" if r.errors else "")
            + (
                f"; control plane 0's profile (py-spy; per thread, inclusive): {' | '.join(r.profile)}"
                if r.profile
                else ""
            )
        ),
    }


def _kill_words(kill: dict[str, Any]) -> str:
    if "t" not in kill:
        return str(kill.get("error", "not done"))
    takeover = kill.get("takeover_s")
    words = (f"replica {kill['replica']} killed at {kill['t']:.1f} s; "
             + (f"replica {kill['takeover_replica']} ran its first cycle {takeover:.1f} s later"
                if takeover is not None else "no other replica ran a cycle afterwards")
             + f"; {kill.get('exports_failed_after', 0)} of {kill.get('exports_around', 0)} exports in the "
             "following 10 s answered other than 200 (retried)")  # fmt: skip
    if "restarted" in kill:
        words += f"; restarted at {kill['restarted']:.1f} s, ready {kill['ready'] - kill['restarted']:.1f} s later"
    return words


HEADER = (
    "| store | replicas | agents | ingest points/s | export p50 / p99 (ms) | exports refused (503) | poll p99 (ms) "
    "| 304 share | loop cycle median / worst (s) | firing cycle (s) | gateway added p50 (ms) "
    "| control plane CPU per replica (cores) | control plane peak RSS per replica (MiB) | PostgreSQL CPU (cores) "
    "| simulator CPU (cores) | control plane CPU per 1,000 agents (cores) | rollups check |"
)


def render(rows: list[dict[str, Any]], reading: str, info: dict[str, str]) -> str:
    rows = sorted(rows, key=lambda r: (r["store"], r["kill"], r["agents"]))
    out = [BEGIN, "## A fleet: simulated agents against real control planes (`bench/fleet.py`)", ""]
    add = out.append
    add(f"- Machine: {common.machine_words(info)}; every process on its 2 cores (the simulator, the control "
        "planes, PostgreSQL, the load balancer, the cloud agent); other helpers' work ran at the same time, so "
        "these figures are noisy dev measurements")  # fmt: skip
    add("- Each agent: its own token; an OTLP export every export interval (the real SDK's encoding: `mlp` through "
        "`ModelStats`, a generative model's `gen_ai.server.time_to_first_token`, `time_per_output_token`, "
        "`request.duration` and `gen_ai.client.token.usage` histograms, step tokens, KV-block and stream gauges; "
        "cumulative, each export adds traffic), a policy poll with `If-None-Match` every poll interval, random "
        "phases; an export answered 502/503/504 is retried after 1, 2, 4 ... s (jittered) until the next is "
        "due")  # fmt: skip
    add(
        "- Overflow: a share of the requests the exports count, through the gateway with a random agent's token to "
        "a Spillway agent in cloud role (demo `mlp` version 2), each followed by the same request to that agent "
        'directly: "gateway added" is the difference of the medians (through the load balancer with replicas)'
    )
    add(
        "- Fleet-wide firing: half-way through the measured window a rule whose condition every agent meets "
        '(`queue_depth > 0` on `mlp`, switch to version 2) is created; "firing cycle" is the longest cycle in '
        "the two loop intervals after it (an event and a new policy for every agent). Cycle times come from each "
        "replica's `/metrics` (`spillway_control_loop_cycle_seconds` sum and count, read every second)"
    )
    add("- CPU over the measured window from /proc (a killed replica's and its restart's together); peak RSS is "
        "VmHWM; \"per 1,000 agents\" is the control planes' CPU summed, per 1,000 agents; the rollups check "
        "compares, per agent after every process stopped, the stored `spillway.requests` sum and "
        "`spillway.request.duration` count with its last acknowledged export")  # fmt: skip
    add(
        "- Targets (issue 18): 1,000 agents on SQLite with export and poll every 5 s: no export refused for load, "
        "cycle < 1 s median and < 2 s worst including a fleet-wide firing, poll p99 < 50 ms"
    )
    add("")
    add(HEADER)
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        add("| " + " | ".join(r["cells"]) + " |")
    add("")
    for r in rows:
        add(f"- {r['notes']}")
    add("")
    if reading.strip():
        add("### Reading")
        add("")
        add(reading.strip())
        add("")
    data = json.dumps({"rows": rows, "reading": reading}, separators=(",", ":")).replace("--", "\\u002d\\u002d")
    add(f"<!-- fleet-data: {data} -->")
    add(END)
    return "\n".join(out)


def stored(path: Path = DOCS) -> tuple[list[dict[str, Any]], str]:
    """The rows and the reading that the docs' section holds (in its data comment)."""
    text = path.read_text() if path.exists() else ""
    if BEGIN not in text or END not in text:
        return [], ""
    section = text.split(BEGIN, 1)[1].split(END, 1)[0]
    found = DATA.search(section)
    if not found:
        return [], ""
    data = json.loads(found.group(1))
    return list(data["rows"]), str(data.get("reading", ""))


def main(argv: list[str] | None = None) -> int:
    options = parse_args(sys.argv[1:] if argv is None else argv)
    started = dt.datetime.now(dt.timezone.utc)
    info = common.machine()
    info["loadavg_start"] = loadavg()
    work = Path(tempfile.mkdtemp(prefix="spillway-bench-fleet-"))
    argv_words = ["$SPILLWAY_TEST_POSTGRES_URL" if a == options.postgres_url else a for a in options.argv]
    command = " ".join([".venv/bin/python", "bench/fleet.py", *(shlex.quote(a) for a in argv_words)])
    commit = f"commit {common.revision('controlplane')}"
    log(f"work folder {work}")
    results, raw = [], []
    for agents in () if options.render_only else options.agents:
        result, details = run_fleet(options, agents, work)
        results.append(result)
        raw.append({"result": asdict(result), **details})
        log(f"{agents} agents: {result.points_per_s:,.0f} points/s, export p99 {_f(result.export_p99_ms)} ms, "
            f"refused {result.exports_refused}, poll p99 {_f(result.poll_p99_ms)} ms, cycle median/worst "
            f"{_f(result.cycle_median_s, 2)}/{_f(result.cycle_worst_s, 2)} s, control planes "
            f"{result.control_plane_cores:.2f} cores, simulator {result.cpu_cores['simulator']:.2f}; "
            f"{result.consistency}")  # fmt: skip
        if result.cpu_cores["simulator"] > 0.8 * options.shards:
            log("  the simulator is near a core per shard: its own latency is in these figures; use more --shards")
    (work / "results.json").write_text(json.dumps({"options": asdict(options), "runs": raw}, indent=1, default=str))
    date = f"{started:%Y-%m-%d %H:%M} UTC"
    new = [row(r, command, date, commit) for r in results]
    kept, reading = stored() if options.write or options.render_only else ([], "")
    if options.reading is not None:
        reading = options.reading.read_text()
    rows = {r["key"]: r for r in kept}
    rows.update({r["key"]: r for r in new})
    markdown = render(list(rows.values()), reading, info)
    print(markdown)
    if options.write:
        common.write_docs(markdown, BEGIN, END)
        log(f"wrote {DOCS}")
    log(f"raw results in {work / 'results.json'}")
    return 0 if all(r.consistent for r in results) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt(f"signal {signum}")))
    sys.exit(main())
