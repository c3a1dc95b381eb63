"""Issue 18's gateway benchmark: what the overflow gateway adds to a V2 request, beside nginx, per worker count.

One invocation starts a Spillway agent in cloud role (the demo's `mlp`, version 2: the lite one), nginx as a plain
reverse proxy in front of it (`bench/nginx.py`), and one control plane per `--workers` count (each
`spillway controlplane serve --workers N`, all on one fresh PostgreSQL database, since more than one worker needs
it), each with the cloud agent registered as its backend. Then the same request goes, in interleaved rounds over
keep-alive connections, to the backend directly, through nginx and through each control plane's gateway, as JSON
and as binary tensors, at concurrency 1 and `--concurrency`: p50/p99 per path and the p50 each proxy adds over
the direct call. Target (issue 18): the gateway adds <= 1 ms at p50 at concurrency 8.

The load generator is `bench/overflow.py`'s closed-loop client (raw HTTP/1.1, uvloop, one process). The CPU each
proxy spends per request is measured from /proc over the rounds (every worker process of a control plane
together). With `--profile-s`, py-spy records each control plane's worker(s) during a further run at the higher
concurrency through that gateway alone. Results go to stdout and, with `--write`, between this bench's markers in
`docs/benchmarks.md`. Run it under the machine's benchmark lock:

    flock /tmp/spillway-bench.lock .venv/bin/python bench/gateway.py --write
    flock /tmp/spillway-bench.lock .venv/bin/python bench/gateway.py --quick   # a smoke test, not a result
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from bench import common  # noqa: E402
from bench.common import bearer, free_port, http_json, log, median, percentile, url_parts  # noqa: E402
from bench.nginx import nginx_version, require_nginx, reverse_proxy  # noqa: E402
from bench.overflow import (  # noqa: E402
    CLOUD_SECRET,
    Processes,
    _terminate_on_sigterm,
    agent_config,
    bench_repository,
    binary_body,
    body,
    run_client,
    start_client,
    wait_quiet,
)
from bench.procstat import cpu_seconds, loadavg, machine_busy_seconds, vm_hwm  # noqa: E402
from spillway.demo.harness import stop  # noqa: E402

BEGIN = "<!-- bench/gateway.py: begin (generated; edit outside these markers) -->"
END = "<!-- bench/gateway.py: end -->"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:54329/postgres"
PATH = "/v2/models/mlp/versions/2/infer"


# ---- the system under test ------------------------------------------------------------------------


def worker_pids(pid: int) -> list[int]:
    """The processes serving for a control plane started as `pid`: its children when it supervises workers, else
    itself."""
    try:
        children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        children = []
    return children or [pid]


@dataclass
class ControlPlane:
    workers: int
    url: str
    pid: int  # the process started (the supervisor when workers > 1)

    @property
    def name(self) -> str:
        return f"gateway x{self.workers}"

    def pids(self) -> list[int]:
        return worker_pids(self.pid)


@dataclass
class System:
    procs: Processes
    database_url: str
    admin: str
    cloud: str
    edge_token: str = ""
    nginx: str = ""
    nginx_pid: int = 0
    planes: list[ControlPlane] = field(default_factory=list)


class Database:
    """A fresh PostgreSQL database for one run, dropped at the end."""

    def __init__(self, admin_url: str) -> None:
        from sqlalchemy import create_engine
        from sqlalchemy.engine import make_url

        from controlplane.db.session import normalise_url

        self.admin = create_engine(normalise_url(admin_url), isolation_level="AUTOCOMMIT")
        self.name = f"spillway_bench_gateway_{uuid.uuid4().hex[:8]}"
        self.url = make_url(normalise_url(admin_url)).set(database=self.name).render_as_string(hide_password=False)

    def __enter__(self) -> Database:
        from sqlalchemy import text

        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.name}"'))
        return self

    def __exit__(self, *exc: object) -> None:
        from sqlalchemy import text

        with self.admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self.admin.dispose()


def prepare_database(url: str) -> str:
    """Migrate `url` and issue an admin key (returned)."""
    from controlplane.access import issue_api_key
    from controlplane.db import make_engine, make_sessionmaker, migrate_to, transaction
    from controlplane.db.repository import Actor

    migrate_to(url)
    engine = make_engine(url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            return issue_api_key(session, "bench-admin", "admin", Actor("cli", "bench/gateway.py"))[1]
    finally:
        engine.dispose()


def start_system(procs: Processes, workdir: Path, database_url: str, counts: list[int]) -> System:
    import yaml

    admin = prepare_database(database_url)
    repo = bench_repository(workdir, 1, "full")  # only version 2 (lite) serves here
    cloud_port = free_port()
    cloud_config = agent_config(repo, cloud_port, workdir, "bench-cloud", role="cloud", token=CLOUD_SECRET)
    (workdir / "cloud.yaml").write_text(yaml.safe_dump(cloud_config))
    cli = [sys.executable, "-m", "spillway.cli"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")}
    log("starting the cloud agent and the control planes")
    procs.start("cloud", [*cli, "agent", "serve", "--config", str(workdir / "cloud.yaml"), "--log-level", "warning"],
                clean)  # fmt: skip
    system = System(procs, database_url, admin, f"http://127.0.0.1:{cloud_port}")
    for workers in counts:
        port = free_port()
        env = {**clean, "SPILLWAY_DATABASE_URL": database_url, "SPILLWAY_HOST": "127.0.0.1",
               "SPILLWAY_PORT": str(port), "SPILLWAY_LOG_LEVEL": "warning",
               "SPILLWAY_CONTROL_LOOP_INTERVAL_S": "0"}  # fmt: skip
        proc = procs.start(f"controlplane-x{workers}",
                           [*cli, "controlplane", "serve", "--no-migrate", "--workers", str(workers)], env)  # fmt: skip
        system.planes.append(ControlPlane(workers, f"http://127.0.0.1:{port}", proc.pid))
    for plane in system.planes:
        procs.wait_ready(f"controlplane-x{plane.workers}", f"{plane.url}/readyz")
    procs.wait_ready("cloud", f"{system.cloud}/v2/health/ready", bearer(CLOUD_SECRET))
    operator = bearer(admin)
    first = system.planes[0].url
    system.edge_token = http_json("POST", f"{first}/api/v1/agents", {"name": "bench-edge", "device_class": "cpu"},
                                  operator)["token"]  # fmt: skip
    backend = {"name": "cloud-1", "url": system.cloud, "models": ["mlp"], "weight": 1.0, "max_concurrency": 1000,
               "timeout_ms": 10_000, "binary_tensors": True, "auth_header": f"Bearer {CLOUD_SECRET}"}  # fmt: skip
    http_json("POST", f"{first}/api/v1/backends", backend, operator)
    return system


def wait_backends(system: System, timeout_s: float = 30.0) -> None:
    """Until every worker of every control plane forwards (the others load the backend within their refresh)."""
    json_body = body(None, None)
    headers = {"Content-Type": "application/json", **bearer(system.edge_token)}
    deadline = time.monotonic() + timeout_s
    for plane in system.planes:
        ok = 0
        while ok < 4 * plane.workers:  # new connections: the kernel spreads them over the workers
            try:
                http_json("POST", f"{plane.url}{PATH}", json_body, headers)
                ok += 1
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)


# ---- measurements ---------------------------------------------------------------------------------


class Meter:
    """CPU seconds of named groups of processes, and of the machine, from its creation to `seconds()`."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.before = {name: cpu_seconds(pids) for name, pids in groups.items()}
        self.busy, self.t0 = machine_busy_seconds(), time.monotonic()

    def seconds(self) -> dict[str, float]:
        used = {name: cpu_seconds(pids) - self.before[name] for name, pids in self.groups.items()}
        used["machine"] = machine_busy_seconds() - self.busy
        used["wall"] = time.monotonic() - self.t0
        return used


