"""Issue 6's benchmark: overflow to the cloud through the control plane's gateway, with real processes on loopback.

One invocation starts a control plane (gateway inside), an edge agent with overflow on, a Spillway agent in cloud
role with the same model and configuration registered as the gateway's backend, and nginx as a plain reverse
proxy in front of that backend; then:

  1. gateway overhead: the same request (one row of `mlp` v2 as JSON, and as binary tensors) to the backend
     directly, through nginx and through the gateway, at concurrency 1 and `--overhead-concurrency`, in
     interleaved rounds (direct, nginx, gateway; again ...) over keep-alive connections; p50/p99 and the p50 each
     proxy adds. Target: the gateway adds <= 1 ms at p50.
  2. overload: the edge's capacity and the cloud's (closed loop, wrk), the edge unloaded (open loop at a quarter
     of its capacity), then open loop at `--overload` x the edge's capacity, `--high-share` at priority 1 and the
     rest at 2, every request with a `timeout` (its deadline); each answer counted by its `spillway-outcome`.
     Targets: goodput (200 within the deadline, served locally or in the cloud) >= 90 % of local + cloud
     capacity; priority 1's p99 <= 2x its unloaded p99; nothing lost (every request sent gets exactly one answer
     that carries an outcome).

The bench model is `mlp` from `spillway models build-demo` with `max_batch_size` set to `--max-batch` (default 1:
one request per run, so that a device's capacity is its compute time and nothing else) and one instance; with
`--model slow` (the default) version 1 is the slow mlp (~20 ms a request on one thread), else the demo's full one.
Version 1 serves the overload, version 2 (lite) the overhead rounds, so that the backend's own time does not
drown what a proxy adds. onnxruntime runs one intra-op thread in each agent.

Load generators are small asyncio clients (raw HTTP/1.1 over keep-alive connections, uvloop) in a process of
their own; open-loop latency counts from when a request was due, and every overload request carries inputs of its
own (so that no answer comes from the agent's fallback cache). The machines are shared: the script waits for the
machine to be quiet before it starts and before each measurement (`--wait-quiet-s`), and reports, beside every
figure, the CPU of each process and of everything else (`other`). Results go to stdout and, with `--write`,
between markers in `docs/benchmarks.md`. Needs nginx (`apt-get install -y nginx`), wrk (`apt-get install wrk`) and,
for the profile, py-spy.

    .venv/bin/python bench/overflow.py --write
    .venv/bin/python bench/overflow.py --quick     # short points: a smoke test, not a result
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.common import bearer, free_port, http_json, log, median, percentile, url_parts  # noqa: E402
from bench.load import _Connection, build_request  # noqa: E402
from bench.nginx import nginx_version, require_nginx, reverse_proxy  # noqa: E402
from bench.procstat import cpu_seconds, loadavg, machine_busy_seconds, vm_hwm  # noqa: E402
from spillway.demo.harness import Process, stop, stop_all  # noqa: E402

BEGIN = "<!-- bench/overflow.py: begin (generated; edit outside these markers) -->"
END = "<!-- bench/overflow.py: end -->"
CLOUD_SECRET = "bench-cloud-agent-secret"
INPUT_DIM = 512
GOOD = ("local", "overflow")  # outcomes that are the model's own answer


# ---- processes ------------------------------------------------------------------------------------


class Processes:
    """Every process this script starts, each in its own session (a log file each in the work folder);
    `stop_all` ends them (and only them)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, Process] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Process:
        proc = Process.start(cmd, name=name, log=self.workdir / f"{name}.log", append=False, env=env, group=True)
        self.procs[name] = proc
        return proc

    def wait_ready(self, name: str, url: str, headers: dict[str, str] | None = None, timeout_s: float = 180) -> None:
        self.procs[name].wait_ready(url, headers=headers, timeout_s=timeout_s, interval_s=0.2)

    def stop_all(self) -> None:
        stop_all(reversed(list(self.procs.values())))

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Stop every process at the end; on success delete the work folder, on failure keep it (the logs)."""
        try:
            yield
        except BaseException:
            self.stop_all()
            log(f"stopped; the processes' logs are in {self.workdir}")
            raise
        self.stop_all()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _terminate_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so that every `finally` stops what it started."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


# ---- the system under test ------------------------------------------------------------------------


def bench_repository(root: Path, max_batch: int, model: str = "slow") -> Path:
    """The demo repository with `max_batch_size` set to `max_batch` (preferred sizes above it dropped); with
    model `slow`, version 1 is the slow mlp (`build_slow_mlp`, ~20 ms a request on one thread) instead of the full
    one, so that a device's capacity costs less HTTP work per unit of compute."""
    from spillway.demo.models import build_demo_repository, build_slow_mlp

    repo = build_demo_repository(root / "models")
    if model == "slow":
        (repo / "mlp" / "1" / "model.onnx").write_bytes(build_slow_mlp().SerializeToString())
    config = repo / "mlp" / "config.pbtxt"
    text, n = re.subn(r"max_batch_size: \d+", f"max_batch_size: {max_batch}", config.read_text())
    assert n == 1, "the demo config changed: update bench/overflow.py"
    preferred = [p for p in (8, 16, 32) if p <= max_batch]
    line = f"preferred_batch_size: [ {', '.join(map(str, preferred))} ]" if preferred else ""
    text, n = re.subn(r"preferred_batch_size: \[[^\]]*\]", line, text)
    assert n == 1, "the demo config changed: update bench/overflow.py"
    config.write_text(text)
    return repo


@dataclass
class System:
    procs: Processes
    cp: str  # control plane (and gateway) base URL
    admin: str
    edge: str
    edge_token: str  # the edge agent's token: the gateway's credential
    cloud: str
    nginx: str = ""
    nginx_pid: int = 0
    backend_id: str = ""

    @property
    def cloud_auth(self) -> dict[str, str]:
        return bearer(CLOUD_SECRET)

    @property
    def gateway_auth(self) -> dict[str, str]:
        return bearer(self.edge_token)

    def pid(self, name: str) -> int:
        return self.nginx_pid if name == "nginx" else self.procs.procs[name].pid

    def edge_status(self) -> dict[str, Any]:
        return dict(http_json("GET", f"{self.edge}/v2/spillway/status"))

    def gateway_backends(self) -> list[dict[str, Any]]:
        status = http_json("GET", f"{self.cp}/api/v1/status", headers=bearer(self.admin))
        return list(status["gateway"]["backends"])


