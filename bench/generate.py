"""Generative serving: the agent's continuous batching against a naive server and static batching, side by side on
the bench decoder (`spillway models build-demo --size bench`: `tiny-lm-bench`, width 512, 4 layers).

One invocation starts three servers of the same OpenAI completions API (streamed, server-sent events), each in its
own process, on the same `DecoderRunner` class with the same onnxruntime threads (`--threads`, 1 by default on a
2-core machine: one core for the model, the other for the event loop, the client and the rest):

  (a) naive (`generate_peers.py --mode naive`): one request at a time, first come first served;
  (b) static (`generate_peers.py --mode static`): up to 8 waiting requests as a batch, decoded together until every
      one of them has ended, and only then the next batch (arrivals meanwhile wait);
  (c) the agent (`spillway agent serve`), with its generation settings written out in the config and the report.

The same asyncio client (in this process, raw HTTP/1.1, one connection per request) drives all three, one at a
time, alternating within each scenario (a b c a b c ...). Every request asks for `temperature` 0 and
`ignore_eos` (so it makes exactly `max_tokens`), its prompt 16-256 tokens and its output 16-128 (seeded; the
byte-level tokenizer makes one token of each ASCII character). Scenarios:

  1. closed loop, 8 streams (8 clients): output tokens/s, TTFT, TPOT; the agent's step timing (its status,
     before and after): scheduler overhead (all but `session.run`) as a share of step time;
  2. closed loop, 16 streams: saturation (twice as many requests as a batch holds);
  3. open loop (Poisson arrivals, seeded) at `--load` x the agent's saturated capacity, the same arrivals for all
     three: goodput under a TTFT SLO, and the TTFT of a request that arrives mid-batch (while 1-7 others run)
     beside its own prefill (its TTFT alone, from a fit over requests sent one at a time) and 2 steps;
  4. the agent alone, open loop at `--overload` x its saturated capacity, `--high-share` at priority 1 and the rest
     at 3 (with a first-token deadline, `timeout`): priority 1's TTFT p99 against its unloaded p99.

Then a py-spy profile of the agent at 8 streams (when py-spy is installed: `.venv/bin/pip install py-spy`) and, in
this process, the anatomy of a decode step of the runner at batch 1 and 8 (session.run against the cache copies
around it). Every request gets exactly one answer or is counted as an error. Results go to stdout and, with
`--write`, between markers in `docs/benchmarks.md`.

    .venv/bin/python bench/generate.py --write      # about 5 minutes
    .venv/bin/python bench/generate.py --quick      # short points: a smoke test, not a result
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
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.common import free_port, http_json, log, percentile  # noqa: E402
from bench.procstat import cpu_seconds, loadavg, vm_hwm  # noqa: E402
from spillway.demo.harness import Process, stop_all  # noqa: E402
from spillway.demo.models import BENCH_LM  # noqa: E402

BEGIN = "<!-- bench/generate.py: begin (generated; edit outside these markers) -->"
END = "<!-- bench/generate.py: end -->"
SERVERS = ("naive", "static", "agent")
LABELS = {"naive": "(a) naive", "static": "(b) static batching", "agent": "(c) agent"}
MiB = 1 << 20
WORDS = ("the", "a", "model", "token", "edge", "device", "batch", "stream", "cache", "queue", "step", "prompt",
         "of", "and", "to", "in", "serving", "latency", "first", "budget", "block", "decode", "prefill")  # fmt: skip


# ---- the workload -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    index: int
    prompt: str  # ASCII: one token per character
    max_tokens: int
    priority: int = 0  # 0: none given


def workload(seed: int, count: int, prompts: tuple[int, int], outputs: tuple[int, int],
             high_share: float | None = None) -> list[Req]:  # fmt: skip
    """`count` requests, seeded: prompt lengths and max_tokens uniform in their ranges; with `high_share`, that share
    at priority 1 and the rest at 3."""
    draw = random.Random(seed)
    out = []
    for i in range(count):
        length = draw.randint(*prompts)
        text = ""
        while len(text) < length:
            text += draw.choice(WORDS) + " "
        priority = 0 if high_share is None else 1 if draw.random() < high_share else 3
        out.append(Req(i, text[:length], draw.randint(*outputs), priority))
    return out


def payload(req: Req, *, max_tokens: int | None = None, timeout_us: int | None = None) -> bytes:
    body: dict[str, Any] = {"model": BENCH_LM, "prompt": req.prompt, "max_tokens": max_tokens or req.max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                            "ignore_eos": True}  # fmt: skip
    if req.priority:
        body["priority"] = req.priority
    if timeout_us:
        body["timeout"] = timeout_us
    return json.dumps(body).encode()


# ---- the client -------------------------------------------------------------------------------------


@dataclass
class Record:
    """One request as the client saw it; times in seconds on this process's perf_counter."""

    req: Req
    due: float  # when it was due (open loop) or sent (closed loop)
    max_tokens: int
    others: int = 0  # requests of this run in flight when it was due
    unstarted: int = 0  # of those, the ones still without their first token (queued or prefilling)
    status: int = 0  # 0: no answer (connection failed or cut off)
    first: float | None = None  # the first event (the first token)
    last: float | None = None  # the final event (the last token)
    tokens: int = 0  # completion tokens (the usage event)
    finishes: int = 0  # events with a finish_reason: exactly one in a whole stream
    done: bool = False  # `data: [DONE]` seen
    error: str = ""  # the server's error code, or what went wrong

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.finishes == 1 and not self.error

    @property
    def ttft(self) -> float | None:
        return None if self.first is None or not self.ok else self.first - self.due

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.tokens < 2 or self.first is None or self.last is None:
            return None
        return (self.last - self.first) / (self.tokens - 1)

    def outcome(self) -> str:
        if self.ok:
            return "200, whole stream" + ("" if self.tokens == self.max_tokens else ", short of max_tokens")
        if self.status == 200:
            return f"200, broken stream ({self.error or 'no end'})"
        if self.status:
            return f"{self.status} {self.error}".strip()
        return self.error or "no answer"

    def refused(self) -> bool:
        return self.status in (429, 503)


_NULL = (b'"finish_reason": null', b'"finish_reason":null')