def bodies(workdir: Path) -> dict[str, dict[str, Any]]:
    json_path, bin_path = workdir / "request.json", workdir / "request.bin"
    json_path.write_bytes(body(None, None))
    binary, head = binary_body()
    bin_path.write_bytes(binary)
    return {"JSON": {"file": str(json_path), "path": PATH, "headers": {}},
            "binary": {"file": str(bin_path), "path": PATH,
                       "headers": {"Content-Type": "application/octet-stream",
                                   "Inference-Header-Content-Length": str(head)}}}  # fmt: skip


def targets(system: System, planes: list[ControlPlane] | None = None, direct: bool = True) -> list[dict[str, Any]]:
    listed = [("direct", system.cloud, bearer(CLOUD_SECRET)), ("nginx", system.nginx, bearer(CLOUD_SECRET))]
    listed = listed if direct else []
    listed += [(plane.name, plane.url, bearer(system.edge_token)) for plane in (planes or system.planes)]
    out = []
    for name, url, headers in listed:
        host, port = url_parts(url)
        out.append({"name": name, "url": url, "host": host, "port": port, "headers": headers})
    return out


def rounds(system: System, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    spec = {"mode": "rounds", "targets": targets(system), "bodies": bodies(workdir), "rounds": args.rounds,
            "requests": args.requests, "concurrency": [1, args.concurrency]}  # fmt: skip
    groups = {"cloud": worker_pids(system.procs.procs["cloud"].pid), "nginx": [system.nginx_pid]}
    groups.update({plane.name: plane.pids() for plane in system.planes})
    meter = Meter(groups)
    result = run_client(spec, workdir, 900)
    result["_cpu_s"] = meter.seconds()
    result["_cpu_s"]["client"] = result.pop("client_cpu_s")
    return result


def profile(system: System, plane: ControlPlane, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """py-spy on each worker of `plane` during a closed-loop run at `--concurrency` (JSON) through it alone."""
    if not common.PY_SPY.exists():
        log("py-spy is missing: no profile")
        return {}
    json_only = {"JSON": bodies(workdir)["JSON"]}
    seconds = args.profile_s
    # Enough requests for the profile's seconds and the lead-in (at most ~2,000 a second through one gateway).
    spec = {"mode": "rounds", "targets": targets(system, [plane], direct=False), "bodies": json_only, "rounds": 0,
            "requests": 2500 * (seconds + 3), "concurrency": [args.concurrency]}  # fmt: skip
    client, _ = start_client(spec, workdir)
    spies = []
    try:
        time.sleep(2.0)
        for pid in plane.pids():
            raw = workdir / f"py-spy-x{plane.workers}-{pid}.txt"
            cmd = common.py_spy_command(pid, seconds, raw)
            spies.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), raw))
        for proc, _ in spies:
            proc.wait(seconds + 60)
    finally:
        for proc in [client, *(p for p, _ in spies)]:
            stop(proc, signal.SIGKILL)
    return {raw.name: common.summarise_profile(raw, seconds) for _, raw in spies if raw.exists()}


