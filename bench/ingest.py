"""The control plane's telemetry path under load: OTLP/HTTP metrics exports from simulated agents, on SQLite
and on PostgreSQL, with the control plane on one core.

For each backend, one invocation:

  1. a fresh database (a SQLite file, or a throwaway PostgreSQL database made on `--postgres-url`'s server and
     dropped afterwards), migrated, with an admin key (`spillway controlplane create-key`);
  2. the control plane as a real server process, `taskset -c <server core> spillway controlplane serve`;
     this script (the load generator) runs on the other cores, and so do the PostgreSQL backends that serve
     the benchmark's database (pinned there once the server's connections are open);
  3. `--agents` agents enrolled through the REST API (`POST /api/v1/agents`), each sending with its own token;
  4. every agent's exports made beforehand (not timed) by the real OpenTelemetry SDK: the agent's own
     `AgentTelemetry` (its instruments, views and explicit latency buckets) fed by `ModelStats` the way the
     serving core feeds it, read by an `InMemoryMetricReader` (cumulative temporality) and encoded with the
     OTLP exporter's `encode_metrics`; 30 series per agent: requests by priority and outcome, request, queue
     and compute duration histograms, batch size, queue depth per priority, host memory; each export adds
     traffic, so an agent's successive exports grow like a real agent's;
  5. closed loop: each agent sends its exports in order, the next as soon as the previous one is answered
     (one keep-alive HTTP/1.1 connection per agent, a plain asyncio protocol: a few tens of microseconds of
     client CPU per export); a 503 (every ingest slot busy) is retried after 10 ms and counted;
  6. `--warmup` seconds unmeasured, then `--seconds` measured: data points accepted (sent minus the
     `partial_success.rejected_data_points` of each answer) per second and overall, latency per export, CPU of
     the server, the client, the PostgreSQL backends and the rest of the machine;
  7. a check that nothing was lost or counted twice: per agent, the rollups' sum of `spillway.requests` and
     the count of `spillway.request.duration` equal the cumulative values of the last export it sent;
  8. the same closed loop with empty exports (no data points): what authentication and routing alone allow,
     the ceiling any receiver optimisation works under.

Results go to stdout and, with `--write`, between markers in `docs/benchmarks.md` (text outside is kept).

    .venv/bin/python bench/ingest.py --postgres-url "$(bash .ci/postgres.sh)" --write
    .venv/bin/python bench/ingest.py --backends sqlite --seconds 8   # a quick look, not a result
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.common import DOCS, VENV_BIN, free_port, log, median, percentile  # noqa: E402
from bench.procstat import cpu_seconds, loadavg, machine_busy_seconds, vm_hwm  # noqa: E402
from spillway.contract import names  # noqa: E402
from spillway.demo.harness import Process  # noqa: E402

BEGIN = "<!-- bench/ingest.py: begin (generated; edit outside these markers) -->"
END = "<!-- bench/ingest.py: end -->"
PRIORITIES = (1, 2, 3)
RETRY_503_S = 0.01


@dataclass(frozen=True)
class Settings:
    agents: int
    seconds: float
    warmup_s: float
    empty_seconds: float
    backends: tuple[str, ...]
    postgres_url: str | None
    write: bool
    server_core: int
    client_cores: frozenset[int]
    cores: frozenset[int]  # every core this script may use (its affinity at the start)
    max_exports_per_s: float
    max_concurrent: int
    baseline: str | None
    rounds: int
    acks: tuple[str, ...]
    workers: tuple[int, ...]
    profile_seconds: int
    drain_s: float
    argv: tuple[str, ...]

    def server_cores(self, workers: int) -> list[int]:
        """The server's cores: `--server-core` and, for more workers, the next ones (wrapping round)."""
        cores = sorted(self.cores)
        first = cores.index(self.server_core)
        return sorted({cores[(first + i) % len(cores)] for i in range(workers)})

    def client_cores_for(self, workers: int) -> frozenset[int]:
        """The client's cores: those the server leaves, or every core when it takes them all."""
        rest = self.cores - set(self.server_cores(workers))
        return frozenset(rest or self.cores)


