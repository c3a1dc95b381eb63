"""Issue 3's benchmark: the edge agent against a naive server and MLServer, side by side on `mlp` version 1.

One invocation, one load generator, every server running at once (idle while another is measured):

  (a) the agent, `spillway agent serve`, once per intra-op thread setting (`--agent-threads 1,2`);
  (b) `bench/naive_server.py`: FastAPI + onnxruntime on uvicorn, one `session.run` per request;
  (c) MLServer with adaptive batching and the small onnxruntime runtime in `bench/mlserver/`, installed into
      its own virtual environment (`bench/.mlserver-venv`, made on first use: its FastAPI pin clashes with ours).

Closed loop: wrk (`-t1`, so one core stays with the server) at each concurrency, a warm-up run then a measured
run per point, servers alternating within each concurrency (A B C D), the whole sweep repeated `--rounds`
times; a point counts only with zero non-2xx answers and zero socket errors. Open loop: `bench/load.py` at
fixed rates, after measuring what that client sustains against a no-op server. Then, on `mlp` version 2 at
concurrency 1, the agent's round trip p50 minus the raw in-process `session.run` p50 (same thread settings);
the agent's peak RSS (VmHWM) beside the model files; and a py-spy profile of the agent at concurrency 64.

The results go between markers in `docs/benchmarks.md` (text outside the markers is kept) and to stdout.

    .venv/bin/python bench/batching.py            # the full run, about 12 minutes
    .venv/bin/python bench/batching.py --quick    # short points, one round: a smoke test, not a result
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from bench.common import VENV_BIN, WrkResult, free_port, http_json, log, median, run_wrk, write_lua  # noqa: E402
from bench.load import OpenLoopResult, ceiling, run_open_subprocess, start_noop_server  # noqa: E402
from bench.mlserver_venv import MLSERVER_VENV, ensure_mlserver_venv  # noqa: E402
from bench.naive_server import session_options  # noqa: E402
from bench.procstat import cpu_seconds, loadavg, machine_busy_seconds, vm_hwm  # noqa: E402
from spillway.demo.harness import Process  # noqa: E402

BEGIN = "<!-- bench/batching.py: begin (generated; edit outside these markers) -->"
END = "<!-- bench/batching.py: end -->"
MiB = 1 << 20


# ---- processes ------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """pid and every process below it (MLServer's inference workers, if any)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children[ppid].append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


@dataclass
class Server:
    key: str
    label: str
    kind: str  # agent | naive | mlserver
    port: int
    proc: Process
    log_path: Path
    threads: str  # the thread budget, in words
    intra_op_threads: int
    stats_file: Path | None = None

    def url(self, version: int = 1) -> str:
        return f"http://127.0.0.1:{self.port}/v2/models/mlp/versions/{version}/infer"

    def pids(self) -> list[int]:
        return descendants(self.proc.pid)

    def cpu(self) -> float:
        return cpu_seconds(self.pids())

    def peak_rss(self) -> int:
        return sum(vm_hwm(pid) for pid in self.pids())

    def batches(self) -> tuple[int, int] | None:
        """(executions, rows) so far, where the server tells."""
        if self.kind == "agent":
            stats = http_json("GET", f"http://127.0.0.1:{self.port}/v2/models/mlp/versions/1/stats")["model_stats"][0]
            return int(stats["execution_count"]), int(stats["inference_count"])
        if self.kind == "mlserver" and self.stats_file is not None:
            text = self.stats_file.read_text().strip() if self.stats_file.exists() else ""
            executions, rows = (int(v) for v in text.split()) if text else (0, 0)
            return executions, rows
        return None

    def stop(self) -> None:
        self.proc.stop()

    def wait_ready(self, timeout_s: float = 300) -> None:
        self.proc.wait_ready(f"http://127.0.0.1:{self.port}/v2/health/ready", timeout_s=timeout_s, interval_s=0.3)


def start_process(name: str, cmd: list[str], log_path: Path, cwd: Path | None = None,
                  env: dict[str, str] | None = None) -> Process:  # fmt: skip
    """In its own process group: stopped as a whole (SIGTERM, SIGKILL after 20 s), and only what this script
    started."""
    return Process.start(cmd, name=name, log=log_path, append=False, cwd=cwd, env=env, group=True, grace_s=20)


def start_agent(repo: Path, work: Path, threads: int) -> Server:
    port = free_port()
    config = work / f"agent-{threads}t.yaml"
    config.write_text(
        f"model_repository: {repo}\nhost: 127.0.0.1\nport: {port}\nintra_op_threads: {threads}\ninter_op_threads: 1\n"
    )
    log_path = work / f"agent-{threads}t.log"
    cmd = [str(VENV_BIN / "spillway"), "agent", "serve", "--config", str(config), "--log-level", "warning"]
    label = f"agent (intra {threads})"
    proc = start_process(label, cmd, log_path)
    words = f"onnxruntime intra-op {threads}, inter-op 1, no spinning; 1 instance (1 executor thread); event loop"
    return Server(f"agent-{threads}t", label, "agent", port, proc, log_path, words, threads)


def start_naive(model: Path, work: Path, threads: int) -> Server:
    port = free_port()
    log_path = work / "naive.log"
    cmd = [
        sys.executable,
        str(BENCH / "naive_server.py"),
        "--model",
        str(model),
        "--port",
        str(port),
        "--intra-op-threads",
        str(threads),
    ]
    label = f"naive (intra {threads})"
    proc = start_process(label, cmd, log_path)
    words = f"onnxruntime intra-op {threads}, inter-op 1, no spinning; Starlette thread pool (40); event loop"
    return Server("naive", label, "naive", port, proc, log_path, words, threads)


def start_mlserver(model: Path, work: Path, threads: int, workers: int, max_batch: int) -> Server:
    """MLServer from a copy of bench/mlserver/ with this run's ports, model path and thread settings."""
    mlserver = ensure_mlserver_venv()
    key = f"mlserver-w{workers}-{threads}t-b{max_batch}"
    folder = work / key
    folder.mkdir()
    shutil.copy(BENCH / "mlserver" / "runtime.py", folder / "runtime.py")
    port = free_port()
    settings = json.loads((BENCH / "mlserver" / "settings.json").read_text())
    settings.update(http_port=port, grpc_port=free_port(), metrics_port=free_port(), parallel_workers=workers)
    (folder / "settings.json").write_text(json.dumps(settings, indent=2))
    model_settings = json.loads((BENCH / "mlserver" / "model-settings.json").read_text())
    stats_file = folder / "batches.txt"
    model_settings["max_batch_size"] = max_batch
    model_settings["parameters"]["uri"] = str(model)
    model_settings["parameters"]["extra"] = {"intra_op_threads": threads, "stats_file": str(stats_file)}
    (folder / "model-settings.json").write_text(json.dumps(model_settings, indent=2))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{MLSERVER_VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    log_path = work / f"{key}.log"
    label = f"MLServer (workers {workers}, intra {threads}, batch {max_batch})"
    proc = start_process(label, [str(mlserver), "start", str(folder)], log_path, cwd=folder, env=env)
    batch_ms = model_settings["max_batch_time"] * 1e3
    words = (
        f"onnxruntime intra-op {threads}, inter-op 1, no spinning; 1 executor thread; parallel_workers "
        f"{workers}; adaptive batching max_batch_size {max_batch}, max_batch_time {batch_ms:g} ms"
    )
    return Server(key, label, "mlserver", port, proc, log_path, words, threads, stats_file)


# ---- measurements ---------------------------------------------------------------------------------


@dataclass
class Point:
    server: str
    concurrency: int
    round: int
    wrk: WrkResult
    executions: int | None
    rows: int | None
    server_cpu_cores: float
    peak_rss: int
    other_cpu_cores: float  # busy CPU of everything else on the machine (not this server, not wrk): the noise


def closed_point(server: Server, lua: Path, concurrency: int, warmup_s: int, seconds: int, rnd: int) -> Point:
    run_wrk(server.url(), lua, concurrency, warmup_s)
    before = server.batches()
    busy0, cpu0, t0 = machine_busy_seconds(), server.cpu(), time.monotonic()
    result = run_wrk(server.url(), lua, concurrency, seconds)
    busy1, cpu1, t1 = machine_busy_seconds(), server.cpu(), time.monotonic()
    after = server.batches()
    executions = rows = None
    if before is not None and after is not None:
        executions, rows = after[0] - before[0], after[1] - before[1]
    wall = t1 - t0
    other = max(0.0, (busy1 - busy0) - (cpu1 - cpu0) - result.client_cpu_s) / wall
    return Point(server.key, concurrency, rnd, result, executions, rows, (cpu1 - cpu0) / wall, server.peak_rss(), other)


@dataclass
class OpenPoint:
    server: str
    result: OpenLoopResult
    executions: int | None
    rows: int | None
    server_cpu_cores: float


def open_point(server: Server, body: Path, rate: float, warmup_s: float, seconds: float) -> OpenPoint:
    before = server.batches()
    cpu0, t0 = server.cpu(), time.monotonic()
    result = run_open_subprocess(server.url(), body, rate, seconds, warmup_s)
    cpu1, t1 = server.cpu(), time.monotonic()
    after = server.batches()
    executions = rows = None
    if before is not None and after is not None:
        executions, rows = after[0] - before[0], after[1] - before[1]
    return OpenPoint(server.key, result, executions, rows, (cpu1 - cpu0) / (t1 - t0))


def raw_run_p50(model: Path, threads: int, x: np.ndarray, runs: int) -> tuple[float, list[float]]:
    """In-process `session.run` with the agent's session options; p50 in ms and all samples."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), session_options(threads), providers=["CPUExecutionProvider"])
    feeds = {"input": x}
    for _ in range(200):
        session.run(None, feeds)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        samples.append((time.perf_counter() - start) * 1e3)
    return median(samples), samples


def profile_agent(server: Server, lua: Path, seconds: int, out: Path) -> tuple[WrkResult, Path]:
    """py-spy (non-blocking, all active threads) on the agent while wrk holds concurrency 64."""
    if not common.PY_SPY.exists():
        raise RuntimeError("py-spy is missing: .venv/bin/pip install py-spy")
    raw = out / f"py-spy-{server.key}.txt"
    wrk_proc = subprocess.Popen(
        common.wrk_command(server.url(), lua, 64, seconds + 4), stdout=subprocess.PIPE, text=True
    )
    time.sleep(2)
    subprocess.run(common.py_spy_command(server.proc.pid, seconds, raw), check=True, capture_output=True)
    stdout, _ = wrk_proc.communicate(timeout=seconds + 60)
    return common.wrk_result(stdout), raw


# ---- the run --------------------------------------------------------------------------------------


def machine_info() -> dict[str, str]:
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.splitlines()[0]
    return {
        **common.machine(nproc=nproc),
        "commit": common.revision("edge_agent"),
        "onnxruntime": importlib.metadata.version("onnxruntime"),
        "uvicorn": importlib.metadata.version("uvicorn"),
        "fastapi": importlib.metadata.version("fastapi"),
        "wrk": wrk_version.strip(),
    }


def make_bodies(work: Path, x: np.ndarray) -> dict[str, Path]:
    """The one request every server gets: V2 JSON, one row of 512 FP32; and the binary-extension variant."""
    data = [float(f"{v:.6g}") for v in x.ravel()]
    body = {"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": data}]}
    json_path = work / "body.json"
    json_path.write_text(json.dumps(body, separators=(",", ":")))
    raw = x.astype("<f4").tobytes()
    header = {
        "inputs": [
            {"name": "input", "shape": [1, 512], "datatype": "FP32", "parameters": {"binary_data_size": len(raw)}}
        ],
        "parameters": {"binary_data_output": True},
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    binary_path = work / "body.bin"
    binary_path.write_bytes(header_bytes + raw)
    (work / "body.bin.header-length").write_text(str(len(header_bytes)))
    return {"json": json_path, "binary": binary_path}


def check_outputs(server: Server, body: Path, expected: np.ndarray, version: int = 1) -> None:
    answer = http_json("POST", server.url(version), body.read_bytes())
    output = answer["outputs"][0]
    got = np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])
    if not np.allclose(got, expected, rtol=1e-5, atol=1e-5):
        raise RuntimeError(f"{server.label}: outputs differ from onnxruntime's (max {np.abs(got - expected).max()})")


@dataclass
class Settings:
    quick: bool
    rounds: int
    warmup_s: int
    seconds: int
    concurrency: list[int]
    rates: list[float]
    open_warmup_s: float
    open_seconds: float
    overhead_seconds: int
    profile_seconds: int
    agent_threads: list[int]
    naive_threads: int
    mlserver_workers: list[int]
    mlserver_threads: int
    mlserver_batch: list[int]
    out: Path
    profile: bool = True
    argv: list[str] = field(default_factory=list)


def parse_args(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short points and one round (a smoke test)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--rounds", type=int, help="closed-loop sweeps (default 2; quick 1)")
    parser.add_argument("--seconds", type=int, help="measured seconds per closed-loop point (default 8; quick 3)")
    parser.add_argument("--warmup", type=int, help="warm-up seconds per point (default 2; quick 1)")
    parser.add_argument("--concurrency", default="1,8,32,64,128")
    parser.add_argument("--rates", default="100,300,600", help="open-loop rates (requests/s)")
    parser.add_argument("--agent-threads", default="1,2", help="agent intra_op_threads settings to run")
    parser.add_argument("--naive-threads", type=int, default=1)
    parser.add_argument("--mlserver-workers", default="0", help="MLServer parallel_workers settings to run")
    parser.add_argument("--mlserver-threads", type=int, default=2)
    parser.add_argument("--mlserver-batch", default="32,64", help="MLServer max_batch_size settings to run")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args(argv)
    quick = args.quick
    return Settings(
        quick=quick,
        rounds=args.rounds or (1 if quick else 2),
        warmup_s=args.warmup or (1 if quick else 2),
        seconds=args.seconds or (3 if quick else 8),
        concurrency=[int(c) for c in args.concurrency.split(",")],
        rates=[float(r) for r in args.rates.split(",")],
        open_warmup_s=1.0 if quick else 2.0,
        open_seconds=3.0 if quick else 8.0,
        overhead_seconds=3 if quick else 8,
        profile_seconds=4 if quick else 10,
        agent_threads=[int(t) for t in args.agent_threads.split(",")],
        naive_threads=args.naive_threads,
        mlserver_workers=[int(w) for w in args.mlserver_workers.split(",")],
        mlserver_threads=args.mlserver_threads,
        mlserver_batch=[int(b) for b in args.mlserver_batch.split(",")],
        out=args.out,
        profile=not args.no_profile,
        argv=argv,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    settings = parse_args(argv)
    if shutil.which("wrk") is None:
        print(
            "error: wrk is not installed. On Debian/Ubuntu: apt-get update && apt-get install -y wrk", file=sys.stderr
        )
        return 2
    started = dt.datetime.now(dt.timezone.utc)
    t_start = time.monotonic()
    info = machine_info()
    info["loadavg_start"] = loadavg()
    info["bench_lock"] = "present" if Path("/tmp/bench.lock").exists() else "absent"
    ensure_mlserver_venv()
    info["mlserver"] = subprocess.run(
        [str(MLSERVER_VENV / "bin" / "mlserver"), "--version"], capture_output=True, text=True
    ).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="spillway-bench-"))
    log(f"work folder {work}")
    repo = work / "models"
    subprocess.run(
        [str(VENV_BIN / "spillway"), "models", "build-demo", "--out", str(repo)], check=True, capture_output=True
    )
    v1, v2 = repo / "mlp" / "1" / "model.onnx", repo / "mlp" / "2" / "model.onnx"
    x = np.random.default_rng(7).standard_normal((1, 512)).astype(np.float32)
    x = np.asarray([[float(f"{v:.6g}") for v in x.ravel()]], dtype=np.float32)
    bodies = make_bodies(work, x)
    header_length = (work / "body.bin.header-length").read_text()
    lua_json = write_lua(work / "json.lua", bodies["json"], {"Content-Type": "application/json"})
    lua_binary = write_lua(
        work / "binary.lua",
        bodies["binary"],
        {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": header_length},
    )

    import onnxruntime as ort

    expected = {
        v: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
        for v, p in ((1, v1), (2, v2))
    }

    servers: list[Server] = []
    results: dict[str, Any] = {"machine": info, "settings": {k: str(v) for k, v in asdict(settings).items()}}
    try:
        for threads in settings.agent_threads:
            servers.append(start_agent(repo, work, threads))
            servers[-1].wait_ready()
        servers.append(start_naive(v1, work, settings.naive_threads))
        servers[-1].wait_ready()
        for workers in settings.mlserver_workers:
            for max_batch in settings.mlserver_batch:
                servers.append(start_mlserver(v1, work, settings.mlserver_threads, workers, max_batch))
                servers[-1].wait_ready()
        for server in servers:
            check_outputs(server, bodies["json"], expected[1])
            log(f"{server.label} ready on port {server.port}, pid {server.proc.pid}; outputs match onnxruntime")
        for server in servers:
            if server.kind == "agent":
                check_outputs(server, bodies["json"], expected[2], version=2)
        time.sleep(2)
        idle = {s.key: s.cpu() for s in servers}
        time.sleep(2)
        idle_cores = {s.key: (s.cpu() - idle[s.key]) / 2 for s in servers}
        results["idle_cpu_cores"] = idle_cores

        # Closed loop: per round, per concurrency, every server in turn (the order reversed every other round).
        points: list[Point] = []
        for rnd in range(settings.rounds):
            for concurrency in settings.concurrency:
                order = servers if rnd % 2 == 0 else list(reversed(servers))
                for server in order:
                    point = closed_point(server, lua_json, concurrency, settings.warmup_s, settings.seconds, rnd)
                    points.append(point)
                    batch = f", batch {point.rows / point.executions:.1f}" if point.executions else ""
                    log(
                        f"round {rnd + 1} c={concurrency:<3} {server.label:<40} {point.wrk.rps:8.1f} rps "
                        f"p50 {point.wrk.p50_ms:7.2f} p99 {point.wrk.p99_ms:7.2f} ms{batch} "
                        f"cpu {point.server_cpu_cores:.2f}{'' if point.wrk.valid else ' INVALID'}"
                    )
        results["closed"] = [asdict(p) for p in points]
        closed = aggregate(points, servers)
        agents = [s for s in servers if s.kind == "agent"]
        primary = max(agents, key=lambda s: closed[(s.key, 64)]["rps"] if (s.key, 64) in closed else 0)

        # Open loop: the client's own ceiling first, then each rate across the primary agent and the peers.
        log("open loop: the client's ceiling against a no-op server")
        ceiling_rates = [1000.0, 4000.0] if settings.quick else [1000.0, 4000.0, 8000.0]
        client = ceiling(ceiling_rates, 3.0 if settings.quick else 4.0, bodies["json"].read_bytes())
        results["client_ceiling"] = [asdict(c) for c in client]
        mlservers = [s for s in servers if s.kind == "mlserver"]
        best_mlserver = max(mlservers, key=lambda s: closed[(s.key, 64)]["rps"] if (s.key, 64) in closed else 0)
        open_servers = [primary] + [s for s in servers if s.kind == "naive"] + [best_mlserver]
        open_points: dict[tuple[str, float], OpenPoint] = {}
        for rate in settings.rates:
            for server in open_servers:
                op = open_point(server, bodies["json"], rate, settings.open_warmup_s, settings.open_seconds)
                open_points[(server.key, rate)] = op
                r = op.result
                log(
                    f"open {rate:6.0f} rps {server.label:<40} answered {r.throughput_rps:7.1f} p50 {r.p50_ms} "
                    f"p99 {r.p99_ms} ms non2xx {r.non_2xx} errors {r.conn_errors} unfinished {r.unfinished}"
                )
        results["open"] = [asdict(p) for p in open_points.values()]

        # Overhead on v2 at concurrency 1: raw session.run p50 (before and after), agent round trips between.
        overhead: dict[str, Any] = {}
        noop_port = free_port()
        with start_noop_server(noop_port):
            floor = run_wrk(f"http://127.0.0.1:{noop_port}/noop", lua_json, 1, settings.overhead_seconds)
        overhead["noop_floor_p50_ms"] = floor.p50_ms
        for agent in agents:
            raw_before, samples_before = raw_run_p50(v2, agent.intra_op_threads, x, 3000)
            run_wrk(agent.url(2), lua_json, 1, settings.warmup_s)
            trip_json = run_wrk(agent.url(2), lua_json, 1, settings.overhead_seconds)
            trip_binary = run_wrk(agent.url(2), lua_binary, 1, settings.overhead_seconds)
            raw_after, samples_after = raw_run_p50(v2, agent.intra_op_threads, x, 3000)
            raw_p50 = median(samples_before + samples_after)
            overhead[agent.key] = {
                "raw_p50_ms": raw_p50,
                "raw_p50_before_ms": raw_before,
                "raw_p50_after_ms": raw_after,
                "json": asdict(trip_json),
                "binary": asdict(trip_binary),
                "overhead_json_ms": trip_json.p50_ms - raw_p50,
                "overhead_binary_ms": trip_binary.p50_ms - raw_p50,
            }
            log(
                f"v2 c=1 {agent.label}: raw p50 {raw_p50:.3f} ms; round trip p50 JSON {trip_json.p50_ms:.3f} "
                f"binary {trip_binary.p50_ms:.3f} ms (no-op floor {floor.p50_ms:.3f})"
            )
        results["overhead"] = overhead

        profile = None
        if settings.profile:
            log(f"py-spy on {primary.label} at c=64 for {settings.profile_seconds} s")
            wrk_during, raw = profile_agent(primary, lua_json, settings.profile_seconds, work)
            profile = common.summarise_profile(raw, settings.profile_seconds)
            profile["raw"] = str(raw)
            profile["wrk_during"] = asdict(wrk_during)
            results["profile"] = profile

        rss = {s.key: s.peak_rss() for s in servers}
        results["peak_rss"] = rss
        model_sizes = {"v1": v1.stat().st_size, "v2": v2.stat().st_size}
        results["model_sizes"] = model_sizes
        info["loadavg_end"] = loadavg()
        elapsed = time.monotonic() - t_start
        (work / "results.json").write_text(json.dumps(results, indent=2, default=str))
        markdown = render(
            settings,
            info,
            started,
            elapsed,
            servers,
            primary,
            closed,
            open_points,
            client,
            overhead,
            profile,
            rss,
            model_sizes,
            idle_cores,
            work,
        )
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(repo, ignore_errors=True)  # the generated models; results, logs and the profile stay
    print(markdown)
    common.write_docs(markdown, BEGIN, END, settings.out)
    log(f"wrote {settings.out}; raw results in {work / 'results.json'}")
    return 0


def aggregate(points: list[Point], servers: list[Server]) -> dict[tuple[str, int], dict[str, Any]]:
    grouped: dict[tuple[str, int], list[Point]] = defaultdict(list)
    for p in points:
        grouped[(p.server, p.concurrency)].append(p)
    table = {}
    for key, group in grouped.items():
        executions = sum(p.executions or 0 for p in group)
        rows = sum(p.rows or 0 for p in group)
        table[key] = {
            "rps": median(p.wrk.rps for p in group),
            "p50": median(p.wrk.p50_ms for p in group),
            "p99": median(p.wrk.p99_ms for p in group),
            "rounds": [p.wrk.rps for p in group],
            "batch": rows / executions if executions else None,
            "cpu": median(p.server_cpu_cores for p in group),
            "client_cpu": median(p.wrk.client_cpu_s / p.wrk.seconds for p in group),
            "other_cpu": max(p.other_cpu_cores for p in group),
            "rss": max(p.peak_rss for p in group),
            "valid": all(p.wrk.valid for p in group),
            "non_2xx": sum(p.wrk.non_2xx for p in group),
            "socket_errors": sum(p.wrk.socket_errors for p in group),
        }
    return table


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def render(
    settings: Settings,
    info: dict[str, str],
    started: dt.datetime,
    elapsed: float,
    servers: list[Server],
    primary: Server,
    closed: dict[tuple[str, int], dict[str, Any]],
    open_points: dict[tuple[str, float], OpenPoint],
    client: list[OpenLoopResult],
    overhead: dict[str, Any],
    profile: dict[str, Any] | None,
    rss: dict[str, int],
    model_sizes: dict[str, int],
    idle_cores: dict[str, float],
    work: Path,
) -> str:
    command = shlex.join([".venv/bin/python", "bench/batching.py", *settings.argv])
    naive = next(s for s in servers if s.kind == "naive")
    mlservers = [s for s in servers if s.kind == "mlserver"]
    out = common.section_head(
        BEGIN, "Batching: the agent against a naive server and MLServer (`mlp` v1)", command, started=started,
        minutes=elapsed / 60, code=f"agent at commit {info['commit']}",
        note=" (quick: a smoke test, not a result)" if settings.quick else "",
    )  # fmt: skip
    add = out.append
    add(
        f"- Machine: {common.machine_words(info)}; load average "
        f"{info['loadavg_start']} at the start, {info['loadavg_end']} at the end; /tmp/bench.lock "
        f"{info['bench_lock']} at the start"
    )
    add(
        f"- Software: Python {info['python']}, onnxruntime {info['onnxruntime']}, uvicorn {info['uvicorn']}, "
        f"FastAPI {info['fastapi']} (agent, naive); {info['mlserver']} in bench/.mlserver-venv; {info['wrk']}"
    )
    add("- Request: V2 JSON, one row of 512 FP32 (the same body for every server); the answer is JSON, 1000 FP32")
    add(
        f"- Closed loop: `wrk -t1 -c<concurrency> --latency`, {settings.warmup_s} s warm-up then {settings.seconds} s "
        f"measured per point; {settings.rounds} round(s), servers alternating within each concurrency "
        "(A B C D, reversed in every other round); medians over rounds; a point is valid only with zero non-2xx "
        "answers and zero socket errors"
    )
    add(
        "- Thread budgets (2 cores; wrk takes part of one; nothing pinned, so the kernel shares both cores "
        "between server and client as either needs):"
    )
    for server in servers:
        add(f"  - {server.label}: {server.threads}")
    idle = ", ".join(f"{s.label} {idle_cores[s.key]:.3f}" for s in servers)
    add(f"- Idle CPU of the servers (cores, while another is measured they sit idle like this): {idle}")
    add("")
    add("### Closed loop (wrk)")
    add("")
    add(
        "| server | concurrency | throughput (rps) | p50 (ms) | p99 (ms) | mean batch | server CPU (cores) "
        "| wrk CPU (cores) | other CPU, max (cores) | peak RSS (MiB) | rps per round | valid |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for server in servers:
        for concurrency in settings.concurrency:
            row = closed.get((server.key, concurrency))
            if row is None:
                continue
            batch = "1 (no batching)" if server.kind == "naive" else _fmt(row["batch"], 1)
            rounds = " / ".join(f"{r:.0f}" for r in row["rounds"])
            valid = (
                "yes" if row["valid"] else f"**no** (non-2xx {row['non_2xx']}, socket errors {row['socket_errors']})"
            )
            add(
                f"| {server.label} | {concurrency} | {row['rps']:.1f} | {row['p50']:.2f} | {row['p99']:.2f} | {batch} "
                f"| {row['cpu']:.2f} | {row['client_cpu']:.2f} | {row['other_cpu']:.2f} | {row['rss'] / MiB:.0f} "
                f"| {rounds} | {valid} |"
            )
    add("")
    add(
        "Peak RSS is VmHWM after the point (summed over the server's processes); the agent holds both versions "
        "of `mlp` (v1 and v2), the naive server and MLServer only v1."
    )
    add("")
    add("### Open loop (bench/load.py, fixed rate)")
    add("")
    best = max((c for c in client if c.ok == c.sent and (c.p99_ms or 1e9) < 5), key=lambda c: c.rate, default=None)
    ceiling_words = ", ".join(
        f"{c.rate:.0f} rps: answered {c.throughput_rps:.0f}, p99 {_fmt(c.p99_ms, 3)} ms, "
        f"client CPU {c.client_cpu_us_per_request:.0f} us/request"
        for c in client
    )
    add(
        f"The client (asyncio + uvloop, raw HTTP/1.1 keep-alive connections; not httpx, whose ~1 ms of CPU per "
        f"request would take a large share of 2 cores) against a no-op server: {ceiling_words}. It sustains "
        f"{'at least ' + format(best.rate, '.0f') if best else 'less than the lowest tried'} rps, far above the rates "
        "below. Latency counts from when the request was sent (including any wait for a free connection, up to "
        f"256); requests are sent within a millisecond-tick of when due. {settings.open_warmup_s:g} s warm-up, "
        f"{settings.open_seconds:g} s measured per point; run for the primary agent setting, the naive server and "
        "the MLServer setting with the higher closed-loop throughput at concurrency 64."
    )
    add("")
    add(
        "| server | offered (rps) | answered 2xx (rps) | p50 (ms) | p99 (ms) | non-2xx / errors / unfinished "
        "| mean batch | server CPU (cores) | max send lag (ms) |"
    )
    add("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for (key, rate), op in open_points.items():
        server = next(s for s in servers if s.key == key)
        r = op.result
        batch = (
            "1 (no batching)"
            if server.kind == "naive"
            else (_fmt(op.rows / op.executions, 1) if op.executions else "n/a")
        )
        add(
            f"| {server.label} | {rate:.0f} | {r.throughput_rps:.1f} | {_fmt(r.p50_ms)} | {_fmt(r.p99_ms)} "
            f"| {r.non_2xx} / {r.conn_errors} / {r.unfinished} | {batch} | {op.server_cpu_cores:.2f} "
            f"| {r.max_send_lag_ms:.1f} |"
        )
    add("")
    add("### Targets (issue 3)")
    add("")
    add("| target | measured | reached |")
    add("|---|---|---|")
    p64 = closed.get((primary.key, 64))
    n64 = closed.get((naive.key, 64))
    if p64 and n64:
        ratio = p64["rps"] / n64["rps"]
        reached = ratio >= 5 and p64["valid"] and n64["valid"]
        add(
            f"| agent >= 5x naive throughput at concurrency 64 | {primary.label} {p64['rps']:.1f} rps / naive "
            f"{n64['rps']:.1f} rps = **{ratio:.2f}x** | {'yes' if reached else 'no'} |"
        )
    for concurrency in settings.concurrency:
        # Against the MLServer setting with the higher throughput at this concurrency.
        candidates = [(ml, closed[(ml.key, concurrency)]) for ml in mlservers if (ml.key, concurrency) in closed]
        a = closed.get((primary.key, concurrency))
        if not a or not candidates:
            continue
        ml, m = max(candidates, key=lambda c: c[1]["rps"])
        ratio = a["rps"] / m["rps"]
        ok = ratio >= 1.3 and a["p99"] <= m["p99"] and a["valid"] and m["valid"]
        mark = "**" if concurrency == 64 else ""
        add(
            f"| {mark}agent >= 1.3x MLServer throughput at equal or lower p99, c={concurrency}{mark} | "
            f"{a['rps']:.1f} / {m['rps']:.1f} rps ({ml.label}) = **{ratio:.2f}x**; p99 {a['p99']:.2f} vs "
            f"{m['p99']:.2f} ms | {'yes' if ok else 'no'} |"
        )
    for agent in [s for s in servers if s.kind == "agent"]:
        o = overhead.get(agent.key)
        if not o:
            continue
        add(
            f"| {agent.label}: v2, c=1, round trip p50 - raw session.run p50 <= 0.5 ms | JSON: "
            f"{o['json']['p50_ms']:.3f} - {o['raw_p50_ms']:.3f} = **{o['overhead_json_ms']:.3f} ms**; binary tensors: "
            f"{o['binary']['p50_ms']:.3f} - {o['raw_p50_ms']:.3f} = {o['overhead_binary_ms']:.3f} ms "
            f"(raw p50 {o['raw_p50_before_ms']:.3f} before, {o['raw_p50_after_ms']:.3f} after; wrk c=1 against a "
            f"no-op server: p50 {overhead['noop_floor_p50_ms']:.3f} ms) | "
            f"{'yes' if o['overhead_json_ms'] <= 0.5 else 'no'} (JSON) |"
        )
    models = model_sizes["v1"] + model_sizes["v2"]
    for agent in [s for s in servers if s.kind == "agent"]:
        peak = rss[agent.key]
        add(
            f"| {agent.label}: peak RSS <= model files + 200 MB | VmHWM {peak / MiB:.0f} MiB vs model files "
            f"{models / MiB:.0f} MiB (v1 {model_sizes['v1'] / MiB:.0f} + v2 {model_sizes['v2'] / MiB:.0f}) + 200 MB = "
            f"{(models + 200e6) / MiB:.0f} MiB | {'yes' if peak <= models + 200e6 else 'no'} |"
        )
    add("")
    add(
        f"The primary agent setting (the one the ratios use) is {primary.label}: the agent with the higher "
        "throughput at concurrency 64 in this run."
    )
    if profile:
        add("")
        add(f"### Where the agent's time goes (py-spy, {primary.label}, concurrency 64)")
        add("")
        wd = profile["wrk_during"]
        add(
            f"`py-spy record --nonblocking --threads -r 200 -d {settings.profile_seconds} --format raw` while wrk "
            f"held concurrency 64 ({wd['rps']:.1f} rps, p99 {wd['p99_ms']:.2f} ms during the profile). Samples "
            f"per thread (of {profile['expected_per_thread']} if always busy; idle threads are not sampled): "
            + ", ".join(f"{t} {d['samples']}" for t, d in profile["threads"].items())
        )
        add("")
        add("| thread | function (self time: the innermost frame) | samples | share of all samples |")
        add("|---|---|---:|---:|")
        for top in profile["top"]:
            add(f"| {top['thread']} | `{top['function']}` | {top['samples']} | {top['share'] * 100:.1f}% |")
        for thread, data in profile["threads"].items():
            add("")
            add(f"Inclusive time on the {thread} thread ({data['samples']} samples), below its run loop:")
            add("")
            add("| function | samples | share of the thread's samples |")
            add("|---|---:|---:|")
            for function, n in data["inclusive"]:
                add(f"| `{function}` | {n} | {n / data['samples'] * 100:.1f}% |")
    add("")
    add(f"Raw results (every round, every point): `{work / 'results.json'}` on the machine that ran it.")
    add(END)
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