def agent_config(repo: Path, port: int, workdir: Path, name: str, **extra: Any) -> dict[str, Any]:
    return {"model_repository": str(repo), "host": "127.0.0.1", "port": port, "intra_op_threads": 1,
            "inter_op_threads": 1, "state_dir": str(workdir / f"state-{name}"), "default_versions": {"mlp": 1},
            "agent_id": name, **extra}  # fmt: skip


def start_system(procs: Processes, workdir: Path, args: argparse.Namespace) -> System:
    import yaml

    from spillway.demo.story import Story

    repo = bench_repository(workdir, args.max_batch, args.model)
    cp_port, edge_port, cloud_port = free_port(), free_port(), free_port()
    story = Story(workdir, port=cp_port, agent_port=edge_port)
    admin = story.prepare()  # a migrated SQLite database and an admin key
    env = {**story.env(), "SPILLWAY_LOG_LEVEL": "warning", "SPILLWAY_CONTROL_LOOP_INTERVAL_S": "0"}
    cli = [sys.executable, "-m", "spillway.cli"]
    cp = f"http://127.0.0.1:{cp_port}"
    log("starting the control plane, the cloud agent and the edge agent")
    procs.start("controlplane", [*cli, "controlplane", "serve", "--no-migrate"], env)

    cloud_config = agent_config(repo, cloud_port, workdir, "bench-cloud", role="cloud", token=CLOUD_SECRET)
    (workdir / "cloud.yaml").write_text(yaml.safe_dump(cloud_config))
    agent_env = {k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")}
    procs.start("cloud", [*cli, "agent", "serve", "--config", str(workdir / "cloud.yaml"), "--log-level", "warning"],
                agent_env)  # fmt: skip
    procs.wait_ready("controlplane", f"{cp}/readyz")

    operator = bearer(admin)
    enrolled = http_json("POST", f"{cp}/api/v1/agents", {"name": "bench-edge", "device_class": "cpu",
                                                         "labels": {"bench": "overflow"}}, operator)  # fmt: skip
    edge_token = enrolled["token"]
    breaker = {"slow_rt_ms": 1000.0, "slow_ratio": 0.5, "error_ratio": 0.5, "min_requests": 5,
               "stat_interval_s": 10.0, "open_s": 5.0}  # the agent's defaults, written out  # fmt: skip
    overflow = {"enabled": True, "fraction": 0.0, "gateway": cp, "max_in_flight": args.in_flight, "breaker": breaker}
    edge_config = agent_config(repo, edge_port, workdir, "bench-edge", role="edge", overflow=overflow)
    (workdir / "edge.yaml").write_text(yaml.safe_dump(edge_config))
    procs.start("edge", [*cli, "agent", "serve", "--config", str(workdir / "edge.yaml"), "--log-level", "warning"],
                {**agent_env, "SPILLWAY_AGENT_TOKEN": edge_token})  # fmt: skip
    cloud = f"http://127.0.0.1:{cloud_port}"
    procs.wait_ready("cloud", f"{cloud}/v2/health/ready", bearer(CLOUD_SECRET))
    # Part 1 measures the proxy alone: no cap there. Part 2 sets the backend's cap (`set_backend_cap`).
    backend = {"name": "cloud-1", "url": cloud, "models": ["mlp"], "weight": 1.0,
               "max_concurrency": 1000, "timeout_ms": 10_000, "binary_tensors": True,
               "auth_header": f"Bearer {CLOUD_SECRET}"}  # fmt: skip
    backend_id = http_json("POST", f"{cp}/api/v1/backends", backend, operator)["id"]
    edge = f"http://127.0.0.1:{edge_port}"
    procs.wait_ready("edge", f"{edge}/v2/health/ready")
    return System(procs, cp, admin, edge, edge_token, cloud, backend_id=backend_id)


def set_backend_cap(system: System, cap: int) -> None:
    """The backend's max_concurrency, through the REST API (the gateway reloads at once)."""
    http_json("PATCH", f"{system.cp}/api/v1/backends/{system.backend_id}", {"max_concurrency": cap},
              bearer(system.admin))  # fmt: skip


def body(level: int | None, deadline_us: int | None, seed: int = 7) -> bytes:
    """One row of `mlp` input as V2 JSON, with `priority` and `timeout` (microseconds) when given."""
    draw = random.Random(seed)
    data = [round(draw.uniform(-1, 1), 4) for _ in range(INPUT_DIM)]
    parameters: dict[str, Any] = {}
    if level is not None:
        parameters["priority"] = level
    if deadline_us is not None:
        parameters["timeout"] = deadline_us
    request: dict[str, Any] = {"inputs": [{"name": "input", "shape": [1, INPUT_DIM], "datatype": "FP32", "data": data}]}
    if parameters:
        request["parameters"] = parameters
    return json.dumps(request, separators=(",", ":")).encode()


def binary_body() -> tuple[bytes, int]:
    """One row as binary tensor data, the output asked for as binary too; (body, JSON header length)."""
    import numpy as np

    row = np.random.default_rng(7).uniform(-1, 1, (1, INPUT_DIM)).astype(np.float32)
    head = json.dumps({"inputs": [{"name": "input", "shape": [1, INPUT_DIM], "datatype": "FP32",
                                   "parameters": {"binary_data_size": row.nbytes}}],
                       "outputs": [{"name": "output", "parameters": {"binary_data": True}}]},
                      separators=(",", ":")).encode()  # fmt: skip
    return head + row.tobytes(), len(head)


# ---- clients (run in a process of their own: `overflow.py _client SPEC OUT`) -----------------------


class _Exchange(_Connection):
    """One keep-alive HTTP/1.1 connection, one request at a time; answers (status, spillway-outcome)."""

    def result(self, head: bytes) -> tuple[int, str]:
        marker = head.find(b"\r\nspillway-outcome:")
        outcome = ""
        if marker >= 0:
            stop = head.find(b"\r\n", marker + 2)
            outcome = head[marker + 19 : stop if stop >= 0 else len(head)].strip().decode()
        return int(head[9:12]), outcome


class _Template:
    """A JSON infer request whose first input value is the request's number: every request has inputs of its own,
    so that no answer comes from the agent's fallback cache (as with real traffic) and none is a replay."""

    def __init__(self, url: str, body: bytes, headers: dict[str, str]) -> None:
        start = body.index(b'"data":[') + len(b'"data":[')
        stop = body.index(b",", start)
        self.before, self.after = body[:start], body[stop:]
        probe = build_request(url, b"", headers)[2]
        head = probe[: probe.index(b"Content-Length: ")]
        rest = probe[probe.index(b"\r\n", len(head)) :]
        self.head, self.rest = head + b"Content-Length: ", rest

    def request(self, number: int) -> bytes:
        body = self.before + str(number).encode() + self.after
        return self.head + str(len(body)).encode() + self.rest + body


async def _connect(host: str, port: int) -> _Exchange:
    _, conn = await asyncio.get_running_loop().create_connection(_Exchange, host, port)
    return conn


async def open_loop(spec: dict[str, Any]) -> dict[str, Any]:
    """Requests due at start + i/rate (priority drawn per request, seeded); records of those due after warm-up:
    [level, status (0: connection failed, -1: unanswered by the end of the drain), outcome, latency us]."""
    clock = time.perf_counter
    host, port = spec["host"], spec["port"]
    templates = {int(level): _Template(spec["url"], Path(path).read_bytes(), spec["headers"])
                 for level, path in spec["bodies"].items()}  # fmt: skip
    rate, total = spec["rate"], int((spec["warmup_s"] + spec["duration_s"]) * spec["rate"])
    first_measured = int(spec["warmup_s"] * rate)
    draw = random.Random(spec["seed"])
    levels = [1 if draw.random() < spec["high_share"] else 2 for _ in range(total)]
    records: list[list[Any] | None] = [None] * (total - first_measured)
    free: list[_Exchange] = []
    opened = peak = 0
    max_lag = 0.0
    cpu0 = time.process_time()
    start = clock() + 0.05

    async def one(i: int, due: float) -> None:
        nonlocal opened, peak, max_lag
        max_lag = max(max_lag, clock() - due)
        level = levels[i]
        slot = i - first_measured
        if slot >= 0:
            records[slot] = [level, -1, "", 0]
        conn = None
        while free and conn is None:
            candidate = free.pop()
            if candidate.closed:
                opened -= 1
            else:
                conn = candidate
        try:
            if conn is None:
                opened += 1
                peak = max(peak, opened)
                conn = await _connect(host, port)
            status, outcome = await conn.send(templates[level].request(i))
        except (OSError, ConnectionError):
            opened -= 1
            if conn is not None and conn.transport is not None:
                conn.transport.close()
            if slot >= 0:
                records[slot] = [level, 0, "", 0]
            return
        free.append(conn)
        if slot >= 0:
            records[slot] = [level, status, outcome, round((clock() - due) * 1e6)]

    tasks: set[asyncio.Task[None]] = set()
    i = 0
    loop = asyncio.get_running_loop()
    while i < total:
        now = clock()
        due = start + i / rate
        if due > now:
            await asyncio.sleep(max(due - now, 0.001))  # timers tick in whole milliseconds
            continue
        while i < total and start + i / rate <= now:
            task = loop.create_task(one(i, start + i / rate))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=spec["drain_s"])
        for task in pending:
            task.cancel()
    for conn in free:
        if conn.transport is not None:
            conn.transport.close()
    return {"records": records, "client_cpu_s": time.process_time() - cpu0, "max_send_lag_ms": max_lag * 1e3,
            "connections": peak, "requests": total}  # fmt: skip


