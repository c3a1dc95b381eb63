"""Issue 15's benchmark: the agent's V2 gRPC endpoint beside its V2 HTTP endpoint, on `mlp` with binary tensors.

One agent process (both ports, the same models, the same scheduler), one client process per measured point: the
real Triton clients' asyncio flavours (`tritonclient.grpc.aio`, `tritonclient.http.aio`), each sending the same
request (one row of 512 FP32 as binary data, the 1000 FP32 output asked back as binary) from `concurrency` tasks in
a closed loop for `seconds` after a warm-up. The protocols alternate within each concurrency (A B, then B A in the
next round), and the table quotes the medians over rounds and the gRPC/HTTP ratios of those medians.

The client runs beside the agent on the same cores (2 on CI-like machines): its own CPU per request is measured
and shown, because a protocol whose client costs more leaves less CPU to the server.

    .venv/bin/python bench/grpc_http.py            # the full run, about 6 minutes
    .venv/bin/python bench/grpc_http.py --quick    # short points, one round: a smoke test, not a result
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.metadata
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from bench.common import free_port, log, median, percentile  # noqa: E402
from bench.procstat import cpu_seconds, loadavg  # noqa: E402
from spillway.demo.harness import Process  # noqa: E402

BEGIN = "<!-- bench/grpc_http.py: begin (generated; edit outside these markers) -->"
END = "<!-- bench/grpc_http.py: end -->"
MODEL, VERSION = "mlp", "1"


# ---- the client (its own process) -----------------------------------------------------------------


async def _client(proto: str, address: str, concurrency: int, warmup_s: float, seconds: float) -> dict[str, Any]:
    """Closed loop from `concurrency` tasks: warm up, then count answers and their latencies for `seconds`."""
    x = np.random.default_rng(0).standard_normal((1, 512), dtype=np.float32)
    if proto == "grpc":
        import tritonclient.grpc.aio as triton

        client: Any = triton.InferenceServerClient(address)
    else:
        import tritonclient.http.aio as triton  # type: ignore[no-redef]

        client = triton.InferenceServerClient(address, conn_limit=concurrency)
    tensor = triton.InferInput("input", [1, 512], "FP32")
    tensor.set_data_from_numpy(x, **({} if proto == "grpc" else {"binary_data": True}))
    wanted = triton.InferRequestedOutput("output", **({} if proto == "grpc" else {"binary_data": True}))
    latencies: list[float] = []
    errors = 0
    measuring = False
    stop_at = time.monotonic() + warmup_s + seconds

    async def loop() -> None:
        nonlocal errors
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            try:
                result = await client.infer(MODEL, [tensor], model_version=VERSION, outputs=[wanted])
                ok = result.as_numpy("output") is not None
            except Exception:
                ok = False
            if measuring:
                if ok:
                    latencies.append(time.perf_counter() - started)
                else:
                    errors += 1

    tasks = [asyncio.create_task(loop()) for _ in range(concurrency)]
    await asyncio.sleep(warmup_s)
    cpu0 = _own_cpu()
    measuring, t0 = True, time.monotonic()
    await asyncio.gather(*tasks)
    elapsed, cpu = time.monotonic() - t0, _own_cpu() - cpu0
    await client.close()
    p50, p99 = (1e3 * (percentile(latencies, q) or 0) for q in (50, 99))
    return {"requests": len(latencies), "errors": errors, "seconds": elapsed, "client_cpu_s": cpu, "p50_ms": p50,
            "p99_ms": p99}  # fmt: skip


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def client_main(args: argparse.Namespace) -> None:
    result = asyncio.run(_client(args.proto, args.address, args.concurrency, args.warmup, args.seconds))
    print("BENCHJSON " + json.dumps(result), flush=True)


# ---- the run ---------------------------------------------------------------------------------------


def measure(proto: str, address: str, concurrency: int, warmup_s: float, seconds: float, agent: Process) -> dict:
    """One point, the client in its own process; the agent's CPU over it too."""
    before = cpu_seconds([agent.pid])
    done = subprocess.run(
        [sys.executable, __file__, "client", "--proto", proto, "--address", address, "--concurrency",
         str(concurrency), "--warmup", str(warmup_s), "--seconds", str(seconds)],
        capture_output=True, text=True, timeout=warmup_s + seconds + 120, check=True,
    )  # fmt: skip
    line = next(line for line in done.stdout.splitlines() if line.startswith("BENCHJSON "))
    result: dict[str, Any] = json.loads(line.removeprefix("BENCHJSON "))
    result["agent_cpu_s"] = cpu_seconds([agent.pid]) - before  # over warm-up and measurement: a share, not exact
    result["rps"] = result["requests"] / result["seconds"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client", help="(internal) one measured point")
    client.add_argument("--proto", choices=["grpc", "http"], required=True)
    client.add_argument("--address", required=True)
    client.add_argument("--concurrency", type=int, required=True)
    client.add_argument("--warmup", type=float, required=True)
    client.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--quick", action="store_true", help="short points, one round (a smoke test)")
    parser.add_argument("--concurrency", default="1,8,32", help="closed-loop concurrencies")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--intra-op-threads", type=int, default=1)
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    if args.command == "client":
        client_main(args)
        return
    rounds, seconds, warmup = (1, 2.0, 1.0) if args.quick else (args.rounds, args.seconds, 2.0)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.monotonic()
    load_start = loadavg()
    with tempfile.TemporaryDirectory(prefix="grpc-http-") as tmp:
        work = Path(tmp)
        from spillway.demo.models import build_demo_repository

        repo = build_demo_repository(work / "models")
        http_port, grpc_port = free_port(), free_port()
        config = {"model_repository": str(repo), "host": "127.0.0.1", "port": http_port, "grpc_port": grpc_port,
                  "intra_op_threads": args.intra_op_threads, "state_dir": str(work / "state")}  # fmt: skip
        (work / "agent.yaml").write_text(yaml.safe_dump(config))
        cli = [sys.executable, "-m", "spillway.cli"]
        agent = Process.start([*cli, "agent", "serve", "--config", str(work / "agent.yaml"), "--log-level",
                               "warning"], name="the agent", log=work / "agent.log")  # fmt: skip
        try:
            agent.wait_ready(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout_s=180, interval_s=0.2)
            addresses = {"grpc": f"127.0.0.1:{grpc_port}", "http": f"127.0.0.1:{http_port}"}
            results: dict[tuple[str, int], list[dict[str, Any]]] = {}
            for r in range(rounds):
                for c in concurrencies:
                    order = ["grpc", "http"] if (r + c) % 2 == 0 else ["http", "grpc"]
                    for proto in order:
                        point = measure(proto, addresses[proto], c, warmup, seconds, agent)
                        log(f"round {r + 1} {proto} c={c}: {point['rps']:.0f} req/s p50 {point['p50_ms']:.2f} ms "
                            f"p99 {point['p99_ms']:.2f} ms errors {point['errors']}")  # fmt: skip
                        results.setdefault((proto, c), []).append(point)
        finally:
            agent.stop()
    minutes = (time.monotonic() - t0) / 60
    markdown = render(results, concurrencies, rounds, seconds, warmup, args, started, minutes, load_start)
    print(markdown)
    if not (args.no_docs or args.quick):
        common.write_docs(markdown, BEGIN, END)


def render(results: dict[tuple[str, int], list[dict[str, Any]]], concurrencies: list[int], rounds: int,
           seconds: float, warmup: float, args: argparse.Namespace, started: dt.datetime, minutes: float,
           load_start: str) -> str:  # fmt: skip
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("tritonclient", "grpcio", "onnxruntime"))
    lines = common.section_head(BEGIN, "V2 gRPC beside V2 HTTP on the agent (`mlp` v1, binary tensors)",
                                ".venv/bin/python bench/grpc_http.py", started=started, minutes=minutes,
                                code=f"agent at commit {common.revision('edge_agent', 'spillway')}")  # fmt: skip
    lines += [
        f"- Machine: {common.machine_words(common.machine())}; load average {load_start} at the start, "
        f"{loadavg()} at the end",
        f"- Software: Python {sys.version.split()[0]}, {versions}",
        "- Request: one row of 512 FP32 as binary data, the 1000 FP32 output asked back as binary; the same "
        "agent process serves both ports (onnxruntime intra-op "
        f"{args.intra_op_threads}, one instance, dynamic batching as the demo config sets it)",
        f"- Closed loop: the real `tritonclient.grpc.aio` / `tritonclient.http.aio` from `concurrency` asyncio "
        f"tasks in one client process beside the agent; {warmup:.0f} s warm-up then {seconds:.0f} s measured per "
        f"point; {rounds} round(s), protocols alternating; medians over rounds; a point is valid only with zero "
        "errors",
        "",
        "| concurrency | protocol | req/s | p50 ms | p99 ms | client CPU ms/req | agent CPU ms/req | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for c in concurrencies:
        med = {}
        for proto in ("http", "grpc"):
            points = results[(proto, c)]
            m = {k: median(p[k] for p in points) for k in ("rps", "p50_ms", "p99_ms")}
            m["client"] = median(1e3 * p["client_cpu_s"] / max(1, p["requests"]) for p in points)
            m["agent"] = median(1e3 * p["agent_cpu_s"] / max(1, p["requests"]) for p in points)
            errors = sum(p["errors"] for p in points)
            med[proto] = m
            lines.append(f"| {c} | {proto.upper()} | {m['rps']:.0f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
                         f"{m['client']:.3f} | {m['agent']:.3f} | {errors} |")  # fmt: skip
        ratios.append(f"- concurrency {c}: throughput x{med['grpc']['rps'] / med['http']['rps']:.2f}, p50 "
                      f"x{med['grpc']['p50_ms'] / med['http']['p50_ms']:.2f}, p99 "
                      f"x{med['grpc']['p99_ms'] / med['http']['p99_ms']:.2f}")  # fmt: skip
    lines += ["", "gRPC / HTTP (ratios of the medians):", "", *ratios, "", END]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