# ---- report ---------------------------------------------------------------------------------------


@dataclass
class Results:
    command: str
    started: dt.datetime
    load_before: str
    quiet: tuple[float, float]
    system: System
    args: argparse.Namespace
    data: dict[str, Any]
    profiles: dict[str, dict[str, Any]]
    rss: dict[str, int]


def report(res: Results) -> str:
    args, data, system = res.args, res.data, res.system
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("uvicorn", "uvloop", "aiohttp", "httptools"))
    elapsed = (dt.datetime.now(dt.timezone.utc) - res.started).total_seconds() / 60
    code = f"code at commit {common.revision('controlplane', 'spillway')}"
    out = common.section_head(BEGIN, "The gateway's added latency, per worker count (`bench/gateway.py`)",
                              res.command, started=res.started, minutes=elapsed, code=code)  # fmt: skip
    add = out.append
    computer = common.machine_words(common.machine(cpu_fallback=platform.processor()))
    add(
        f"- Machine: {computer}; load average {res.load_before} at the start, {loadavg()} at the end; before "
        f"starting, the machine was busy {res.quiet[0]:.2f} cores (after waiting {res.quiet[1]:.0f} s for quiet)"
    )
    add(f"- Software: Python {platform.python_version()}, {versions}, {nginx_version()}; PostgreSQL (the control "
        "planes' database; not on the request path once a token is cached)")  # fmt: skip
    add(
        "- Every process on the same 2 cores, nothing pinned: the cloud agent (`spillway agent serve`, `mlp` v2 "
        "(512-1024-1024-1000), onnxruntime intra-op 1, inter-op 1), nginx (one worker), "
        + ", ".join(f"a control plane with `--workers {p.workers}`" for p in system.planes)
        + " (one database; the control loop off), and the load generator (one asyncio process, uvloop)"
    )
    add("")
    cpu = data["_cpu_s"]
    wall = cpu["wall"]
    carried = data["requests"]
    per_request = ", ".join(f"{name} {cpu[name] / carried[name] * 1e6:.0f} us" for name in carried
                            if name != "direct" and carried.get(name))  # fmt: skip
    add(f"One row of `mlp` v2, `POST {PATH}`: as JSON (512 FP32 in, 1000 FP32 out as JSON) and as binary tensors "
        f"(2 KiB in, 4000 bytes out). Closed loop over keep-alive connections, {args.requests} requests per block, "
        f"blocks in the order {', '.join(t['name'] for t in targets(system))} within each of {args.rounds} rounds "
        "(after one warm-up round not kept); p50/p99 over every request of all rounds. Direct and nginx send the "
        "cloud agent's token; a gateway gets an agent's and sends the backend's `auth_header`. With 2 workers the "
        "kernel spreads the client's connections over them (`SO_REUSEPORT`: each connection stays with one worker). "
        "CPU during the rounds (cores): "
        + ", ".join(f"{name} {cpu[name] / wall:.2f}" for name in (*carried, "client", "machine") if name in cpu
                    and name != "direct")
        + ". CPU per request through a proxy (its processes' CPU over the rounds / the requests it carried, "
        f"warm-up round included): {per_request}. Answers other than 200 (not timed): "
        f"{data['failed'] or 'none'}.")  # fmt: skip
    add("")
    add("| request | concurrency | path | p50 (ms) | p99 (ms) | median of round medians (ms) | added p50 vs direct "
        "(ms) | added p99 vs direct (ms) |")  # fmt: skip
    add("|---|---:|---|---:|---:|---:|---:|---:|")
    added: dict[tuple[str, int, str], float] = {}
    names = [t["name"] for t in targets(system)]
    for kind in ("JSON", "binary"):
        for concurrency in (1, args.concurrency):
            base = data.get(f"{kind}|{concurrency}|direct")
            if base is None:
                continue
            base_p50, base_p99 = median(base["all"]) / 1e3, (percentile(base["all"], 99) or 0) / 1e3
            for name in names:
                cell = data[f"{kind}|{concurrency}|{name}"]
                p50, p99 = median(cell["all"]) / 1e3, (percentile(cell["all"], 99) or 0) / 1e3
                plus = "" if name == "direct" else f"{p50 - base_p50:+.3f}"
                plus99 = "" if name == "direct" else f"{p99 - base_p99:+.3f}"
                added[(kind, concurrency, name)] = p50 - base_p50
                add(f"| {kind} | {concurrency} | {name} | {p50:.3f} | {p99:.3f} | {median(cell['rounds']) / 1e3:.3f} "
                    f"| {plus} | {plus99} |")  # fmt: skip
    add("")
    add("| target | measured | reached |")
    add("|---|---|---|")
    for (kind, concurrency, name), value in added.items():
        if not name.startswith("gateway") or concurrency == 1:
            continue
        nginx = added[(kind, concurrency, "nginx")]
        add(f"| {name} adds <= 1 ms at p50 ({kind}, concurrency {concurrency}) | {value:+.3f} ms (nginx "
            f"{nginx:+.3f} ms) | {'yes' if value <= 1.0 else 'no'} |")  # fmt: skip
    add("")
    rss = ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in res.rss.items())
    add(f"Peak RSS at the end: {rss}.")
    add("")
    for plane_name, summaries in res.profiles.items():
        if not summaries:
            continue
        add(f"#### Where a worker's time goes: {plane_name}, JSON, concurrency {args.concurrency} (py-spy)")
        add("")
        add(f"`py-spy record --nonblocking --threads -r 200 -d {args.profile_s} --format raw` on each worker during "
            "a closed-loop run through this gateway alone. Self time (the innermost frame; `Runner.run` is the "
            "event loop's own C code: uvloop's I/O and callbacks); samples of idle threads are not taken.")  # fmt: skip
        add("")
        add("| worker | function (self time) | samples | share of the worker's samples |")
        add("|---|---|---:|---:|")
        for raw_name, summary in summaries.items():
            worker = raw_name.removesuffix(".txt").rsplit("-", 1)[-1]
            loop_samples = sum(t["samples"] for t in summary["threads"].values())
            for row in summary["top"][:10]:
                add(f"| {worker} | `{row['function']}` | {row['samples']} | {row['share'] * 100:.1f}% |")
            add(f"| {worker} | (all samples; {summary['expected_per_thread']} if one thread were always busy) "
                f"| {loop_samples} | |")  # fmt: skip
        add("")
    add(END)
    return "\n".join(out)