def parse_args(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=8, help="simulated agents, one export in flight each")
    parser.add_argument("--seconds", type=float, default=25.0, help="measured seconds per backend")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before that")
    parser.add_argument(
        "--empty-seconds", type=float, default=8.0, help="seconds of empty exports (the ceiling); 0 to skip"
    )
    parser.add_argument("--backends", default="sqlite,postgres", help="comma-separated: sqlite, postgres")
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("SPILLWAY_TEST_POSTGRES_URL"),
        help="a PostgreSQL server the script may create and drop a database on (default: $SPILLWAY_TEST_POSTGRES_URL)",
    )
    parser.add_argument("--write", action="store_true", help=f"write the results into {DOCS.relative_to(ROOT)}")
    parser.add_argument("--server-core", type=int, default=0, help="the one core the control plane runs on")
    parser.add_argument(
        "--max-exports-per-s",
        type=float,
        default=600.0,
        help="exports made beforehand per agent: this rate times the run's length, spread over the agents",
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=0,
        help="SPILLWAY_INGEST_MAX_CONCURRENT for the server (default: 8, the server's default, or --agents if more)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also measure the control plane of this git revision (e.g. the commit before a receiver change), "
        "side by side with the working tree's, alternating",
    )
    parser.add_argument("--rounds", type=int, default=1, help="measurements per control plane and backend")
    parser.add_argument(
        "--acks",
        default="logged,applied",
        help="SPILLWAY_INGEST_ACK values to measure side by side: logged (answered once in the ingest log), "
        "applied (answered once in the rollups)",
    )
    parser.add_argument(
        "--workers",
        default="1,2",
        help="PostgreSQL: `serve --workers N` values, comma-separated (N workers on N cores); SQLite always runs one",
    )
    parser.add_argument(
        "--profile-seconds",
        type=int,
        default=0,
        help="py-spy the server (its first worker) for this long in the middle of each SQLite window; 0: no profile",
    )
    parser.add_argument(
        "--drain-s", type=float, default=60.0, help="after the window, how long the rollups may take to catch up"
    )
    args = parser.parse_args(argv)
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = set(backends) - {"sqlite", "postgres"}
    if unknown:
        parser.error(f"unknown backend(s): {', '.join(sorted(unknown))}")
    if "postgres" in backends and not args.postgres_url:
        parser.error("postgres needs --postgres-url (or SPILLWAY_TEST_POSTGRES_URL); e.g. $(bash .ci/postgres.sh)")
    cores = set(os.sched_getaffinity(0))
    if args.server_core not in cores or len(cores) < 2:
        parser.error(f"needs the server core {args.server_core} and at least one other among {sorted(cores)}")
    acks = tuple(a.strip() for a in args.acks.split(",") if a.strip())
    if not acks or set(acks) - {"logged", "applied"}:
        parser.error(f"--acks takes logged and/or applied, not {args.acks!r}")
    try:
        workers = tuple(int(w) for w in args.workers.split(",") if w.strip())
    except ValueError:
        parser.error(f"--workers takes numbers, not {args.workers!r}")
    if not workers or min(workers) < 1 or max(workers) > len(cores):
        parser.error(f"--workers: each between 1 and the {len(cores)} cores")
    return Settings(
        agents=args.agents,
        seconds=args.seconds,
        warmup_s=args.warmup,
        empty_seconds=args.empty_seconds,
        backends=backends,
        postgres_url=args.postgres_url,
        write=args.write,
        server_core=args.server_core,
        client_cores=frozenset(cores - {args.server_core}),
        cores=frozenset(cores),
        max_exports_per_s=args.max_exports_per_s,
        max_concurrent=args.max_concurrent or max(8, args.agents),
        baseline=args.baseline,
        rounds=args.rounds,
        acks=acks,
        workers=workers,
        profile_seconds=args.profile_seconds,
        drain_s=args.drain_s,
        argv=tuple(argv),
    )


# ---- processes and CPU ----------------------------------------------------------------------------


def spillway(*args: str, env: dict[str, str]) -> str:
    out = subprocess.run([str(VENV_BIN / "spillway"), *args], env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"spillway {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout.strip()


# ---- a control plane to measure -------------------------------------------------------------------


@dataclass
class Database:
    backend: str
    url: str
    admin_url: str | None = None  # PostgreSQL: the server URL the throwaway database was made on
    name: str | None = None

    def backend_pids(self) -> list[int]:
        """PostgreSQL: the backends connected to this database (none for SQLite)."""
        if self.backend != "postgres":
            return []
        from sqlalchemy import create_engine, text

        from controlplane.db import normalise_url

        engine = create_engine(normalise_url(self.admin_url or self.url))
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    text("SELECT pid FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()"),
                    {"d": self.name},
                )
                return [int(r[0]) for r in rows]
        finally:
            engine.dispose()


@contextlib.contextmanager
def database(backend: str, postgres_url: str | None, work: Path, prefix: str = "bench") -> Iterator[Database]:
    """A throwaway database for one run: a SQLite file in `work`, or a PostgreSQL database made on `postgres_url`'s
    server and dropped afterwards (named `spillway_<prefix>_...`)."""
    if backend == "sqlite":
        name = f"spillway-{prefix}-{uuid.uuid4().hex[:10]}"
        yield Database("sqlite", f"sqlite:///{work / name}.db", name=name)
        return
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from controlplane.db import normalise_url

    assert postgres_url is not None
    admin_url = normalise_url(postgres_url)
    name = f"spillway_{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        url = make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
        yield Database("postgres", url, admin_url, name)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@dataclass(frozen=True)
class Tree:
    """The control plane's source: the working tree, or a git revision unpacked into a folder."""

    label: str
    path: Path | None = None  # None: the installed (editable) working tree

    @staticmethod
    def unpack(rev: str, work: Path) -> Tree:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
        path = work / f"tree-{commit}"
        path.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(path)], input=archive.stdout, check=True)
        return Tree(f"commit {commit}", path)


WORKING_TREE = Tree("working tree")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (the workers of `serve --workers N`), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                parents.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += parents.get(current, [])
    return found


@dataclass
class ControlPlane:
    db: Database
    tree: Tree
    url: str
    admin_key: str
    proc: Process
    log_path: Path
    env: dict[str, str]
    ack: str
    workers: int
    agents: list[tuple[str, str]] = field(default_factory=list)  # (agent id, token)

    def pids(self) -> list[int]:
        """The serving processes: the one server, or the workers (and their idle supervisor)."""
        return descendants(self.proc.pid)

    def cpu(self) -> float:
        return cpu_seconds(self.pids())

    def peak_rss(self) -> int:
        """The largest peak RSS of one serving process."""
        return max((vm_hwm(pid) for pid in self.pids()), default=0)

    def enrol(self, count: int) -> None:
        import httpx

        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.admin_key}"}) as client:
            for i in range(count):
                body = {"name": f"bench-agent-{i:04d}", "labels": {"tier": "edge", "site": "bench"},
                        "device_class": "cpu"}  # fmt: skip
                r = client.post("/api/v1/agents", json=body)
                r.raise_for_status()
                created = r.json()
                self.agents.append((created["agent"]["id"], created["token"]))