async def latency_rounds(spec: dict[str, Any]) -> dict[str, Any]:
    """Closed-loop blocks, target after target within each round (direct, nginx, gateway, direct, ...): per
    (kind, concurrency, target) every latency in microseconds and each round's median. Connections are opened
    once per (target, concurrency slot) and kept."""
    clock = time.perf_counter
    cpu0 = time.process_time()
    counts: dict[str, int] = {}  # requests per target, the warm-up round's too
    failed: dict[str, int] = {}  # answers other than 200 per target
    conns: dict[tuple[str, int], _Exchange] = {}
    out: dict[str, Any] = {}
    payloads = {(t["name"], kind): build_request(t["url"] + b["path"], Path(b["file"]).read_bytes(),
                                                 {**t["headers"], **b["headers"]})[2]
                for t in spec["targets"] for kind, b in spec["bodies"].items()}  # fmt: skip

    async def worker(target: dict[str, Any], slot: int, payload: bytes, n: int, into: list[int]) -> None:
        conn = conns.get((target["name"], slot))
        if conn is None or conn.closed:
            conn = conns[(target["name"], slot)] = await _connect(target["host"], target["port"])
        for _ in range(n):
            began = clock()
            status, _ = await conn.send(payload)
            if status == 200:
                into.append(round((clock() - began) * 1e6))
            else:  # e.g. a 503 when a stall made the backend refuse at admission: counted, not timed
                failed[target["name"]] = failed.get(target["name"], 0) + 1

    for rnd in range(-1, spec["rounds"]):  # round -1 warms up every connection and path, and is not kept
        for kind in spec["bodies"]:
            for concurrency in spec["concurrency"]:
                for target in spec["targets"]:
                    n = max(1, spec["requests"] // concurrency)
                    into: list[int] = []
                    payload = payloads[(target["name"], kind)]
                    await asyncio.gather(*(worker(target, s, payload, n, into) for s in range(concurrency)))
                    counts[target["name"]] = counts.get(target["name"], 0) + n * concurrency
                    if rnd >= 0:
                        cell = out.setdefault(f"{kind}|{concurrency}|{target['name']}", {"all": [], "rounds": []})
                        cell["all"] += into
                        cell["rounds"].append(median(into))
    for conn in conns.values():
        if conn.transport is not None:
            conn.transport.close()
    out["client_cpu_s"] = time.process_time() - cpu0
    out["requests"] = counts
    out["failed"] = failed
    return out


def _client_main(spec_path: str, out_path: str) -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    spec = json.loads(Path(spec_path).read_text())
    run = open_loop(spec) if spec["mode"] == "open" else latency_rounds(spec)
    Path(out_path).write_text(json.dumps(asyncio.run(run)))


def start_client(spec: dict[str, Any], workdir: Path) -> tuple[subprocess.Popen[bytes], Path]:
    spec_path, out_path = workdir / "client-spec.json", workdir / "client-out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "_client", str(spec_path), str(out_path)]
    return subprocess.Popen(cmd), out_path


def run_client(spec: dict[str, Any], workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run a load generator (`_client`) in its own process and return what it wrote."""
    proc, out_path = start_client(spec, workdir)
    try:
        if proc.wait(timeout_s) != 0:
            raise RuntimeError(f"the load generator failed with code {proc.returncode}")
    finally:
        stop(proc, signal.SIGKILL)
    return dict(json.loads(out_path.read_text()))


# ---- measurements ---------------------------------------------------------------------------------


class CpuMeter:
    """Cores used from its creation to `cores()`: per named process, the clients, the machine, and the rest (other
    sessions on this shared machine: the noise)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before = {name: cpu_seconds([pid]) for name, pid in pids.items()}
        self.main_before = {name: main_thread_seconds(pid) for name, pid in pids.items()}
        self.busy, self.t0 = machine_busy_seconds(), time.monotonic()
        self.main: dict[str, float] = {}  # cores of each process's main thread (the agents' event loop)

    def cores(self, clients: dict[str, float] | None = None) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        cpu = {name: (cpu_seconds([pid]) - self.before[name]) / wall for name, pid in self.pids.items()}
        self.main = {
            name: (main_thread_seconds(pid) - self.main_before[name]) / wall for name, pid in self.pids.items()
        }
        cpu.update({name: seconds / wall for name, seconds in (clients or {}).items()})
        machine = (machine_busy_seconds() - self.busy) / wall
        cpu["other"] = max(0.0, machine - sum(cpu.values()))
        cpu["machine"] = machine
        return cpu


def main_thread_seconds(pid: int) -> float:
    """user + system CPU seconds of the process's main thread alone."""
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_words(cpu: dict[str, float]) -> str:
    return ", ".join(f"{name} {cores:.2f}" for name, cores in cpu.items())


def wait_quiet(limit_s: float, threshold: float = 0.3) -> tuple[float, float]:
    """Wait (at most `limit_s`) until the machine's busy CPU over 3 s is below `threshold` cores, before anything
    of ours runs; (the last measurement, seconds waited)."""
    began = time.monotonic()
    while True:
        busy0, t0 = machine_busy_seconds(), time.monotonic()
        time.sleep(3)
        busy = (machine_busy_seconds() - busy0) / (time.monotonic() - t0)
        waited = time.monotonic() - began
        if busy < threshold or waited >= limit_s:
            return busy, waited
        log(f"the machine is busy ({busy:.2f} cores, load {loadavg()}): waiting for quiet ({waited:.0f} s so far)")


@dataclass
class Capacity:
    rps: float  # 2xx answers per second
    wrk: Any
    cpu: dict[str, float]


def capacity(
    name: str, system: System, body_path: Path, headers: dict[str, str], args: argparse.Namespace, workdir: Path
) -> Capacity:
    """Closed-loop saturation with wrk: 2xx answers per second."""
    url = system.edge if name == "edge" else system.cloud
    lua = common.write_lua(workdir / f"wrk-{name}.lua", body_path, {"Content-Type": "application/json", **headers})
    infer = f"{url}/v2/models/mlp/infer"
    common.run_wrk(infer, lua, args.capacity_concurrency, max(1, round(args.warmup_s)))  # wrk takes whole seconds
    meter = CpuMeter({name: system.pid(name)})
    result = common.run_wrk(infer, lua, args.capacity_concurrency, max(1, round(args.capacity_s)))
    cpu = meter.cores({"wrk": result.client_cpu_s})
    cpu[f"(of the {name}'s, its main thread)"] = meter.main[name]
    if result.socket_errors or result.requests == 0:
        raise RuntimeError(f"capacity run against {url} failed: {result}")
    # Capacity counts answers that are results: a 503 (a request refused at admission) is not one.
    return Capacity((result.requests - result.non_2xx) / result.seconds, result, cpu)


@dataclass
class OpenRun:
    rate: float
    duration_s: float
    records: list[list[Any]]
    client: dict[str, Any]
    cpu: dict[str, float] = field(default_factory=dict)  # cores, per process and the machine
    edge_before: dict[str, Any] = field(default_factory=dict)
    edge_after: dict[str, Any] = field(default_factory=dict)
    gateway_after: list[dict[str, Any]] = field(default_factory=list)

    def latencies_ms(self, level: int, outcomes: tuple[str, ...] | None = None) -> list[float]:
        return [r[3] / 1e3 for r in self.records
                if r[0] == level and r[1] == 200 and (outcomes is None or r[2] in outcomes)]  # fmt: skip


def open_spec(
    system: System, rate: float, duration_s: float, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    host, port = url_parts(system.edge)
    bodies = {}
    for level in (1, 2):
        path = workdir / f"body-p{level}.json"
        path.write_bytes(body(level, args.deadline_ms * 1000))
        bodies[str(level)] = str(path)
    return {"mode": "open", "url": f"{system.edge}/v2/models/mlp/infer", "host": host, "port": port, "headers": {},
            "bodies": bodies, "rate": rate, "warmup_s": args.warmup_s, "duration_s": duration_s,
            "high_share": args.high_share, "seed": 1, "drain_s": 10.0}  # fmt: skip


def open_run(system: System, rate: float, duration_s: float, args: argparse.Namespace, workdir: Path) -> OpenRun:
    spec = open_spec(system, rate, duration_s, args, workdir)
    edge_before = system.edge_status()
    meter = CpuMeter({name: system.pid(name) for name in ("edge", "cloud", "controlplane")})
    result = run_client(spec, workdir, args.warmup_s + duration_s + 120)
    cpu = meter.cores({"load generator": result["client_cpu_s"]})
    result["main_thread_cores"] = meter.main
    records = result.pop("records")
    return OpenRun(rate, duration_s, records, result, cpu, edge_before, system.edge_status(),
                   system.gateway_backends())  # fmt: skip


PROFILED = ("edge", "controlplane")


def profile_overload(
    system: System, rate: float, seconds: int, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    """py-spy (non-blocking, every thread, 200 Hz) on the edge agent and the control plane at once, during a
    separate open-loop run at the overload's rate; {process: `summarise_profile`} (empty without py-spy)."""
    if not common.PY_SPY.exists():
        log("py-spy is missing (.venv/bin/pip install py-spy): no profile")
        return {}
    spec = open_spec(system, rate, seconds + 2 * args.warmup_s, args, workdir)
    client, _ = start_client(spec, workdir)
    spies = {}
    try:
        time.sleep(2 * args.warmup_s)
        for name in PROFILED:
            raw = workdir / f"py-spy-{name}.txt"
            cmd = common.py_spy_command(system.pid(name), seconds, raw)
            spies[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), raw)
        for proc, _ in spies.values():
            proc.wait(seconds + 60)
        client.wait(3 * args.warmup_s + seconds + 60)
    finally:
        for proc in [client, *(p for p, _ in spies.values())]:
            stop(proc, signal.SIGKILL)
    return {name: common.summarise_profile(raw, seconds) for name, (_, raw) in spies.items() if raw.exists()}


def overhead(system: System, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    json_path, bin_path = workdir / "overhead.json", workdir / "overhead.bin"
    json_path.write_bytes(body(None, None))
    binary, head = binary_body()
    bin_path.write_bytes(binary)
    path = "/v2/models/mlp/versions/2/infer"
    bodies = {"JSON": {"file": str(json_path), "path": path, "headers": {}},
              "binary": {"file": str(bin_path), "path": path,
                         "headers": {"Content-Type": "application/octet-stream",
                                     "Inference-Header-Content-Length": str(head)}}}  # fmt: skip
    targets = []
    for name, url, headers in (("direct", system.cloud, system.cloud_auth), ("nginx", system.nginx, system.cloud_auth),
                               ("gateway", system.cp, system.gateway_auth)):  # fmt: skip
        host, port = url_parts(url)
        targets.append({"name": name, "url": url, "host": host, "port": port, "headers": headers})
    spec = {"mode": "rounds", "targets": targets, "bodies": bodies, "rounds": args.overhead_rounds,
            "requests": args.overhead_requests, "concurrency": [1, args.overhead_concurrency]}  # fmt: skip
    meter = CpuMeter({name: system.pid(name) for name in ("cloud", "controlplane", "nginx")})
    result = run_client(spec, workdir, 900)
    result["_cpu"] = meter.cores({"client": result.pop("client_cpu_s")})
    result["_wall_s"] = time.monotonic() - meter.t0
    return result


def client_ceiling(rate: float, seconds: float, workdir: Path) -> dict[str, Any]:
    """The open-loop client against `bench/load.py`'s no-op server: what it sustains on its own."""
    from bench.load import start_noop_server

    port = free_port()
    path = workdir / "ceiling.json"
    path.write_bytes(body(2, 100_000))
    spec = {"mode": "open", "url": f"http://127.0.0.1:{port}/noop", "host": "127.0.0.1", "port": port,
            "headers": {}, "bodies": {"1": str(path), "2": str(path)}, "rate": rate, "warmup_s": 0.5,
            "duration_s": seconds, "high_share": 0.2, "seed": 1, "drain_s": 5.0}  # fmt: skip
    with start_noop_server(port):
        result = run_client(spec, workdir, seconds + 60)
    answered = [r[3] for r in result["records"] if r[1] == 200]
    return {"rate": rate, "seconds": seconds, "sent": len(result["records"]), "answered": len(answered),
            "p99_ms": (percentile(answered, 99) or 0) / 1e3, "max_lag_ms": result["max_send_lag_ms"],
            "cpu_us": result["client_cpu_s"] / result["requests"] * 1e6}  # fmt: skip


# ---- report ---------------------------------------------------------------------------------------


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


@dataclass
class Results:
    command: str
    started: dt.datetime
    load_before: str
    system: System
    args: argparse.Namespace
    overhead: dict[str, Any] | None = None
    overload: Overload | None = None
    quiet: tuple[float, float] = (0.0, 0.0)


@dataclass
class Overload:
    """Part 2: the capacities, the edge unloaded, the client's ceiling, the overload and a profile."""

    capacity_edge: Capacity
    capacity_cloud: Capacity
    unloaded: OpenRun
    ceiling: dict[str, Any]
    loaded: OpenRun
    profile: dict[str, Any]
    peak_rss: dict[str, int]


def overload(system: System, args: argparse.Namespace, workdir: Path) -> Overload:
    body_path = workdir / "capacity.json"
    body_path.write_bytes(body(2, args.deadline_ms * 1000))
    wait = min(120.0, args.wait_quiet_s)  # before each measurement, a short wait for other sessions' work to pass
    wait_quiet(wait)
    log("part 2: the edge's capacity")
    edge = capacity("edge", system, body_path, {}, args, workdir)
    log(f"  {edge.rps:.1f} rps; the cloud's capacity")
    wait_quiet(wait)
    cloud = capacity("cloud", system, body_path, system.cloud_auth, args, workdir)
    log(f"  {cloud.rps:.1f} rps; the edge unloaded")
    wait_quiet(wait)
    unloaded = open_run(system, round(args.unloaded_share * edge.rps, 1), args.unloaded_s, args, workdir)
    rate = round(args.overload * edge.rps, 1)
    ceiling = client_ceiling(max(2000.0, 2 * rate), 3.0, workdir)
    log(f"  the overload: {rate:.1f} rps for {args.warmup_s:g} + {args.duration_s:g} s")
    wait_quiet(wait)
    loaded = open_run(system, rate, args.duration_s, args, workdir)
    profile = {}
    if args.profile_s:
        log(f"  py-spy on the edge and the control plane: {args.profile_s} s at {rate:.1f} rps")
        profile = profile_overload(system, rate, args.profile_s, args, workdir)
    rss = {name: vm_hwm(system.pid(name)) for name in ("edge", "cloud", "controlplane")}
    return Overload(edge, cloud, unloaded, ceiling, loaded, profile, rss)


def report(res: Results) -> str:
    args = res.args
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("onnxruntime", "uvicorn", "aiohttp"))
    wrk = subprocess.run(["wrk", "--version"], capture_output=True, text=True, check=False).stdout.splitlines()
    elapsed = (dt.datetime.now(dt.timezone.utc) - res.started).total_seconds() / 60
    code = f"code at commit {common.revision('controlplane', 'edge_agent')}"
    out = common.section_head(BEGIN, "Overflow: the edge, the gateway and a cloud backend (`bench/overflow.py`)",
                              res.command, started=res.started, minutes=elapsed, code=code)  # fmt: skip
    add = out.append
    computer = common.machine_words(common.machine(cpu_fallback=platform.processor()))
    add(f"- Machine: {computer}; load average {res.load_before} at the start, {loadavg()} at the end; before "
        f"starting, the machine was busy {res.quiet[0]:.2f} cores (after waiting {res.quiet[1]:.0f} s for quiet); "
        "the CPU lines below name what else ran (`other`)")  # fmt: skip
    add(f"- Software: Python {platform.python_version()}, {versions}, {nginx_version()}, "
        f"{(wrk[0] if wrk else 'wrk').split(' [')[0]}")  # fmt: skip
    preferred = "none" if args.max_batch < 8 else "the demo's up to the max"
    full = "512-4096-4096-1000, full" if args.model == "full" else "the slow mlp: 512-2048, 24 x 2048-2048, 1000"
    add(f"- Model: the demo's `mlp` with `max_batch_size: {args.max_batch}` (preferred batch sizes: {preferred}), "
        f"one instance, 3 priority levels (default 2; level 1-2 default timeout 100 ms); v1 ({full}) for the "
        "overload, v2 (512-1024-1024-1000, lite) for the overhead rounds")  # fmt: skip
    add(
        "- Every process on the same 2 cores, nothing pinned: the control plane (uvicorn, one process: REST API "
        "and gateway), the edge agent and the cloud agent (`spillway agent serve`, onnxruntime intra-op 1, "
        "inter-op 1, one executor thread each, event loop), nginx (one worker, idle but for part 1's rounds), "
        "the load generator (one asyncio process) and wrk (one thread, capacity runs only)"
    )
    add(f"- Edge agent: `role: edge`, `overflow: {{enabled: true, fraction: 0, gateway: <control plane>, "
        f"max_in_flight: {args.in_flight}}}` and the agent's default breaker (slow above 1 s, opens above 50 % "
        f"slow or failed in 10 s with >= 5 requests, for 5 s); the fallback cache on (its default, 8 MiB; never "
        f"hit here: every request has inputs of its own). Cloud agent: `role: cloud`, a bearer token, otherwise "
        f"the same. Backend: `max_concurrency: "
        f"{args.backend_concurrency}` (part 2; 1000 in part 1, so that it measures the proxy alone), "
        "`timeout_ms: 10000`, binary tensors, the cloud agent's token as its `auth_header`")  # fmt: skip
    add("")
    if res.overhead is not None:
        _report_overhead(res, add)
    if res.overload is not None:
        _report_overload(res, res.overload, add)
    add(END)
    return "\n".join(out)


def _report_overhead(res: Results, add: Any) -> None:
    args, data = res.args, res.overhead
    assert data is not None
    add("### 1. What the gateway adds, beside nginx")
    add("")
    add(f"`mlp` v2, one row, `POST /v2/models/mlp/versions/2/infer`: as JSON (512 FP32 in, the answer 1000 FP32 as "
        f"JSON) and as binary tensors (2 KiB in, 4000 bytes out). Closed loop over keep-alive connections from one "
        f"asyncio process, {args.overhead_requests} requests per block, blocks in the order direct, nginx, gateway "
        f"within each of {args.overhead_rounds} rounds (after one warm-up round not kept); p50/p99 over every "
        f"request of all rounds, and the median of the rounds' medians. Direct and nginx send the cloud agent's "
        f"token; the gateway gets the edge agent's and sends the backend's `auth_header`. Round-trip time as the "
        f"client sees it, its own cost included (the same for all three). CPU during the rounds (cores): "
        + cpu_words(data["_cpu"]) + ". CPU per request through a proxy (its process's CPU over the rounds / "
        "the requests it carried, warm-up round included): "
        + ", ".join(f"{proxy} {data['_cpu'][process] * data['_wall_s'] / data['requests'][proxy] * 1e6:.0f} us"
                    for proxy, process in (("gateway", "controlplane"), ("nginx", "nginx")))
        + f". Answers other than 200 (not timed): {data['failed'] or 'none'}.")  # fmt: skip
    add("")
    add(
        "| request | concurrency | path | p50 (ms) | p99 (ms) | median of round medians (ms) | added p50 vs direct "
        "(ms) | p50 / direct p50 |"
    )
    add("|---|---:|---|---:|---:|---:|---:|---:|")
    added: dict[tuple[str, int, str], float] = {}
    for kind in ("JSON", "binary"):
        for concurrency in (1, args.overhead_concurrency):
            base = data.get(f"{kind}|{concurrency}|direct")
            if base is None:
                continue
            base_p50 = median(base["all"]) / 1e3
            for target in ("direct", "nginx", "gateway"):
                cell = data[f"{kind}|{concurrency}|{target}"]
                p50 = median(cell["all"]) / 1e3
                p99 = (percentile(cell["all"], 99) or 0) / 1e3
                rounds = median(cell["rounds"]) / 1e3
                extra = "" if target == "direct" else f"{p50 - base_p50:+.3f}"
                added[(kind, concurrency, target)] = p50 - base_p50
                add(f"| {kind} | {concurrency} | {target} | {p50:.3f} | {p99:.3f} | {rounds:.3f} | {extra} "
                    f"| {p50 / base_p50:.2f} |")  # fmt: skip
    add("")
    add("| target | measured | reached |")
    add("|---|---|---|")
    for (kind, concurrency, target), value in added.items():
        if target != "gateway":
            continue
        nginx = added[(kind, concurrency, "nginx")]
        add(f"| gateway adds <= 1 ms at p50 ({kind}, concurrency {concurrency}) | {value:+.3f} ms (nginx "
            f"{nginx:+.3f} ms; gateway / nginx {value / nginx if nginx > 0 else float('nan'):.1f}x) "
            f"| {'yes' if value <= 1.0 else 'no'} |")  # fmt: skip
    add("")


def _report_overload(res: Results, ov: Overload, add: Any) -> None:
    args = res.args
    loaded, unloaded = ov.loaded, ov.unloaded
    edge_cap, cloud_cap = ov.capacity_edge, ov.capacity_cloud
    both = edge_cap.rps + cloud_cap.rps
    add(f"### 2. {args.overload:g}x the edge's capacity, {args.high_share * 100:g} % at priority 1")
    add("")
    add(f"Capacity: `wrk -t1 -c{args.capacity_concurrency}` with a priority-2 request (one row of JSON, `timeout` "
        f"{args.deadline_ms * 1000} us), {args.warmup_s:g} s warm-up then {args.capacity_s:g} s, against each agent "
        "alone (the other idle); capacity counts 2xx answers only.")  # fmt: skip
    add("")
    add("| agent | capacity: 2xx answers (rps) | p50 (ms) | p99 (ms) | non-2xx / socket errors | CPU (cores) |")
    add("|---|---:|---:|---:|---|---|")
    for name, cap in (("edge", edge_cap), ("cloud", cloud_cap)):
        w = cap.wrk
        add(f"| {name} | {cap.rps:.1f} | {w.p50_ms:.2f} | {w.p99_ms:.2f} | {w.non_2xx} / {w.socket_errors} "
            f"| {cpu_words(cap.cpu)} |")  # fmt: skip
    add("")
    if ov.ceiling:
        c = ov.ceiling
        add(f"The open-loop client against a no-op server (`bench/load.py`'s) at {c['rate']:.0f} rps for "
            f"{c['seconds']:g} s: {c['answered']} of {c['sent']} answered, p99 {c['p99_ms']:.2f} ms, sent at most "
            f"{c['max_lag_ms']:.1f} ms after due, {c['cpu_us']:.0f} us of CPU per request.")  # fmt: skip
        add("")
    add(f"Open loop (one asyncio process; latency from when each request was due, so a client that falls behind "
        f"counts against the server), every request with `timeout` {args.deadline_ms * 1000} us (its deadline), "
        f"priority 1 with probability {args.high_share:g}, else 2, inputs of its own (the first value is its "
        f"number, so no answer can come from the fallback cache, as with real traffic); {args.warmup_s:g} s "
        f"warm-up, then {loaded.duration_s:g} s measured (unloaded: {unloaded.rate:.0f} rps for "
        f"{unloaded.duration_s:g} s). Goodput: answered 200 within the deadline by the model itself, locally "
        f"(`local`) or in the cloud (`overflow`).")  # fmt: skip
    add("")
    sent = len(loaded.records)
    outcomes = Counter((r[1], r[2]) for r in loaded.records)
    good = sum(1 for r in loaded.records if r[1] == 200 and r[2] in GOOD and r[3] <= args.deadline_ms * 1000)
    with_outcome = sum(1 for r in loaded.records if r[1] > 0 and r[2])
    lost = sent - with_outcome
    goodput = good / loaded.duration_s
    add(
        "| offered (rps) | goodput (rps) | edge capacity (rps) | cloud capacity (rps) | goodput / (edge + cloud) "
        "| sent | answered with an outcome | lost |"
    )
    add("|---:|---:|---:|---:|---:|---:|---:|---:|")
    add(
        f"| {loaded.rate:.1f} | {goodput:.1f} | {edge_cap.rps:.1f} | {cloud_cap.rps:.1f} | "
        f"**{goodput / both * 100:.1f} %** | {sent} | {with_outcome} | {lost} |"
    )
    add("")
    add("| status | outcome | answers | share | rps | within the deadline |")
    add("|---:|---|---:|---:|---:|---:|")
    for (status, outcome), n in sorted(outcomes.items(), key=lambda kv: -kv[1]):
        label = {0: "connection failed", -1: "no answer"}.get(status, str(status))
        within = sum(1 for r in loaded.records if (r[1], r[2]) == (status, outcome)
                     and r[3] <= args.deadline_ms * 1000)  # fmt: skip
        within_text = f"{within / n * 100:.1f} %" if status > 0 else "-"
        add(f"| {label} | {outcome or '(none)'} | {n} | {n / sent * 100:.1f} % | {n / loaded.duration_s:.1f} "
            f"| {within_text} |")  # fmt: skip
    add("")
    add(
        "| priority | share of requests | served (local or overflow) | unloaded p50 (ms) | unloaded p99 (ms) "
        "| loaded p50 (ms) | loaded p99 (ms) | loaded p99, local (ms) | loaded p99, overflow (ms) "
        "| loaded p99 / unloaded p99 |"
    )
    add("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    for level in (1, 2):
        count = sum(1 for r in loaded.records if r[0] == level)
        u, lo = unloaded.latencies_ms(level, GOOD), loaded.latencies_ms(level, GOOD)
        u99, l99 = percentile(u, 99), percentile(lo, 99)
        ratios[level] = (l99 / u99) if u99 and l99 else None
        add(
            f"| {level} | {count / max(1, sent) * 100:.1f} % | {len(lo) / max(1, count) * 100:.1f} % "
            f"| {_f(percentile(u, 50))} | {_f(u99)} | {_f(percentile(lo, 50))} | {_f(l99)} "
            f"| {_f(percentile(loaded.latencies_ms(level, ('local',)), 99))} "
            f"| {_f(percentile(loaded.latencies_ms(level, ('overflow',)), 99))} | {_f(ratios[level])} |"
        )
    add("")
    add(
        "Latency percentiles are over the answers that are the model's own (status 200, outcome `local` or "
        f"`overflow`), from when the request was due. Unloaded ({unloaded.rate:.0f} rps): "
        + _outcome_words(unloaded)
        + "."
    )
    add("")
    fwd0 = loaded.edge_before.get("overflow") or {}
    fwd1 = loaded.edge_after.get("overflow") or {}
    failed = Counter(fwd1.get("failed", {})) - Counter(fwd0.get("failed", {}))
    add(f"The edge's forwarder during the run (warm-up included): {fwd1.get('sent', 0) - fwd0.get('sent', 0)} sent "
        f"to the gateway, {fwd1.get('answered', 0) - fwd0.get('answered', 0)} answered 200, not forwarded or "
        f"failed: {dict(failed) or 'none'}; breaker at the end: {(fwd1.get('breaker') or {}).get('state', '?')}. "
        "The gateway's backend at the end: "
        + "; ".join(f"{b['name']}: {b['requests']} requests, {b['errors']} errors, ejected {b['ejected']} "
                    f"(times {b['times_ejected']}), p50 {_f(b['p50_ms'])} ms, p99 {_f(b['p99_ms'])} ms"
                    for b in loaded.gateway_after) + ".")  # fmt: skip
    add("")
    main = loaded.client.get("main_thread_cores", {})
    add("CPU during the overload (cores, of 2; warm-up included): "
        + ", ".join(f"{k} {v:.2f}" for k, v in loaded.cpu.items())
        + "; of which the agents' main thread (uvicorn's event loop: HTTP, decoding, admission, overflow, answers): "
        + ", ".join(f"{k} {main[k]:.2f}" for k in ("edge", "cloud") if k in main)
        + " (the rest is mostly the inference executor)"
        + f". Client: at most {loaded.client['connections']} connections, sent at most "
        f"{loaded.client['max_send_lag_ms']:.1f} ms after due. Peak RSS: "
        + ", ".join(f"{k} {v / (1 << 20):.0f} MiB" for k, v in ov.peak_rss.items()) + ".")  # fmt: skip
    add("")
    add("| target | measured | reached |")
    add("|---|---|---|")
    ratio = goodput / both
    add(
        f"| goodput >= 90 % of local + cloud capacity | {goodput:.1f} / ({edge_cap.rps:.1f} + {cloud_cap.rps:.1f}) "
        f"= **{ratio * 100:.1f} %** | {'yes' if ratio >= 0.9 else 'no'} |"
    )
    r1 = ratios[1]
    add(
        f"| priority 1 p99 <= 2x unloaded | {_f(percentile(loaded.latencies_ms(1, GOOD), 99))} / "
        f"{_f(percentile(unloaded.latencies_ms(1, GOOD), 99))} ms = **{_f(r1)}x** | "
        f"{'yes' if r1 is not None and r1 <= 2 else 'no'} |"
    )
    add(
        f"| lost = 0 | {sent} sent, {with_outcome} answered with an outcome: **{lost} lost** "
        f"| {'yes' if lost == 0 else 'no'} |"
    )
    add("")
    if ov.profile:
        _report_profile(res, ov, add)


def _report_profile(res: Results, ov: Overload, add: Any) -> None:
    args = res.args
    add(f"#### Where the time goes at {args.overload:g}x (py-spy)")
    add("")
    add(f"`py-spy record --nonblocking --threads -r 200 -d {args.profile_s} --format raw` on the edge agent and the "
        f"control plane at once, during another open-loop run at the same rate (after {2 * args.warmup_s:g} s). "
        "Self time: the innermost frame; samples of idle threads are not taken.")  # fmt: skip
    add("")
    add("| process | thread | function (self time) | samples | share of the process's samples |")
    add("|---|---|---|---:|---:|")
    for name, summary in ov.profile.items():
        for top in summary["top"][:10]:
            add(f"| {name} | {top['thread']} | `{top['function']}` | {top['samples']} | {top['share'] * 100:.1f}% |")
    for name, summary in ov.profile.items():
        for thread, data in summary["threads"].items():
            if not thread.startswith("event loop"):
                continue
            add("")
            add(f"{name}, inclusive time on the {thread} thread ({data['samples']} samples of "
                f"{summary['expected_per_thread']} if always busy):")  # fmt: skip
            add("")
            add("| function | samples | share of the thread's samples |")
            add("|---|---:|---:|")
            for function, n in data["inclusive"][:10]:
                add(f"| `{function}` | {n} | {n / data['samples'] * 100:.1f}% |")
    add("")


def _outcome_words(run: OpenRun) -> str:
    counts = Counter(f"{r[1]} {r[2] or '(no outcome)'}" for r in run.records)
    return ", ".join(f"{k}: {v}" for k, v in counts.most_common())


# ---- main -----------------------------------------------------------------------------------------


def run(args: argparse.Namespace, command: str) -> str:
    require_nginx()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: `apt-get install -y wrk` (the capacity runs use it)")
    _terminate_on_sigterm()
    quiet = wait_quiet(args.wait_quiet_s)
    started, load_before = dt.datetime.now(dt.timezone.utc), loadavg()
    workdir = Path(tempfile.mkdtemp(prefix="spillway-bench-overflow-"))
    procs = Processes(workdir)
    with procs.session():
        system = start_system(procs, workdir, args)
        res = Results(command, started, load_before, system, args, quiet=quiet)
        with reverse_proxy("127.0.0.1", url_parts(system.cloud)[1], workdir) as (nginx, nginx_pid):
            system.nginx, system.nginx_pid = nginx, nginx_pid
            if not args.skip_overhead:
                wait_quiet(min(120.0, args.wait_quiet_s))
                log("part 1: direct, nginx and gateway in interleaved rounds")
                res.overhead = overhead(system, args, workdir)
        if not args.skip_overload:
            set_backend_cap(system, args.backend_concurrency)
            res.overload = overload(system, args, workdir)
        markdown = report(res)
    return markdown


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_client"]:
        _client_main(argv[1], argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="put the tables into docs/benchmarks.md")
    parser.add_argument("--quick", action="store_true", help="short points: a smoke test, not a result")
    parser.add_argument("--max-batch", type=int, default=1, help="the bench model's max_batch_size")
    parser.add_argument(
        "--model",
        choices=("slow", "full"),
        default="slow",
        help="version 1 of mlp: slow (~20 ms a request, build_slow_mlp) or the demo's full (~7 ms)",
    )
    parser.add_argument("--overload", type=float, default=3.0, help="offered load, in multiples of the edge's capacity")
    parser.add_argument("--high-share", type=float, default=0.2, help="share of requests at priority 1")
    parser.add_argument("--deadline-ms", type=int, default=100, help="every request's `timeout`")
    parser.add_argument("--in-flight", type=int, default=16, help="the edge's overflow.max_in_flight")
    parser.add_argument("--backend-concurrency", type=int, default=4, help="the backend's max_concurrency")
    parser.add_argument("--duration-s", type=float, default=15.0, help="measured seconds of the overload")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--capacity-s", type=float, default=8.0)
    parser.add_argument("--capacity-concurrency", type=int, default=4)
    parser.add_argument("--unloaded-share", type=float, default=0.25, help="unloaded rate, share of the capacity")
    parser.add_argument("--unloaded-s", type=float, default=8.0)
    parser.add_argument("--overhead-rounds", type=int, default=10)
    parser.add_argument("--overhead-requests", type=int, default=200, help="requests per block")
    parser.add_argument("--overhead-concurrency", type=int, default=8)
    parser.add_argument("--wait-quiet-s", type=float, default=600,
                        help="wait at most this long for an idle machine (at most 120 s before each part)")  # fmt: skip
    parser.add_argument("--profile-s", type=int, default=8, help="py-spy during another overload run (0: none)")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-overload", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration_s, args.warmup_s, args.capacity_s, args.unloaded_s = 4.0, 1.0, 3.0, 3.0
        args.overhead_rounds, args.overhead_requests, args.profile_s = 2, 50, 3
    command = shlex.join([".venv/bin/python", "bench/overflow.py", *argv])
    markdown = run(args, command)
    print(markdown)
    if args.write:
        common.write_docs(markdown, BEGIN, END)


if __name__ == "__main__":
    main()