# ---- main -----------------------------------------------------------------------------------------


def run(args: argparse.Namespace, command: str) -> str:
    require_nginx()
    _terminate_on_sigterm()
    quiet = wait_quiet(args.wait_quiet_s)
    started, load_before = dt.datetime.now(dt.timezone.utc), loadavg()
    workdir = Path(tempfile.mkdtemp(prefix="spillway-bench-gateway-"))
    procs = Processes(workdir)
    with Database(args.postgres_url) as db, procs.session():
        system = start_system(procs, workdir, db.url, args.workers)
        with reverse_proxy("127.0.0.1", url_parts(system.cloud)[1], workdir) as (nginx, nginx_pid):
            system.nginx, system.nginx_pid = nginx, nginx_pid
            wait_backends(system)
            wait_quiet(min(60.0, args.wait_quiet_s))
            log("direct, nginx and the gateways in interleaved rounds")
            data = rounds(system, args, workdir)
            profiles = {}
            if args.profile_s:
                for plane in system.planes:
                    log(f"py-spy on {plane.name}: {args.profile_s} s at concurrency {args.concurrency}")
                    profiles[plane.name] = profile(system, plane, args, workdir)
            rss = {"cloud": vm_hwm(system.procs.procs["cloud"].pid), "nginx": vm_hwm(nginx_pid)}
            for plane in system.planes:
                rss[f"{plane.name} (each worker)" if plane.workers > 1 else plane.name] = max(
                    vm_hwm(pid) for pid in plane.pids()
                )
        markdown = report(Results(command, started, load_before, quiet, system, args, data, profiles, rss))
    return markdown


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="put the tables into docs/benchmarks.md")
    parser.add_argument("--quick", action="store_true", help="short points: a smoke test, not a result")
    parser.add_argument("--workers", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2],
                        help="control planes to start, by worker count (comma-separated)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=200, help="requests per block")
    parser.add_argument("--concurrency", type=int, default=8, help="the higher concurrency (the lower one is 1)")
    parser.add_argument("--profile-s", type=int, default=6, help="py-spy per control plane (0: none)")
    parser.add_argument("--postgres-url", default=os.environ.get("SPILLWAY_TEST_POSTGRES_URL", DEFAULT_POSTGRES),
                        help="a PostgreSQL server where a database may be created (and dropped after)")  # fmt: skip
    parser.add_argument("--wait-quiet-s", type=float, default=120, help="wait at most this long for an idle machine")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.profile_s, args.wait_quiet_s = 2, 48, 2, 5
    markdown = run(args, shlex.join([".venv/bin/python", "bench/gateway.py", *argv]))
    print(markdown)
    if args.write:
        common.write_docs(markdown, BEGIN, END)


if __name__ == "__main__":
    main()