@contextlib.contextmanager
def control_plane(db: Database, tree: Tree, settings: Settings, work: Path, ack: str = "logged",
                  workers: int = 1) -> Iterator[ControlPlane]:  # fmt: skip
    """Migrate, make an admin key, and serve (`workers` processes, each core of `server_cores` shared by them);
    stopped (SIGTERM to its own process group) on exit."""
    port = free_port()
    env = {
        **os.environ,
        **({"PYTHONPATH": str(tree.path)} if tree.path else {}),  # ahead of the editable install's path
        "SPILLWAY_DATABASE_URL": db.url,
        "SPILLWAY_HOST": "127.0.0.1",
        "SPILLWAY_PORT": str(port),
        "SPILLWAY_LOG_LEVEL": "warning",
        "SPILLWAY_INGEST_MAX_CONCURRENT": str(settings.max_concurrent),
        "SPILLWAY_INGEST_ACK": ack,
        "SPILLWAY_INGEST_LOG_DIR": str(work / f"ingest-log-{db.name}"),
    }
    spillway("controlplane", "migrate", env=env)
    admin_key = spillway("controlplane", "create-key", "--role", "admin", "--name", "bench", env=env)
    log_path = work / f"controlplane-{db.name}.log"
    cores = ",".join(map(str, settings.server_cores(workers)))
    command = ["taskset", "-c", cores, str(VENV_BIN / "spillway"), "controlplane", "serve", "--no-migrate",
               *(["--workers", str(workers)] if workers > 1 else [])]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    # Its own process group: stopped as a whole, and only what this script started.
    with Process.start(command, name="the control plane", log=log_path, append=False, env=env, group=True,
                       grace_s=20) as proc:  # fmt: skip
        proc.wait_ready(f"{url}/readyz", timeout_s=60, interval_s=0.2)
        plane = ControlPlane(db, tree, url, admin_key, proc, log_path, env, ack, workers)
        deadline = time.monotonic() + 60
        while listening(port) < workers:  # every worker's socket, or the agents' connections miss the late ones
            if time.monotonic() > deadline:
                raise RuntimeError(f"{workers} workers did not all listen on {port}; see {log_path}")
            time.sleep(0.2)
        yield plane


def listening(port: int) -> int:
    """Listening TCP sockets on `port` (one per worker with SO_REUSEPORT), from /proc/net/tcp."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":
            count += 1
    return count


# ---- what the agents send: the real SDK's exports -------------------------------------------------


@dataclass
class Export:
    body: bytes
    points: int  # data points in it
    requests: float  # cumulative sum over the spillway.requests series
    durations: int  # cumulative count over the spillway.request.duration series


def _all_cores() -> None:
    os.sched_setaffinity(0, range(os.cpu_count() or 1))  # made before the load starts: use every core


def make_exports(agent_id: str, seed: int, count: int) -> list[Export]:
    """`count` successive exports of one simulated agent, as its periodic reader would send them."""
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from edge_agent.scheduling.stats import ModelStats
    from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
    from edge_agent.telemetry.probes import host_memory

    reader = InMemoryMetricReader()  # cumulative temporality for every instrument kind, like the OTLP exporter's
    settings = TelemetrySettings(agent_id=agent_id, device_class="cpu", labels={"tier": "edge", "site": "bench"})
    telemetry = AgentTelemetry(settings, readers=[reader], probes=False)  # CPU utilisation would vary the count

    def memory(_options: CallbackOptions) -> list[Observation]:
        return list(host_memory())

    telemetry.provider.get_meter("spillway.edge_agent.host").create_observable_gauge(
        "system.memory.usage", callbacks=[memory], unit="By", description="host memory by state"
    )
    depths = dict.fromkeys(PRIORITIES, 0)
    telemetry.watch_queue(
        lambda: [
            ({names.ATTR_MODEL: "mlp", names.ATTR_VERSION: "1", names.ATTR_PRIORITY: p}, depths[p]) for p in PRIORITIES
        ]
    )
    stats = ModelStats(listener=telemetry.recorder("mlp", 1))
    rng = random.Random(seed)
    exports = []
    for i in range(count):
        first = i == 0  # every series appears in the first export
        for p in PRIORITIES:
            for _ in range(rng.randint(1, 3)):
                queue_s, compute_s = rng.expovariate(250.0), rng.uniform(0.002, 0.02)
                stats.request(p, "local", queue_s, compute_s, queue_s + compute_s + 0.0004)
            if first or rng.random() < 0.3:  # a deadline that passed in the queue: rejected, with durations
                waited = rng.uniform(0.05, 0.5)
                stats.request(p, "rejected", waited, 0.0, waited)
            if first or rng.random() < 0.1:
                stats.outcome(p, "error")
            depths[p] = rng.randint(0, 40)
        stats.batch(rng.randint(1, 32), 0.01, True)
        exports.append(collect_export(reader))
    telemetry.shutdown()
    return exports


def collect_export(reader: Any) -> Export:
    """What an SDK reader holds now, encoded as the OTLP exporter does, with the points, requests and durations it
    carries (the totals the rollups must end with)."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    data = reader.get_metrics_data()
    assert data is not None
    points, requests, durations = 0, 0.0, 0
    for resource_metrics in data.resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                data_points: list[Any] = list(metric.data.data_points)
                points += len(data_points)
                if metric.name == "spillway.requests":
                    requests += sum(dp.value for dp in data_points)
                elif metric.name == "spillway.request.duration":
                    durations += sum(dp.count for dp in data_points)
    return Export(encode_metrics(data).SerializeToString(), points, requests, durations)