async def exchange(host: str, port: int, path: str, body: bytes, record: Record) -> None:
    """One POST; its answer's events timed into `record` (chunked transfer decoding, server-sent events)."""
    clock = time.perf_counter
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        record.error = f"connection failed: {type(exc).__name__}"
        return
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)  # fmt: skip
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        chunked = b"transfer-encoding: chunked" in head.lower()
        if status != 200:
            rest = await reader.read()
            record.status, record.error = status, _error_code(_dechunk(rest) if chunked else rest)
            return
        record.status = 200
        buffer = b""
        while True:
            if chunked:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    break
                data = (await reader.readexactly(size + 2))[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                _event(event, record, clock())
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        record.error = record.error or f"{type(exc).__name__} mid-answer"
    finally:
        writer.close()


def _event(event: bytes, record: Record, now: float) -> None:
    if not event.startswith(b"data: "):
        return
    data = event[6:]
    if data == b"[DONE]":
        record.done = True
        return
    if any(null in data for null in _NULL):  # a token, not the last
        if record.first is None:
            record.first = now
        return
    message = json.loads(data)
    if "error" in message:
        record.error = f"error event: {str(message['error'].get('message', ''))[:60]}"
    elif message.get("usage"):
        record.tokens = int(message["usage"]["completion_tokens"])
    elif message.get("choices"):
        record.finishes += 1
        record.last = now
        if record.first is None:
            record.first = now


def _dechunk(raw: bytes) -> bytes:
    out, rest = b"", raw
    while rest:
        line, _, rest = rest.partition(b"\r\n")
        size = int(line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2 :]
    return out


def _error_code(body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
    except ValueError:
        return ""
    if isinstance(error, dict):
        return str(error.get("code") or error.get("type") or "")
    return str(error or "")[:60]


@dataclass
class Run:
    """One measured run: its records, the window its throughput counts, and the CPU each process used."""

    server: str
    kind: str
    records: list[Record]
    window: tuple[float, float]
    cpu: dict[str, float] = field(default_factory=dict)  # cores, over the run's wall time
    timing: dict[str, float] = field(default_factory=dict)  # the server's step timing, delta over the run
    rate: float = 0.0  # offered requests/s (open loop)

    @property
    def seconds(self) -> float:
        return self.window[1] - self.window[0]

    def tokens_per_s(self) -> float:
        """Output tokens made inside the window, per second: a request's first token at its first event, the rest
        spread evenly up to its last."""
        t0, t1 = self.window
        total = 0.0
        for r in self.records:
            if r.first is None or not r.tokens:
                continue
            total += t0 <= r.first <= t1
            last = r.last if r.last is not None else r.first
            if r.tokens > 1 and last > r.first:
                overlap = max(0.0, min(t1, last) - max(t0, r.first))
                total += (r.tokens - 1) * overlap / (last - r.first)
        return total / self.seconds

    def ttft(self, level: int | None = None) -> list[float]:
        return [r.ttft for r in self.records if r.ttft is not None and (level is None or r.req.priority == level)]

    def tpot(self) -> list[float]:
        return [r.tpot for r in self.records if r.tpot is not None]


async def closed_loop(host: str, port: int, path: str, reqs: list[Req], clients: int, seconds: float,
                      offset: int = 0) -> tuple[list[Record], tuple[float, float]]:  # fmt: skip
    """`clients` streams, each sending its next request when its last one ends, for `seconds`."""
    clock = time.perf_counter
    records: list[Record] = []
    counter = iter(range(offset, offset + 1_000_000))
    start = clock()
    end = start + seconds

    async def client() -> None:
        while clock() < end:
            req = reqs[next(counter) % len(reqs)]
            record = Record(req, clock(), req.max_tokens)
            records.append(record)
            await exchange(host, port, path, payload(req), record)

    await asyncio.gather(*(client() for _ in range(clients)))
    return records, (start, end)


async def open_loop(host: str, port: int, path: str, reqs: list[Req], rate: float, seconds: float, seed: int,
                    drain_s: float, timeout_us: dict[int, int] | None = None,
                    ) -> tuple[list[Record], tuple[float, float]]:  # fmt: skip
    """Poisson arrivals at `rate` for `seconds` (seeded: the same arrivals for every server); waits at most `drain_s`
    after the last for the answers (what is still open then is cut off and counted so)."""
    clock = time.perf_counter
    draw = random.Random(seed)
    dues, t = [], draw.expovariate(rate)
    while t < seconds:
        dues.append(t)
        t += draw.expovariate(rate)
    records: list[Record] = []
    active: set[int] = set()  # indexes of the records in flight
    start = clock() + 0.05

    async def one(index: int, record: Record) -> None:
        active.add(index)
        try:
            limit = (timeout_us or {}).get(record.req.priority)
            await exchange(host, port, path, payload(record.req, timeout_us=limit), record)
        finally:
            active.discard(index)

    tasks = []
    for i, due in enumerate(dues):
        delay = start + due - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        req = reqs[i % len(reqs)]
        unstarted = sum(1 for j in active if records[j].first is None)
        record = Record(req, start + due, req.max_tokens, others=len(active), unstarted=unstarted)
        records.append(record)
        tasks.append(asyncio.ensure_future(one(i, record)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.status == 0 and not record.error:
            record.error = f"cut off: no answer within {drain_s:g} s of the last arrival"
    return records, (start, start + seconds)


async def one_at_a_time(host: str, port: int, path: str, reqs: list[Req]) -> list[Record]:
    """Each request alone (max_tokens 1): its TTFT unloaded."""
    records = []
    for req in reqs:
        record = Record(req, time.perf_counter(), 1)
        await exchange(host, port, path, payload(req, max_tokens=1), record)
        records.append(record)
    return records


# ---- the servers ------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    process: Process
    port: int

    @property
    def path(self) -> str:
        return "/v1/completions"

    def timing(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.port}"
        if self.name == "agent":
            model = http_json("GET", f"{url}/v2/spillway/status")["generative"][BENCH_LM]
            if "timing" in model:
                return dict(model["timing"])
            timings = [i["timing"] for i in model.get("instances", [])]  # several instances: their sum
            return {k: sum(t[k] for t in timings) for k in ("steps", "step_s", "model_s")}
        return dict(http_json("GET", f"{url}/status")["timing"])


def generation_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "long_prefill_threshold": args.long_prefill_threshold, "block_size": 16, "kv_budget_bytes": 64 * MiB,
            "levels": 3, "default_level": 2}  # fmt: skip


def start_servers(workdir: Path, folder: Path, args: argparse.Namespace, servers: dict[str, Server]) -> None:
    """Start the three into `servers` (as each starts, so that the caller can stop them whatever fails)."""
    import yaml

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")}
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    for mode in ("naive", "static"):
        port = free_port()
        cmd = [sys.executable, str(BENCH / "generate_peers.py"), "--mode", mode, "--model", str(folder),
               "--name", BENCH_LM, "--port", str(port), "--intra-op-threads", str(args.threads),
               "--max-batch", str(args.max_num_seqs)]  # fmt: skip
        servers[mode] = Server(mode, Process.start(cmd, name=mode, log=workdir / f"{mode}.log", env=env, group=True),
                               port)  # fmt: skip
    port = free_port()
    config = {"model_repository": str(folder.parent.parent), "host": "127.0.0.1", "port": port,
              "intra_op_threads": args.threads, "inter_op_threads": 1, "state_dir": str(workdir / "state"),
              "agent_id": "bench-generate", "generation": generation_settings(args)}  # fmt: skip
    (workdir / "agent.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "spillway.cli", "agent", "serve", "--config", str(workdir / "agent.yaml"),
           "--log-level", "warning"]  # fmt: skip
    servers["agent"] = Server("agent", Process.start(cmd, name="agent", log=workdir / "agent.log", env=env,
                                                     group=True), port)  # fmt: skip
    for name, server in servers.items():
        ready = "/v2/health/ready" if name == "agent" else "/health"
        server.process.wait_ready(f"http://127.0.0.1:{server.port}{ready}", timeout_s=120, interval_s=0.2)


def _terminate_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so that every `finally` stops what it started."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


# ---- measuring --------------------------------------------------------------------------------------


def _loop() -> asyncio.AbstractEventLoop:
    with contextlib.suppress(ImportError):
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class Bench:
    def __init__(self, servers: dict[str, Server], args: argparse.Namespace) -> None:
        self.servers, self.args = servers, args
        self.loop = _loop()
        self.pids = {name: s.process.pid for name, s in servers.items()}

    def measure(self, name: str, kind: str, coroutine: Any, rate: float = 0.0) -> Run:
        server = self.servers[name]
        before = server.timing()
        cpu0 = {n: cpu_seconds([pid]) for n, pid in self.pids.items()}
        client0, wall0 = time.process_time(), time.perf_counter()
        records, window = self.loop.run_until_complete(coroutine)
        wall = time.perf_counter() - wall0
        cpu = {n: (cpu_seconds([pid]) - cpu0[n]) / wall for n, pid in self.pids.items()}
        cpu["client"] = (time.process_time() - client0) / wall
        after = server.timing()
        delta = {k: after[k] - before[k] for k in ("steps", "step_s", "model_s")}
        return Run(name, kind, records, window, cpu, delta, rate)

    def closed(self, name: str, reqs: list[Req], clients: int, seconds: float, offset: int = 0) -> Run:
        port = self.servers[name].port
        return self.measure(name, f"closed {clients}", closed_loop("127.0.0.1", port, "/v1/completions", reqs,
                                                                   clients, seconds, offset))  # fmt: skip

    def open(self, name: str, reqs: list[Req], rate: float, seconds: float,
             timeout_us: dict[int, int] | None = None) -> Run:  # fmt: skip
        port = self.servers[name].port
        coroutine = open_loop("127.0.0.1", port, "/v1/completions", reqs, rate, seconds, self.args.seed,
                              self.args.drain_s, timeout_us)  # fmt: skip
        return self.measure(name, f"open {rate:.2f} rps", coroutine, rate)

    def alone(self, name: str, reqs: list[Req]) -> list[Record]:
        return self.loop.run_until_complete(one_at_a_time("127.0.0.1", self.servers[name].port, "/v1/completions",
                                                          reqs))  # fmt: skip


@dataclass
class Results:
    command: str
    started: dt.datetime
    args: argparse.Namespace
    load_before: str
    model_bytes: int = 0
    closed8: dict[str, list[Run]] = field(default_factory=dict)
    closed16: dict[str, list[Run]] = field(default_factory=dict)
    unloaded: dict[str, list[Record]] = field(default_factory=dict)
    fit: dict[str, tuple[float, float]] = field(default_factory=dict)  # TTFT alone = a + b x prompt tokens
    capacity_rps: float = 0.0
    open_runs: dict[str, Run] = field(default_factory=dict)
    unloaded_high: list[Record] = field(default_factory=list)
    overload: Run | None = None
    profile: dict[str, Any] | None = None
    anatomy: list[dict[str, float]] = field(default_factory=list)
    mean_prompt: float = 0.0  # tokens, over the workload
    mean_output: float = 0.0
    rss: dict[str, int] = field(default_factory=dict)


def prefill_fit(records: list[Record]) -> tuple[float, float]:
    """TTFT alone as a + b x prompt tokens (least squares over requests sent one at a time)."""
    points = [(len(r.req.prompt), r.ttft) for r in records if r.ttft is not None]
    if len(points) < 2:
        return (0.0, 0.0)
    slope, intercept = np.polyfit([p for p, _ in points], [t for _, t in points], 1)
    return float(intercept), float(slope)


def decode_anatomy(folder: Path, threads: int, seconds: float) -> list[dict[str, float]]:
    """In this process (the servers idle): one decode step of the runner at batch 1 and 8, its session.run and the
    rest (in the steady state the runner feeds last step's present arrays back, so the rest is the feeds, the mask
    and the logits), caches of 16-256 prompt tokens."""
    from edge_agent.generation.runner import DecoderConfig, DecoderRunner

    runner = DecoderRunner(DecoderConfig.load(folder), threads=threads)
    draw = np.random.default_rng(7)
    out = []
    for batch in (1, 8):
        sequences = list(range(batch))
        for s in sequences:
            runner.prefill(s, [int(t) for t in draw.integers(32, 127, int(draw.integers(16, 257)))])
        steps, step_s, model0 = 0, 0.0, runner.run_s
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            started = time.perf_counter()
            runner.decode(sequences, [65] * batch)
            step_s += time.perf_counter() - started
            steps += 1
        model = runner.run_s - model0
        out.append({"batch": batch, "step_ms": step_s / steps * 1e3, "run_ms": model / steps * 1e3,
                    "tokens_per_s": batch * steps / step_s})  # fmt: skip
        for s in sequences:
            runner.release(s)
    return out


ENGINE_PARTS = (  # the first that a sample's stack holds names it
    ("session.run (the model)", ("Session.run",)),
    ("the runner around it: caches in and out, feeds", ("generation/runner.py",)),
    ("sampling", ("Sampler.",)),
    ("detokenization", ("IncrementalText.", "TextCodec.")),
    ("scheduler: plan, admit, advance, finish", ("GenerationScheduler.", "BlockManager.")),
    ("handing chunks to the event loop", ("_post", "_deliver", "call_soon_threadsafe")),
)


def engine_split(raw: Path) -> dict[str, int]:
    """The agent's engine thread's py-spy samples (collapsed stacks) by what they were doing."""
    parts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "generate-" not in stack.split(";", 1)[0] or not count.isdigit():
            continue
        name = next((part for part, marks in ENGINE_PARTS if any(m in stack for m in marks)), "the rest of the step")
        parts[name] += int(count)
    return dict(parts)


def profile_agent(bench: Bench, reqs: list[Req], seconds: int, workdir: Path) -> dict[str, Any] | None:
    """py-spy on the agent during a closed-loop run at 8 streams (None without py-spy)."""
    if not common.PY_SPY.exists():
        return None
    raw = workdir / "agent.pyspy.raw"
    spy = subprocess.Popen(common.py_spy_command(bench.pids["agent"], seconds, raw), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        bench.closed("agent", reqs, bench.args.max_num_seqs, seconds + 0.5)
    finally:
        spy.wait(timeout=60)
    if not raw.exists():
        return None
    return {**common.summarise_profile(raw, seconds), "engine": engine_split(raw)}


def run(args: argparse.Namespace, command: str) -> Results:
    _terminate_on_sigterm()
    started = dt.datetime.now(dt.timezone.utc)
    res = Results(command, started, args, loadavg())
    workdir = Path(tempfile.mkdtemp(prefix="spillway-bench-generate-"))
    repo = workdir / "models"
    subprocess.run([sys.executable, "-m", "spillway.cli", "models", "build-demo", "--out", str(repo), "--size",
                    "bench"], check=True, capture_output=True)  # fmt: skip
    folder = repo / BENCH_LM / "1"
    res.model_bytes = (folder / "model.onnx").stat().st_size
    log(f"the decode step's anatomy in this process ({args.anatomy_s:g} s a batch size)")
    res.anatomy = decode_anatomy(folder, args.threads, args.anatomy_s)
    reqs = workload(args.seed, 4000, (args.prompt_min, args.prompt_max), (args.output_min, args.output_max))
    mix = workload(args.seed + 1, 4000, (args.prompt_min, args.prompt_max), (args.output_min, args.output_max),
                   high_share=args.high_share)  # fmt: skip
    servers: dict[str, Server] = {}
    try:
        log("starting the naive peer, the static-batching peer and the agent")
        start_servers(workdir, folder, args, servers)
        bench = Bench(servers, args)
        for name in SERVERS:
            log(f"warm-up: {name}, {args.warmup_s:g} s at {args.max_num_seqs} streams")
            bench.closed(name, reqs[-200:], args.max_num_seqs, args.warmup_s)
        calibration = workload(args.seed + 2, args.calibration, (args.prompt_min, args.prompt_max), (1, 1))
        for name in SERVERS:
            log(f"{name}: {len(calibration)} requests one at a time (TTFT alone)")
            res.unloaded[name] = bench.alone(name, calibration)
            res.fit[name] = prefill_fit(res.unloaded[name])
        for clients, into in ((args.max_num_seqs, res.closed8), (2 * args.max_num_seqs, res.closed16)):
            for round_ in range(args.rounds):
                for name in SERVERS:
                    log(f"closed loop, {clients} streams, round {round_ + 1}: {name}, {args.seconds:g} s")
                    into.setdefault(name, []).append(bench.closed(name, reqs, clients, args.seconds,
                                                                  offset=round_ * 500))  # fmt: skip
        res.mean_prompt = float(np.mean([len(r.prompt) for r in reqs]))
        res.mean_output = float(np.mean([r.max_tokens for r in reqs]))
        res.capacity_rps = float(np.median([r.tokens_per_s() for r in res.closed16["agent"]])) / res.mean_output
        rate = args.load * res.capacity_rps
        for name in SERVERS:
            log(f"open loop at {rate:.2f} rps ({args.load:g} x the agent's capacity): {name}, {args.open_s:g} s")
            res.open_runs[name] = bench.open(name, reqs, rate, args.open_s)
        high = [Req(r.index, r.prompt, r.max_tokens, 1) for r in calibration]
        log(f"agent: {len(high)} priority-1 requests one at a time (unloaded TTFT)")
        res.unloaded_high = bench.alone("agent", high)
        rate = args.overload * res.capacity_rps
        log(f"agent: open loop at {rate:.2f} rps ({args.overload:g} x capacity), {args.high_share:g} at priority 1")
        deadline = {3: args.low_timeout_ms * 1000} if args.low_timeout_ms else None
        res.overload = bench.open("agent", mix, rate, args.open_s, deadline)
        if args.profile_s:
            log(f"agent: py-spy for {args.profile_s} s at {args.max_num_seqs} streams")
            res.profile = profile_agent(bench, reqs, args.profile_s, workdir)
        res.rss = {name: vm_hwm(pid) for name, pid in bench.pids.items()}
    except BaseException:
        stop_all(s.process for s in servers.values())
        log(f"stopped; the servers' logs are in {workdir}")
        raise
    stop_all(s.process for s in servers.values())
    shutil.rmtree(workdir, ignore_errors=True)
    return res


# ---- the report -------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q)


def _median_of(runs: list[Run], fn: Any) -> float:
    return float(np.median([fn(r) for r in runs]))


def _outcomes(records: list[Record]) -> str:
    counts = Counter(r.outcome() for r in records)
    return "; ".join(f"{k}: {v}" for k, v in counts.most_common())


def _errors(records: list[Record]) -> int:
    return sum(1 for r in records if not r.ok and not r.refused())


def _yes(ok: bool) -> str:
    return "**pass**" if ok else "**miss**"


def report(res: Results) -> tuple[str, list[str]]:
    args = res.args
    elapsed = (dt.datetime.now(dt.timezone.utc) - res.started).total_seconds() / 60
    code = f"code at commit {common.revision('edge_agent', 'bench')}"
    out = common.section_head(BEGIN, "Generative serving: continuous batching against naive and static batching "
                              "(`bench/generate.py`)", res.command, started=res.started, minutes=elapsed,
                              code=code)  # fmt: skip
    add = out.append
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("onnxruntime", "uvicorn", "numpy"))
    add(f"- Machine: {common.machine_words(common.machine(cpu_fallback=platform.processor()))}; load average "
        f"{res.load_before} at the start, {loadavg()} at the end (a shared machine: provisional numbers)")  # fmt: skip
    add(f"- Software: Python {platform.python_version()}, {versions}")
    add(f"- Model: `{BENCH_LM}` v1 from `spillway models build-demo --size bench` (width 512, 4 layers, 8 heads, "
        f"4 KV heads, context 1024; {res.model_bytes / MiB:.0f} MiB, FP32), greedy, `ignore_eos`; prompts "
        f"{args.prompt_min}-{args.prompt_max} tokens, outputs {args.output_min}-{args.output_max} tokens, uniform, "
        f"seed {args.seed}")  # fmt: skip
    settings = ", ".join(f"{k}: {v}" for k, v in generation_settings(args).items())
    add(f"- Threads: onnxruntime intra-op {args.threads}, inter-op 1 in all three (one model thread each, the event "
        f"loop beside it); nothing pinned; the client is one asyncio process (this one). Agent: `generation: "
        f"{{{settings}}}`; static batches up to {args.max_num_seqs}")  # fmt: skip
    add("- Peak RSS: " + ", ".join(f"{LABELS[n]} {v / MiB:.0f} MiB" for n, v in res.rss.items()))
    add("")
    targets: list[str] = []
    found: dict[str, Any] = {}  # what each part measured, for the words on what bounds it
    _report_closed(res, add, targets, found)
    _report_open(res, add, targets, found)
    _report_overload(res, add, targets, found)
    add("### Targets")
    add("")
    add("| target | measured | reached |")
    add("|---|---|---|")
    out.extend(targets)
    add("")
    _report_bounds(res, add, found)
    add(END)
    return "\n".join(out), targets


def _per_token(runs: list[Run]) -> tuple[float, float]:
    """Seconds of the model thread per output token over the runs (their timing deltas, every token made):
    (in session.run, outside it)."""
    tokens = sum(r.tokens for run in runs for r in run.records) or 1
    model = sum(run.timing.get("model_s", 0.0) for run in runs)
    step = sum(run.timing.get("step_s", 0.0) for run in runs)
    return model / tokens, (step - model) / tokens


def _closed_table(res: Results, runs: dict[str, list[Run]], add: Any) -> dict[str, float]:
    add("| server | output tokens/s (median of rounds) | rounds | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) "
        "| TPOT p99 (ms) | model thread per output token: session.run, the rest (ms) | requests | errors "
        "| CPU (cores): server, client |")  # fmt: skip
    add("|---|---:|---|---:|---:|---:|---:|---|---:|---:|---|")
    rates = {}
    for name in SERVERS:
        group = runs[name]
        rates[name] = _median_of(group, Run.tokens_per_s)
        records = [r for run in group for r in run.records]
        ttft = [t for run in group for t in run.ttft()]
        tpot = [t for run in group for t in run.tpot()]
        cpu = np.mean([run.cpu[name] for run in group]), np.mean([run.cpu["client"] for run in group])
        model, rest = _per_token(group)
        add(f"| {LABELS[name]} | {rates[name]:.0f} | {', '.join(f'{run.tokens_per_s():.0f}' for run in group)} "
            f"| {_ms(_p(ttft, 50))} | {_ms(_p(ttft, 99))} | {_ms(_p(tpot, 50))} | {_ms(_p(tpot, 99))} "
            f"| {model * 1e3:.2f}, {rest * 1e3:.2f} | {len(records)} | {_errors(records)} "
            f"| {cpu[0]:.2f}, {cpu[1]:.2f} |")  # fmt: skip
    add("")
    return rates


def _overhead(run: Run) -> tuple[float, float, int]:
    """(overhead share, mean step seconds, steps) of a run's timing delta."""
    t = run.timing
    step_s, steps = t.get("step_s", 0.0), int(t.get("steps", 0))
    return ((step_s - t.get("model_s", 0.0)) / step_s if step_s else float("nan"), step_s / max(1, steps), steps)


def _report_closed(res: Results, add: Any, targets: list[str], found: dict[str, Any]) -> None:
    args = res.args
    n = args.max_num_seqs
    add(f"### 1. Closed loop: {n} streams, and {2 * n} (saturation)")
    add("")
    add(f"{n} (then {2 * n}) clients, each sending its next request when its last ended, {args.seconds:g} s a run, "
        f"the servers alternating, {args.rounds} round(s). Output tokens/s counts tokens made inside the run's "
        "window; TTFT from sending to the first token event; TPOT = (last token - first token) / (tokens - 1). "
        "Model thread per output token: its seconds in `session.run` and outside it over the runs (the server's "
        "step timing, prefill included), per token made. CPU: the server's process and the client's, in cores over "
        "the run.")  # fmt: skip
    add("")
    add(f"**{n} streams**")
    add("")
    r8 = _closed_table(res, res.closed8, add)
    add(f"**{2 * n} streams (saturation)**")
    add("")
    r16 = _closed_table(res, res.closed16, add)
    shares = [_overhead(run) for run in res.closed8["agent"]]
    steps = sum(s[2] for s in shares)
    share = float(np.average([s[0] for s in shares], weights=[max(1, s[2]) for s in shares]))
    step = float(np.average([s[1] for s in shares], weights=[max(1, s[2]) for s in shares]))
    peer_shares = {name: _overhead(res.closed8[name][0])[0] for name in ("naive", "static")}
    add(f"The agent's step timing over the {n}-stream runs (its status `timing`, after minus before): {steps} steps, "
        f"{step * 1e3:.2f} ms a step, of which {share * 100:.1f} % outside `session.run` (the peers, same measure: "
        + ", ".join(f"{LABELS[k]} {v * 100:.1f} %" for k, v in peer_shares.items())
        + f"). Saturated capacity of the agent: {res.capacity_rps:.2f} requests/s (its {2 * n}-stream tokens/s over "
        f"the mean max_tokens).")  # fmt: skip
    add("")
    ratio1 = r8["agent"] / r8["naive"]
    targets.append(f"| (c) >= 3x (a) output tokens/s at {n} streams | {r8['agent']:.0f} / {r8['naive']:.0f} = "
                   f"**{ratio1:.2f}x** | {_yes(ratio1 >= 3)} |")  # fmt: skip
    ratio2 = r16["agent"] / r16["static"]
    targets.append(f"| (c) >= 1x (b) output tokens/s at saturation ({2 * n} streams) | {r16['agent']:.0f} / "
                   f"{r16['static']:.0f} = **{ratio2:.3f}x** | {_yes(ratio2 >= 1)} |")  # fmt: skip
    targets.append(f"| scheduler overhead (all but session.run) <= 10 % of step time at {n} streams | "
                   f"**{share * 100:.1f} %** of {step * 1e3:.2f} ms | {_yes(share <= 0.10)} |")  # fmt: skip
    found.update(ratio1=ratio1, ratio2=ratio2, share=share, step8=step, r8=r8, r16=r16)


def _report_open(res: Results, add: Any, targets: list[str], found: dict[str, Any]) -> None:
    args = res.args
    slo = args.ttft_slo_ms / 1e3
    any_run = res.open_runs["agent"]
    add(f"### 2. Open loop: Poisson arrivals at {any_run.rate:.2f} requests/s ({args.load:g} x the agent's "
        "saturated capacity)")  # fmt: skip
    add("")
    add(f"The same seeded arrivals for all three, {args.open_s:g} s, answers awaited up to {args.drain_s:g} s after "
        f"the last arrival. TTFT from when a request was due. Goodput: requests whose stream was whole and whose "
        f"TTFT <= {args.ttft_slo_ms:g} ms (the SLO), as a share of those sent and per second of the run.")  # fmt: skip
    add("")
    add("| server | output tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) | goodput (share) "
        "| goodput (req/s) | sent | errors | outcomes |")  # fmt: skip
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name in SERVERS:
        run = res.open_runs[name]
        ttft, tpot = run.ttft(), run.tpot()
        good = sum(1 for r in run.records if r.ttft is not None and r.ttft <= slo)
        sent = len(run.records)
        add(f"| {LABELS[name]} | {run.tokens_per_s():.0f} | {_ms(_p(ttft, 50))} | {_ms(_p(ttft, 99))} "
            f"| {_ms(_p(tpot, 50))} | {_ms(_p(tpot, 99))} | {good / max(1, sent) * 100:.1f} % "
            f"| {good / run.seconds:.2f} | {sent} | {_errors(run.records)} | {_outcomes(run.records)} |")  # fmt: skip
    add("")
    add(f"**A request that arrives mid-batch** (while 1-{args.max_num_seqs - 1} others of the run are in flight): "
        "its TTFT against its own prefill, which is its TTFT alone: a + b x prompt tokens, fitted over "
        f"{args.calibration} requests sent one at a time to the same server (prompts {args.prompt_min}-"
        f"{args.prompt_max}); a step is the server's mean step time over this run (its timing, after minus "
        "before). Two sets: every such arrival, and those that arrived while every other request in flight was "
        "already decoding (had its first token: none queued or prefilling ahead of it), the case the target is "
        "about: what a batch in progress costs a newcomer, apart from queueing behind other newcomers' "
        "prompts.")  # fmt: skip
    add("")
    add("| server | arrivals | TTFT alone: a (ms) + b (ms/token) | mean step (ms) | requests | TTFT p50 (ms) "
        "| TTFT p99 (ms) | TTFT - own prefill, p50 (ms) | TTFT - own prefill, p99 (ms) | p99 / step |")  # fmt: skip
    add("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    excess_p99: dict[tuple[str, bool], float | None] = {}
    excess_p50: dict[bool, float | None] = {}
    steps: dict[str, float] = {}
    for name in SERVERS:
        run = res.open_runs[name]
        a, b = res.fit[name]
        _, step, _ = _overhead(run)
        steps[name] = step
        for clean in (False, True):
            mid = [r for r in run.records if r.ttft is not None and 1 <= r.others <= args.max_num_seqs - 1
                   and (not clean or r.unstarted == 0)]  # fmt: skip
            ttft = [r.ttft for r in mid if r.ttft is not None]
            excess = [r.ttft - (a + b * len(r.req.prompt)) for r in mid if r.ttft is not None]
            excess_p99[name, clean] = _p(excess, 99)
            if name == "agent":
                excess_p50[clean] = _p(excess, 50)
            per_step = (excess_p99[name, clean] or 0) / step if step else float("nan")
            which = "all others decoding" if clean else "any"
            add(f"| {LABELS[name]} | {which} | {a * 1e3:.1f} + {b * 1e3:.3f} | {step * 1e3:.2f} | {len(mid)} "
                f"| {_ms(_p(ttft, 50))} | {_ms(_p(ttft, 99))} | {_ms(_p(excess, 50))} | {_ms(excess_p99[name, clean])} "
                f"| {per_step:.1f} |")  # fmt: skip
    add("")
    agent, agent_any = excess_p99["agent", True], excess_p99["agent", False]
    reached = agent is not None and agent <= 2 * steps["agent"]
    found.update(mid_p99=agent, mid_step=steps["agent"], mid_reached=reached, mid_p50=excess_p50[True],
                 mid_any_p99=agent_any)  # fmt: skip
    static = excess_p99["static", True]
    targets.append(f"| TTFT p99 mid-batch <= 2 steps + its own prefill | p99 of TTFT - own prefill, arrivals while "
                   f"the others decode: agent **{_ms(agent)} ms** against 2 x {steps['agent'] * 1e3:.2f} ms = "
                   f"{2 * steps['agent'] * 1e3:.1f} ms (every mid-batch arrival: {_ms(agent_any)} ms; static "
                   f"batching: {_ms(static)} ms, waiting for its batch) | {_yes(reached)} |")  # fmt: skip


def _report_overload(res: Results, add: Any, targets: list[str], found: dict[str, Any]) -> None:
    args, run = res.args, res.overload
    assert run is not None
    add(f"### 3. The agent at {args.overload:g}x its capacity, {args.high_share * 100:g} % at priority 1")
    add("")
    deadline = f"`timeout` {args.low_timeout_ms * 1000} us (first-token deadline)" if args.low_timeout_ms else "none"
    add(f"Open loop at {run.rate:.2f} requests/s ({args.overload:g} x {res.capacity_rps:.2f}), {args.open_s:g} s; "
        f"priority 1 with probability {args.high_share:g} (no deadline), else priority 3 ({deadline}). Unloaded: "
        f"{len(res.unloaded_high)} priority-1 requests one at a time (max_tokens 1), prompts as above.")  # fmt: skip
    add("")
    add("| priority | sent | whole streams | refused (503/429) | errors | unloaded TTFT p50 (ms) | unloaded TTFT p99 "
        "(ms) | loaded TTFT p50 (ms) | loaded TTFT p99 (ms) | p99 loaded / unloaded |")  # fmt: skip
    add("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    unloaded = [r.ttft for r in res.unloaded_high if r.ttft is not None]
    ratio = None
    for level in (1, 3):
        records = [r for r in run.records if r.req.priority == level]
        loaded = run.ttft(level)
        u = unloaded if level == 1 else []
        l99, u99 = _p(loaded, 99), _p(u, 99)
        if level == 1:
            ratio = l99 / u99 if l99 and u99 else None
        add(f"| {level} | {len(records)} | {sum(r.ok for r in records)} | {sum(r.refused() for r in records)} "
            f"| {_errors(records)} | {_ms(_p(u, 50))} | {_ms(u99)} | {_ms(_p(loaded, 50))} | {_ms(l99)} "
            f"| {'-' if level != 1 or ratio is None else f'{ratio:.2f}'} |")  # fmt: skip
    add("")
    share, step, _ = _overhead(run)
    add(f"Outcomes: {_outcomes(run.records)}. Output tokens/s {run.tokens_per_s():.0f}; the agent's mean step "
        f"{step * 1e3:.2f} ms ({share * 100:.1f} % outside `session.run`).")  # fmt: skip
    if args.low_timeout_ms:
        limit = args.low_timeout_ms / 1e3
        admitted = run.ttft(3)
        late = sum(1 for t in admitted if t > limit)
        found.update(low_late=late, low_admitted=len(admitted))
        refused = sum(r.refused() for r in run.records)
        add("")
        add(f"Of priority 3's {len(admitted)} admitted requests, {late} had their first token after their "
            f"{args.low_timeout_ms} ms deadline (admission refused {refused} at arrival).")  # fmt: skip
    add("")
    found.update(prio_ratio=ratio, prio_step=step)
    targets.append(f"| priority 1 TTFT p99 at {args.overload:g}x <= 2x unloaded | {_ms(_p(run.ttft(1), 99))} / "
                   f"{_ms(_p(unloaded, 99))} ms = **{'-' if ratio is None else f'{ratio:.2f}x'}** "
                   f"| {_yes(ratio is not None and ratio <= 2)} |")  # fmt: skip


def _report_bounds(res: Results, add: Any, found: dict[str, Any]) -> None:
    args = res.args
    add("### What bounds the numbers")
    add("")
    add("The runner's decode step in this process before the servers start (one thread, as theirs), caches of "
        f"{args.prompt_min}-{args.prompt_max} prompt tokens a row, the same rows step after step (the steady state: "
        f"no row joins or leaves), {args.anatomy_s:g} s a batch size:")  # fmt: skip
    add("")
    add("| batch | step (ms) | of which session.run (ms) | outside session.run | tokens/s |")
    add("|---:|---:|---:|---:|---:|")
    for a in res.anatomy:
        add(f"| {a['batch']:.0f} | {a['step_ms']:.2f} | {a['run_ms']:.2f} | "
            f"{(1 - a['run_ms'] / a['step_ms']) * 100:.0f} % | {a['tokens_per_s']:.0f} |")  # fmt: skip
    add("")
    engine: dict[str, int] = {}
    if res.profile:
        engine = res.profile.get("engine") or {}
        total = sum(engine.values())
        add(f"py-spy on the agent at {args.max_num_seqs} streams (another closed-loop run, {args.profile_s} s, 200 Hz, "
            f"every thread). Its engine thread ({total} samples of {res.profile['expected_per_thread']} if always "
            "busy), by what each sample's stack was in:")  # fmt: skip
        add("")
        add("| part of the step | samples | share |")
        add("|---|---:|---:|")
        for part, n in sorted(engine.items(), key=lambda kv: -kv[1]):
            add(f"| {part} | {n} | {n / max(1, total) * 100:.1f} % |")
        add("")
        add("Self time (the innermost frame), every thread of the agent:")
        add("")
        add("| thread | function | samples | share |")
        add("|---|---|---:|---:|")
        for top in res.profile["top"][:10]:
            add(f"| {top['thread']} | `{top['function']}` | {top['samples']} | {top['share'] * 100:.1f} % |")
        add("")
    else:
        add("py-spy is not installed (`.venv/bin/pip install py-spy`): no profile; the step timings split "
            "session.run from the rest.")  # fmt: skip
        add("")
    for words in _bound_words(res, found, engine):
        add(f"- {words}")
    add("")


def _bound_words(res: Results, found: dict[str, Any], engine: dict[str, int]) -> list[str]:
    """What bounds each target, in words, from this run's own measurements."""
    args, out = res.args, []
    b = res.fit["agent"][1]  # seconds of prefill a prompt token
    prefill = b * res.mean_prompt
    one, eight = [*res.anatomy, {}, {}][:2]
    if one and eight:
        s1, s8, gain = one["step_ms"] / 1e3, eight["step_ms"] / 1e3, eight["tokens_per_s"] / one["tokens_per_s"]
        alone, batched = prefill + res.mean_output * s1, prefill + res.mean_output * s8 / 8
        out.append(
            f"**(c) against (a) at {args.max_num_seqs} streams, {found['ratio1']:.2f}x**: the model bounds it. One "
            f"decode call for 8 rows makes {gain:.2f}x the tokens/s of one row (session.run grows "
            f"{eight['run_ms'] / one['run_ms']:.1f}x from 1 row to 8: the graph concatenates and attends over every "
            f"row's cache), and a prompt's prefill ({prefill * 1e3:.0f} ms "
            f"for the mean {res.mean_prompt:.0f} tokens at {b * 1e3:.2f} ms a token) is one call per prompt in all "
            f"three servers. A request of mean size then takes {alone * 1e3:.0f} ms of model time alone and "
            f"{batched * 1e3:.0f} ms of a full batch of 8: at most {alone / batched:.2f}x before HTTP or scheduling "
            "costs anything" + ("; 3x is out of reach for this model and runner on this CPU." if alone / batched < 3
                                else ".")
        )  # fmt: skip
    if found["ratio2"] < 1:
        (am, ar), (sm, sr) = _per_token(res.closed16["agent"]), _per_token(res.closed16["static"])
        where = "session.run" if am - sm >= ar - sr else "the model thread's time outside session.run"
        out.append(
            f"**(c) against (b) at saturation, {found['ratio2']:.3f}x**: per output token the agent's model thread "
            f"spends {am * 1e3:.2f} ms in session.run and {ar * 1e3:.2f} ms outside it, static batching "
            f"{sm * 1e3:.2f} and {sr * 1e3:.2f} ms: the gap is mostly {where}. Static batching decodes the same rows "
            "step after step until they end, with every prompt prefilled in one call before; the agent's rows "
            "change at every join and leave and its steps carry prefill chunks of at most "
            f"{args.long_prefill_threshold} tokens beside the decodes (two session calls)."
        )  # fmt: skip
    total = sum(engine.values())
    runner = engine.get("the runner around it: caches in and out, feeds", 0) / total if total else None
    model = engine.get("session.run (the model)", 0) / total if total else None
    if runner is not None and model is not None:
        rest = 1 - runner - model
        tops = [t for t in (res.profile or {}).get("top", []) if "generate-" in t["thread"]
                and not t["function"].startswith("Session.run")][:3]  # fmt: skip
        named = ", ".join(f"`{t['function'].split(' (')[0]}` {t['share'] * 100:.1f} %" for t in tops)
        bound = "the runner's handling of the caches" if runner >= rest else "the engine's own Python"
        out.append(
            f"**Overhead {found['share'] * 100:.1f} % of the step outside session.run** (target 10 %): py-spy puts "
            f"{runner * 100:.1f} % of the engine thread's samples in the runner's own Python around the session call "
            f"(the batch's caches in and out, the feeds) and {rest * 100:.1f} % in everything the engine adds "
            "(planning, blocks, sampling, detokenization, handing chunks to the event loop); the largest self times "
            f"outside session.run: {named or 'none'}. What bounds it is {bound}, not the scheduler's planning."
        )  # fmt: skip
    elif eight:
        out.append(f"**Overhead {found['share'] * 100:.1f} %**: the bare runner alone spends "
                   f"{(1 - eight['run_ms'] / eight['step_ms']) * 100:.0f} % of a steady batch-8 decode step outside "
                   "session.run, before the engine adds anything (no profile to split the rest).")  # fmt: skip
    if found.get("mid_p99") is not None and not found.get("mid_reached"):
        chunk = args.long_prefill_threshold * b
        p50 = found.get("mid_p50")
        out.append(
            f"**Mid-batch TTFT**: for arrivals while the others decode, TTFT - own prefill is {_ms(p50)} ms at p50 "
            f"and {_ms(found['mid_p99'])} ms at p99 (every mid-batch arrival: {_ms(found['mid_any_p99'])} ms), "
            f"{(p50 or 0) / found['mid_step']:.1f} and {found['mid_p99'] / found['mid_step']:.1f} mean steps of "
            f"{found['mid_step'] * 1e3:.2f} ms. The mean "
            "step is short because most steps decode a few rows; an arrival waits for the step in progress, which "
            f"may carry another prompt's chunk (up to `long_prefill_threshold` {args.long_prefill_threshold} tokens, "
            f"{chunk * 1e3:.0f} ms at the measured {b * 1e3:.2f} ms a token, {chunk / found['mid_step']:.1f} mean "
            "steps on its own), and each of its own chunks shares a step with the running rows' decode. A bound of "
            "two mean steps cannot hold at p99 while one prompt chunk costs several decode steps."
        )  # fmt: skip
    ratio = found.get("prio_ratio")
    if ratio is not None:
        verdict = "holds" if ratio <= 2 else "does not hold"
        out.append(
            f"**Priority 1 at {args.overload:g}x**: {ratio:.2f}x its unloaded p99, so the target {verdict}. A "
            "priority-1 arrival goes before the waiting priority-3 requests and may preempt a running lower-priority "
            f"sequence when {args.max_num_seqs} are running; what it still waits for is the step in progress (mean "
            f"{found['prio_step'] * 1e3:.1f} ms under overload: a full batch of decodes and prefill chunks) and the "
            "decodes its own chunks share steps with."
        )  # fmt: skip
    if found.get("low_late"):
        out.append(
            f"**Admission under overload**: {found['low_late']} of {found['low_admitted']} admitted priority-3 "
            f"requests got their first token after their {args.low_timeout_ms} ms deadline. Admission predicts the "
            "first token at arrival from the prefill ahead and the wait for a place among the "
            f"`max_num_seqs` ({args.max_num_seqs}) running sequences; what it cannot foresee is the priority-1 "
            "requests that arrive after it and go before it, and the places they take."
        )  # fmt: skip
    return out


# ---- main -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="put the tables into docs/benchmarks.md")
    parser.add_argument("--quick", action="store_true", help="short points: a smoke test, not a result")
    parser.add_argument("--seconds", type=float, default=10.0, help="a closed-loop run")
    parser.add_argument("--rounds", type=int, default=2, help="closed-loop rounds (servers alternating)")
    parser.add_argument("--open-s", type=float, default=15.0, help="an open-loop run")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--drain-s", type=float, default=30.0, help="open loop: how long to await answers")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads, all three servers")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the agent's max_num_seqs, static's batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--long-prefill-threshold", type=int, default=128)
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=256)
    parser.add_argument("--output-min", type=int, default=16)
    parser.add_argument("--output-max", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--calibration", type=int, default=40, help="requests sent one at a time")
    parser.add_argument("--load", type=float, default=0.5, help="open loop: share of the agent's capacity")
    parser.add_argument("--ttft-slo-ms", type=float, default=500.0)
    parser.add_argument("--overload", type=float, default=2.0, help="multiple of the agent's capacity")
    parser.add_argument("--high-share", type=float, default=0.2, help="share at priority 1 (the rest at 3)")
    parser.add_argument("--low-timeout-ms", type=int, default=2000, help="priority 3's first-token deadline (0: none)")
    parser.add_argument("--anatomy-s", type=float, default=2.0, help="seconds of each decode-anatomy batch size")
    parser.add_argument("--profile-s", type=int, default=8, help="py-spy on the agent (0: none)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.open_s, args.warmup_s, args.drain_s = 4.0, 1, 5.0, 1.5, 15.0
        args.calibration, args.anatomy_s, args.profile_s = 10, 0.5, 2
    command = shlex.join([".venv/bin/python", "bench/generate.py", *argv])
    res = run(args, command)
    markdown, targets = report(res)
    print(markdown)
    log("targets:\n" + "\n".join(targets))
    if args.write:
        common.write_docs(markdown, BEGIN, END)


if __name__ == "__main__":
    main()