def make_all_exports(agents: list[tuple[str, str]], per_agent: int, workers: int) -> list[list[Export]]:
    with ProcessPoolExecutor(max_workers=workers, initializer=_all_cores) as pool:
        futures = [pool.submit(make_exports, agent_id, i, per_agent) for i, (agent_id, _) in enumerate(agents)]
        return [f.result() for f in futures]


# ---- the load generator ---------------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time; answers (status, body)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = bytes(self.buffer[:end]).lower()
        marker = head.find(b"\r\ncontent-length:")
        if marker < 0:
            raise RuntimeError("the control plane answered without a Content-Length")
        stop = head.find(b"\r\n", marker + 2)
        length = int(head[marker + 17 : stop if stop >= 0 else len(head)])
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        waiter, self.waiter = self.waiter, None
        if not waiter.done():
            waiter.set_result((int(head[9:12]), body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))

    def request(self, payload: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        return self.waiter


def request_bytes(port: int, token: str, body: bytes, user_agent: str) -> bytes:
    """The request the SDK's OTLP/HTTP exporter sends (uncompressed protobuf, the agent's bearer token)."""
    head = (
        f"POST /v1/metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/x-protobuf\r\n"
        f"User-Agent: {user_agent}\r\nAuthorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class LoadResult:
    """One closed-loop run: what was measured in the window, and where each agent got to."""

    window_s: float
    exports: int  # answered 200 in the window
    points_sent: int
    points_rejected: int
    latencies_ms: list[float]
    per_second_points: list[int]  # accepted data points answered in each whole second of the window
    statuses: dict[str, int]  # every answer in the window, by status
    retried_503: int
    ran_out: int  # agents that sent every export made for them before the end
    last_acknowledged: list[int]  # per agent: index of its last export answered 200 (-1: none)
    server_cpu_cores: float
    client_cpu_cores: float
    postgres_cpu_cores: float
    other_cpu_cores: float
    errors: list[str] = field(default_factory=list)


async def _closed_loop(
    plane: ControlPlane,
    exports: list[list[Export]],
    warmup_s: float,
    seconds: float,
    on_window_start: Callable[[], None],
) -> tuple[float, float, list[dict[str, Any]], list[int], list[str]]:
    loop = asyncio.get_running_loop()
    port = int(plane.url.rsplit(":", 1)[1])
    clock = time.perf_counter
    start = clock()
    window_start, window_end = start + warmup_s, start + warmup_s + seconds
    records: list[dict[str, Any]] = []  # one per answer in the window
    last_ok = [-1] * len(exports)
    errors: list[str] = []
    user_agent = f"OTel-OTLP-Exporter-Python/{importlib.metadata.version('opentelemetry-exporter-otlp-proto-http')}"

    async def agent(index: int, token: str) -> None:
        _, conn = await loop.create_connection(_Connection, "127.0.0.1", port)
        try:
            for k, export in enumerate(exports[index]):
                payload = request_bytes(port, token, export.body, user_agent)
                while True:
                    sent = clock()
                    if sent >= window_end:
                        return
                    status, body = await conn.request(payload)
                    done = clock()
                    if status == 503:
                        if window_start <= done < window_end:
                            records.append({"status": 503, "t": done})
                        await asyncio.sleep(RETRY_503_S)
                        continue
                    break
                if status == 200:
                    last_ok[index] = k
                if window_start <= done < window_end:
                    record = {"status": status, "t": done, "ms": (done - sent) * 1e3, "points": export.points}
                    if status == 200:
                        record["rejected"] = rejected_points(body)
                    elif len(errors) < 5:
                        errors.append(f"{status} {body[:200]!r}")
                    records.append(record)
            if clock() < window_end:
                records.append({"ran_out": index})
        finally:
            assert conn.transport is not None
            conn.transport.close()

    async def window_marker() -> None:
        await asyncio.sleep(max(0.0, window_start - clock()))
        on_window_start()

    marker = asyncio.create_task(window_marker())
    await asyncio.gather(*(agent(i, token) for i, (_, token) in enumerate(plane.agents)))
    await marker
    return window_start, window_end, records, last_ok, errors


def rejected_points(body: bytes) -> int:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

    reply = ExportMetricsServiceResponse()
    reply.ParseFromString(body)
    return int(reply.partial_success.rejected_data_points)


def run_load(plane: ControlPlane, exports: list[list[Export]], warmup_s: float, seconds: float) -> LoadResult:
    """The closed loop, with CPU of everyone involved measured over the window."""
    marks: dict[str, float] = {}
    postgres_pids: list[int] = []

    def at_window_start() -> None:
        nonlocal postgres_pids
        postgres_pids = plane.db.backend_pids()
        for pid in postgres_pids:  # the server's core stays the server's
            with contextlib.suppress(OSError):
                os.sched_setaffinity(pid, os.sched_getaffinity(0))
        marks.update(server=plane.cpu(), client=time.process_time(), pg=cpu_seconds(postgres_pids),
                     busy=machine_busy_seconds(), wall=time.perf_counter())  # fmt: skip

    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    window_start, window_end, records, last_ok, errors = runner(
        _closed_loop(plane, exports, warmup_s, seconds, at_window_start)
    )
    wall = time.perf_counter() - marks["wall"]
    server = (plane.cpu() - marks["server"]) / wall
    client = (time.process_time() - marks["client"]) / wall
    pg = (cpu_seconds(postgres_pids) - marks["pg"]) / wall
    other = max(0.0, (machine_busy_seconds() - marks["busy"]) / wall - server - client - pg)
    answered = [r for r in records if "status" in r]
    ok = [r for r in answered if r["status"] == 200]
    per_second = [0] * int(seconds)
    for r in ok:
        slot = int(r["t"] - window_start)
        if slot < len(per_second):
            per_second[slot] += r["points"] - r["rejected"]
    return LoadResult(
        window_s=window_end - window_start,
        exports=len(ok),
        points_sent=sum(r["points"] for r in ok),
        points_rejected=sum(r["rejected"] for r in ok),
        latencies_ms=sorted(r["ms"] for r in ok),
        per_second_points=per_second,
        statuses=dict(Counter(str(r["status"]) for r in answered)),
        retried_503=sum(1 for r in answered if r["status"] == 503),
        ran_out=sum(1 for r in records if "ran_out" in r),
        last_acknowledged=last_ok,
        server_cpu_cores=server,
        client_cpu_cores=client,
        postgres_cpu_cores=pg,
        other_cpu_cores=other,
        errors=errors,
    )


# ---- benchmark: OTLP ingest -----------------------------------------------------------------------


@dataclass
class IngestResult:
    backend: str
    tree: str
    round: int
    ack: str
    workers: int
    agents: int
    series_per_agent: int
    export_bytes: int
    load: LoadResult
    empty: LoadResult | None
    consistent: bool
    consistency: str
    drain_s: float  # after the window: until the rollups held every acknowledged export
    server_peak_rss: int
    profile: dict[str, Any] | None = None

    @property
    def accepted(self) -> int:
        return self.load.points_sent - self.load.points_rejected

    @property
    def points_per_s(self) -> float:
        return self.accepted / self.load.window_s

    @property
    def median_per_second(self) -> float:
        return median(self.load.per_second_points, empty=0.0)

    @property
    def applied_per_s(self) -> float:
        """At least this many points/s reached the rollups: every point answered in the window was applied by
        the end of the drain."""
        return self.accepted / (self.load.window_s + self.drain_s)

    @property
    def label(self) -> str:
        workers = f", {self.workers} workers" if self.workers > 1 else ""
        return f"{self.backend}, ack {self.ack}{workers}, {self.tree}"


def stored_totals(url: str) -> dict[tuple[str, str], tuple[float, int]]:
    """Per (agent, metric), the sum of the rollups' totals and counts of `spillway.requests` and
    `spillway.request.duration`: what the exports' `requests` and `durations` must add up to."""
    from sqlalchemy import func, select

    from controlplane.db import MetricRollup, make_engine, make_sessionmaker

    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            rows = session.execute(
                select(MetricRollup.agent_id, MetricRollup.metric, func.sum(MetricRollup.total),
                       func.sum(MetricRollup.count))
                .where(MetricRollup.metric.in_(["spillway.requests", "spillway.request.duration"]))
                .group_by(MetricRollup.agent_id, MetricRollup.metric)
            ).all()  # fmt: skip
    finally:
        engine.dispose()
    return {(agent, metric): (float(total or 0), int(count or 0)) for agent, metric, total, count in rows}


def check_rollups(plane: ControlPlane, exports: list[list[Export]], last_ok: list[int]) -> tuple[bool, str]:
    """Per agent, the rollups hold exactly what its last acknowledged export says happened: no loss, no double."""
    stored = stored_totals(plane.db.url)
    wrong = []
    for (agent_id, _), agent_exports, k in zip(plane.agents, exports, last_ok, strict=True):
        expected = agent_exports[k] if k >= 0 else Export(b"", 0, 0.0, 0)
        requests = stored.get((agent_id, "spillway.requests"), (0.0, 0))[0]
        durations = stored.get((agent_id, "spillway.request.duration"), (0.0, 0))[1]
        if abs(requests - expected.requests) > 1e-6 or durations != expected.durations:
            wrong.append(f"{agent_id}: requests {requests} vs {expected.requests}, "
                         f"durations {durations} vs {expected.durations}")  # fmt: skip
    checked = sum(k + 1 for k in last_ok)
    if wrong:
        return False, f"{len(wrong)} of {len(last_ok)} agents differ: " + "; ".join(wrong[:3])
    return True, f"all {len(last_ok)} agents match after {checked} acknowledged exports"


def wait_for_rollups(plane: ControlPlane, exports: list[list[Export]], last_ok: list[int],
                     limit_s: float) -> tuple[bool, str, float]:  # fmt: skip
    """After the load: until the rollups hold every acknowledged export (at most `limit_s`); the check's verdict
    and how long that took (with ack `logged` the answers run ahead of the applier)."""
    started = time.monotonic()
    while True:
        consistent, consistency = check_rollups(plane, exports, last_ok)
        waited = time.monotonic() - started
        if consistent or waited > limit_s:
            return consistent, consistency, waited
        time.sleep(0.1)


def profile_server(plane: ControlPlane, exports: list[list[Export]], last_ok: list[int], seconds: int,
                   work: Path) -> dict[str, Any] | None:  # fmt: skip
    """py-spy on the server (its first worker) for `seconds` of the same closed loop, after the measured window
    (so the sampler's CPU is not in the table), each agent going on from its last acknowledged export."""
    rest = [agent[k + 1 :] for agent, k in zip(exports, last_ok, strict=True)]
    pid = plane.pids()[-1] if plane.workers > 1 else plane.proc.pid
    raw = work / f"py-spy-{plane.db.name}.txt"
    spy = subprocess.Popen(common.py_spy_command(pid, seconds, raw), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        run_load(plane, rest, 0.5, seconds + 1.0)
    finally:
        spy.wait(timeout=seconds + 30)
    return common.summarise_profile(raw, seconds) if raw.exists() else None


def bench_ingest(plane: ControlPlane, settings: Settings, round_: int, ceiling: bool, work: Path) -> IngestResult:
    profiling = settings.profile_seconds if plane.db.backend == "sqlite" else 0
    run_s = settings.warmup_s + settings.seconds + (profiling + 2 if profiling else 0)
    per_agent = int(settings.max_exports_per_s * run_s / settings.agents) + 2
    name = f"{plane.db.backend}, ack {plane.ack}, {plane.workers} worker(s), {plane.tree.label}"
    log(f"{name}: making {per_agent} exports for each of {settings.agents} agents with the SDK")
    t0 = time.monotonic()
    exports = make_all_exports(plane.agents, per_agent, workers=os.cpu_count() or 1)
    sizes = [len(e.body) for agent in exports for e in agent]
    series = {e.points for agent in exports for e in agent}
    log(f"{name}: made in {time.monotonic() - t0:.1f} s; {sorted(series)} points per export, "
        f"{statistics.mean(sizes):.0f} bytes on average")  # fmt: skip
    log(f"{name}: {settings.warmup_s:g} s warm-up, then {settings.seconds:g} s measured")
    load = run_load(plane, exports, settings.warmup_s, settings.seconds)
    consistent, consistency, drain_s = wait_for_rollups(plane, exports, load.last_acknowledged, settings.drain_s)
    log(f"{name}: {load.exports} exports, {(load.points_sent - load.points_rejected) / load.window_s:.0f} "
        f"points/s, server {load.server_cpu_cores:.2f} cores; {consistency} "
        f"({drain_s:.2f} s after the window)")  # fmt: skip
    profile = None
    if profiling:
        log(f"{name}: py-spy for {profiling} s")
        profile = profile_server(plane, exports, load.last_acknowledged, profiling, work)
    empty = None
    if ceiling and settings.empty_seconds > 0:
        blank = Export(_empty_export(), 0, 0.0, 0)
        log(f"{name}: empty exports for {settings.empty_seconds:g} s")
        enough = int(2000 * (1 + settings.empty_seconds))  # more than any agent sends in that time
        empty = run_load(plane, [[blank] * enough for _ in plane.agents], 1.0, settings.empty_seconds)
        log(f"{name}: {empty.exports / empty.window_s:.0f} empty exports/s")
    return IngestResult(
        backend=plane.db.backend,
        tree=plane.tree.label,
        round=round_,
        ack=plane.ack,
        workers=plane.workers,
        agents=settings.agents,
        series_per_agent=max(series),
        export_bytes=int(statistics.mean(sizes)),
        load=load,
        empty=empty,
        consistent=consistent,
        consistency=consistency,
        drain_s=drain_s,
        server_peak_rss=plane.peak_rss(),
        profile=profile,
    )


def _empty_export() -> bytes:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    return ExportMetricsServiceRequest().SerializeToString()


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def render_ingest(results: list[IngestResult], settings: Settings) -> list[str]:
    out: list[str] = []
    add = out.append
    add("| backend | ack | workers | control plane | agents | series/agent | exports | data points/s (median of "
        "seconds) | data points/s (overall) | p50 export (ms) | p99 export (ms) | rollups caught up (s after the "
        "window) | data points/s applied (at least) | rejected points | server CPU (cores) | data points per "
        "server CPU-second | client CPU (cores) | PostgreSQL CPU (cores) | other CPU (cores) | answers "
        "| rollups check |")  # fmt: skip
    add("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in results:
        load = r.load
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(load.statuses.items()))
        if load.ran_out:
            statuses += f"; **{load.ran_out} agents ran out of exports** (raise --max-exports-per-s)"
        pg = f"{load.postgres_cpu_cores:.2f}" if r.backend == "postgres" else "-"
        label = r.tree + (f" (round {r.round + 1})" if settings.rounds > 1 else "")
        per_cpu = r.points_per_s / load.server_cpu_cores if load.server_cpu_cores else 0.0
        add(f"| {r.backend} | {r.ack} | {r.workers} | {label} | {r.agents} | {r.series_per_agent} | {load.exports} "
            f"| {r.median_per_second:,.0f} | {r.points_per_s:,.0f} | {_ms(percentile(load.latencies_ms, 50))} "
            f"| {_ms(percentile(load.latencies_ms, 99))} | {r.drain_s:.2f} | {r.applied_per_s:,.0f} "
            f"| {load.points_rejected} | {load.server_cpu_cores:.2f} | {per_cpu:,.0f} "
            f"| {load.client_cpu_cores:.2f} | {pg} | {load.other_cpu_cores:.2f} | {statuses} "
            f"| {'ok' if r.consistent else '**WRONG**'} |")  # fmt: skip
    trees = list(dict.fromkeys(r.tree for r in results))
    if len(trees) > 1 or settings.rounds > 1:
        add("")
        add("Medians over rounds" + (f", and {trees[-1]} against {trees[0]} (same run, alternating):"
                                     if len(trees) > 1 else ":"))  # fmt: skip
        add("")
        add("| backend | ack | workers | " + " | ".join(f"{t}: data points/s" for t in trees) + " | "
            + " | ".join(f"{t}: p99 (ms)" for t in trees) + (" | ratio |" if len(trees) > 1 else " |"))  # fmt: skip
        add("|---|---|---:|" + "---:|" * (2 * len(trees) + (1 if len(trees) > 1 else 0)))
        for backend, ack, workers in dict.fromkeys((r.backend, r.ack, r.workers) for r in results):
            same = [r for r in results if (r.backend, r.ack, r.workers) == (backend, ack, workers)]
            rates = [median(r.points_per_s for r in same if r.tree == t) for t in trees]
            p99s = [median(percentile(r.load.latencies_ms, 99) or 0.0 for r in same if r.tree == t) for t in trees]
            ratio = f" | **{rates[-1] / rates[0]:.2f}x** |" if len(trees) > 1 and rates[0] else " |"
            add(f"| {backend} | {ack} | {workers} | " + " | ".join(f"{v:,.0f}" for v in rates) + " | "
                + " | ".join(f"{v:.2f}" for v in p99s) + ratio)  # fmt: skip
    ceilings = [r for r in results if r.empty is not None]
    if ceilings:
        add("")
        add("The ceiling: the same closed loop with empty exports (an `ExportMetricsServiceRequest` without data "
            "points: authentication, routing and the answer, but no ingest):")  # fmt: skip
        add("")
        add("| backend | ack | workers | control plane | empty exports/s | p50 (ms) | p99 (ms) | server CPU (cores) "
            "| server CPU per export (ms) | data points/s at 30 per export if ingest cost nothing |")  # fmt: skip
        add("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for r in ceilings:
            e = r.empty
            assert e is not None
            rate = e.exports / e.window_s
            add(f"| {r.backend} | {r.ack} | {r.workers} | {r.tree} | {rate:,.0f} "
                f"| {_ms(percentile(e.latencies_ms, 50))} | {_ms(percentile(e.latencies_ms, 99))} "
                f"| {e.server_cpu_cores:.2f} "
                f"| {e.server_cpu_cores / rate * 1e3:.2f} | {rate * r.series_per_agent:,.0f} |")  # fmt: skip
    add("")
    for r in results:
        target = " (target: >= 20,000 on SQLite, one core)" if r.backend == "sqlite" else ""
        rate = r.load.exports / r.load.window_s
        add(f"- {r.label}{f', round {r.round + 1}' if settings.rounds > 1 else ''}: "
            f"**{r.points_per_s:,.0f} data points/s** answered{target}, at least {r.applied_per_s:,.0f}/s applied; "
            f"{rate:,.0f} exports/s of {r.export_bytes:,} bytes on average, "
            f"{r.load.server_cpu_cores / rate * 1e3:.2f} ms of server CPU per export; per-second throughput min "
            f"{min(r.load.per_second_points, default=0):,} / max {max(r.load.per_second_points, default=0):,}; "
            f"rollups: {r.consistency}, {r.drain_s:.2f} s after the window; server peak RSS "
            f"{r.server_peak_rss / (1 << 20):.0f} MiB (per process)"
            + (f"; first errors: {'; '.join(r.load.errors)}" if r.load.errors else ""))  # fmt: skip
    profiled = [r for r in results if r.profile]
    for r in profiled:
        assert r.profile is not None
        add("")
        add(f"Where the server's time goes ({r.label}; py-spy, {settings.profile_seconds} s at 200 Hz of the same "
            "closed loop right after the measured window; self time of the innermost function):")  # fmt: skip
        add("")
        threads = ", ".join(f"{name}: {t['samples']}" for name, t in r.profile["threads"].items())
        add(f"Samples per thread: {threads} (of {r.profile['expected_per_thread']} per fully busy thread).")
        add("")
        add("| thread | function | samples | share |")
        add("|---|---|---:|---:|")
        for row in r.profile["top"][:12]:
            add(f"| {row['thread']} | `{row['function']}` | {row['samples']} | {row['share']:.1%} |")
        add("")
        add("Inclusive, per thread (the heaviest calls below the thread's run loop):")
        add("")
        for name, t in r.profile["threads"].items():
            calls = "; ".join(f"`{f}` {n}" for f, n in t["inclusive"][:8])
            add(f"- {name}: {calls}")
    return out


# ---- the run and the report ----------------------------------------------------------------------


def machine_info() -> dict[str, str]:
    import sqlite3

    versions = {name: importlib.metadata.version(name) for name in
                ("uvicorn", "fastapi", "sqlalchemy", "psycopg", "opentelemetry-sdk", "protobuf")}  # fmt: skip
    return {
        **common.machine(),
        "commit": common.revision("controlplane"),
        "sqlite": sqlite3.sqlite_version,
        "software": ", ".join(f"{k} {v}" for k, v in versions.items()),
    }


def postgres_version(settings: Settings) -> str:
    if "postgres" not in settings.backends or settings.postgres_url is None:
        return ""
    from sqlalchemy import create_engine, text

    from controlplane.db import normalise_url

    engine = create_engine(normalise_url(settings.postgres_url))
    try:
        with engine.connect() as conn:
            return str(conn.execute(text("SHOW server_version")).scalar())
    finally:
        engine.dispose()


def render(settings: Settings, info: dict[str, str], started: dt.datetime, elapsed: float,
           ingest: list[IngestResult], work: Path) -> str:  # fmt: skip
    argv = ["$(bash .ci/postgres.sh)" if a == settings.postgres_url else a for a in settings.argv]
    command = " ".join(
        [".venv/bin/python", "bench/ingest.py", *(a if a.startswith("$(") else shlex.quote(a) for a in argv)]
    )
    out = common.section_head(BEGIN, "OTLP ingest: `POST /v1/metrics` on one core", command, started=started,
                              minutes=elapsed / 60, code=f"control plane at commit {info['commit']}")  # fmt: skip
    add = out.append
    add(f"- Machine: {common.machine_words(info)}; load average "
        f"{info['loadavg_start']} at the start, {info['loadavg_end']} at the end")  # fmt: skip
    pg = f", PostgreSQL {info['postgres']} (local, same machine)" if info.get("postgres") else ""
    add(f"- Software: Python {info['python']}, SQLite {info['sqlite']}{pg}; {info['software']}")
    one = ",".join(map(str, settings.server_cores(1)))
    rest = ",".join(map(str, sorted(settings.client_cores)))
    add(f"- Server: `taskset -c {one} spillway controlplane serve` (one uvicorn process, one core); on PostgreSQL "
        "also `serve --workers N` (N processes on one port, `SO_REUSEPORT`, on N cores: "
        + ", ".join(f"{n} on core(s) {','.join(map(str, settings.server_cores(n)))}" for n in settings.workers)
        + "); `SPILLWAY_LOG_LEVEL=warning` (no access log), "
        f"`SPILLWAY_INGEST_MAX_CONCURRENT={settings.max_concurrent}`, `SPILLWAY_AGENT_AUTH_CACHE_S` at its default "
        "(5 s); `SPILLWAY_INGEST_ACK=logged` (the answer once the export is in the process's ingest log, fsynced; "
        "the rollups written just after by the applier thread) or `applied` "
        "(the answer once the rollups are committed); SQLite in WAL mode on a local file; the PostgreSQL backends "
        "serving the benchmark's database pinned with the client once the server's connections are open")  # fmt: skip
    add(f"- Load: {settings.agents} agents enrolled through `POST /api/v1/agents`, each sending with its own token "
        "over one keep-alive connection, closed loop (the next export when the previous one is answered), from "
        f"this script on core(s) {rest} (every core when the workers take them all; asyncio + uvloop, raw "
        f"HTTP/1.1); {settings.warmup_s:g} s warm-up, {settings.seconds:g} s measured per run")  # fmt: skip
    add("- Exports: made beforehand by the real OpenTelemetry SDK (the agent's `AgentTelemetry` instruments and "
        "views, fed by `ModelStats`, an `InMemoryMetricReader` with cumulative temporality, the OTLP exporter's "
        "`encode_metrics`): per agent `spillway.requests` (3 priorities x local/rejected/error), "
        "`spillway.request.duration` and `spillway.queue.duration` (3 x local/rejected), "
        "`spillway.compute.duration` (3 x local; 13 explicit buckets each), `spillway.batch.size`, "
        "`spillway.queue.depth` (3 priorities) and `system.memory.usage` (2 states); every export adds traffic, "
        "so successive exports grow; uncompressed protobuf, like the agent's exporter")  # fmt: skip
    add("- Data points/s counts what the server accepted: points sent in exports answered 200 minus their "
        "`partial_success.rejected_data_points`; \"median of seconds\" is the median over the measured window's "
        "whole seconds; the rollups check compares, per agent, the stored `spillway.requests` sum and "
        "`spillway.request.duration` count with the cumulative values of its last acknowledged export, polled "
        "after the window until they match (\"rollups caught up\": how long the applier needed beyond the "
        "answers; \"applied (at least)\": the points answered in the window over the window plus that "
        "time)")  # fmt: skip
    add("")
    out += render_ingest(ingest, settings)
    add("")
    add(f"Raw results: `{work / 'results.json'}` on the machine that ran it.")
    add("")
    add("SLO evaluation: see below")
    add(END)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(sys.argv[1:] if argv is None else argv)
    started = dt.datetime.now(dt.timezone.utc)
    t_start = time.monotonic()
    info = machine_info()
    info["loadavg_start"] = loadavg()
    info["postgres"] = postgres_version(settings)
    os.sched_setaffinity(0, settings.client_cores)  # the load generator stays off the server's core
    work = Path(tempfile.mkdtemp(prefix="spillway-bench-ingest-"))
    log(f"work folder {work}; server on core {settings.server_core}, client on {sorted(settings.client_cores)}")
    trees = [WORKING_TREE]
    if settings.baseline:
        trees.insert(0, Tree.unpack(settings.baseline, work))
    ingest: list[IngestResult] = []
    for backend in settings.backends:
        for workers in settings.workers if backend == "postgres" else (1,):  # SQLite has one writer: one process
            os.sched_setaffinity(0, settings.client_cores_for(workers))
            for round_ in range(settings.rounds):
                for tree in trees if round_ % 2 == 0 else trees[::-1]:  # A B, then B A
                    for ack in settings.acks if round_ % 2 == 0 else settings.acks[::-1]:
                        with (
                            database(backend, settings.postgres_url, work) as db,
                            control_plane(db, tree, settings, work, ack, workers) as plane,
                        ):
                            plane.enrol(settings.agents)
                            ceiling = tree is WORKING_TREE and round_ == 0 and ack == settings.acks[0]
                            ingest.append(bench_ingest(plane, settings, round_, ceiling, work))
    ingest.sort(key=lambda r: (settings.backends.index(r.backend), r.workers, settings.acks.index(r.ack),
                               r.tree != trees[0].label, r.round))  # fmt: skip
    info["loadavg_end"] = loadavg()
    raw = {"settings": {k: (sorted(v) if isinstance(v, frozenset) else v) for k, v in asdict(settings).items()},
           "machine": info, "ingest": [asdict(r) for r in ingest]}  # fmt: skip
    (work / "results.json").write_text(json.dumps(raw, indent=1, default=str))
    markdown = render(settings, info, started, time.monotonic() - t_start, ingest, work)
    print(markdown)
    if settings.write:
        common.write_docs(markdown, BEGIN, END)
        log(f"wrote {DOCS}")
    log(f"raw results in {work / 'results.json'}")
    return 0 if all(r.consistent for r in ingest) else 1


if __name__ == "__main__":
    sys.exit(main())
