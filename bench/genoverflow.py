"""Issue 14's benchmark: overflow of generative streams to an OpenAI-compatible cloud through the control plane's
gateway, with real processes on loopback.

One invocation starts a control plane (its gateway inside), an edge agent serving the bench decoder (`tiny-lm-bench`,
`spillway models build-demo --size bench`) with overflow on, and a Spillway agent in cloud role with the same model
and generation settings, registered with the gateway as an `openai` backend; then:

  1. capacity: each agent alone (the other idle), closed loop at twice its `max_num_seqs` streams: streams/s;
  2. unloaded: open loop at a quarter of the edge's capacity through the edge: TTFT per priority;
  3. overload: open loop (Poisson, seeded) at `--overload` x the edge's capacity through the edge, `--high-share` at
     priority 1 and the rest at 3, every request with a first-token deadline (`timeout`) equal to the TTFT SLO;
     each stream counted by its `spillway-outcome`. Targets: goodput (whole streams whose first token came within
     the SLO, served locally or in the cloud) >= 90 % of edge + cloud capacity; priority 1's TTFT p99 <= 2x its
     unloaded p99; nothing lost (every stream ends with `[DONE]`, an error event, or an HTTP answer);
  4. what the gateway adds to the time to first byte: the same small streamed request (max_tokens 1) to the cloud
     directly and through the gateway (`POST /v1/completions` with the edge agent's token), in interleaved rounds
     over fresh connections (as the agent opens them); p50 of the time to the first byte of the answer's body (the
     stream's first event) and to its head, the medians of the rounds' medians, and the difference. Target: <= 1 ms
     at p50.

`--breaker-errors-off` sets the edge's breaker to never open on failures, to show what bounds goodput without it.

Every process shares the machine's cores (the report names them, the load average, and each agent's CPU during the
overload); the load generator is one
asyncio process (this one, raw HTTP/1.1, one connection per stream). Results go to stdout and, with `--write`,
between markers in `docs/benchmarks.md`.

    .venv/bin/python bench/genoverflow.py --write
    .venv/bin/python bench/genoverflow.py --quick     # short points: a smoke test, not a result
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.common import free_port, log, median, percentile  # noqa: E402
from bench.generate import MiB, Record, Req, _dechunk, _error_code, _event, payload, workload  # noqa: E402
from bench.procstat import cpu_seconds, loadavg, vm_hwm  # noqa: E402
from spillway.demo.harness import Process, stop  # noqa: E402
from spillway.demo.models import BENCH_LM  # noqa: E402

BEGIN = "<!-- bench/genoverflow.py: begin (generated; edit outside these markers) -->"
END = "<!-- bench/genoverflow.py: end -->"
PATH = "/v1/completions"


# ---- the client -------------------------------------------------------------------------------------


@dataclass
class GenRecord(Record):
    """A stream as the client saw it, with Spillway's headers and the time its answer's head came."""

    answered: str = ""  # spillway-outcome
    backend: str = ""  # spillway-backend
    head: float | None = None  # the first byte of the answer (its status line)
    body: float | None = None  # the first byte of its body (a stream's first event)

    def ended_once(self) -> bool:
        """An answer with one ending: a whole stream ([DONE]), an error event without [DONE], or an HTTP error."""
        if self.status == 200:
            return self.done != self.error.startswith("error event")
        return self.status != 0


async def exchange(host: str, port: int, path: str, body: bytes, record: GenRecord, headers: str = "") -> None:
    """One POST over a fresh connection; its answer's events timed into `record` (bench/generate.py's parsing)."""
    clock = time.perf_counter
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        record.error = f"connection failed: {type(exc).__name__}"
        return
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{headers}"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)  # fmt: skip
        first = await reader.read(1)
        record.head = clock()
        head = first + await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lowered = head.lower()
        for line in lowered.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name == b"spillway-outcome":
                record.answered = value.strip().decode()
            elif name == b"spillway-backend":
                record.backend = value.strip().decode()
        chunked = b"transfer-encoding: chunked" in lowered
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
            if record.body is None:
                record.body = clock()
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                _event(event, record, clock())
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        record.error = record.error or f"{type(exc).__name__} mid-answer"
    finally:
        writer.close()


async def closed_loop(host: str, port: int, reqs: list[Req], clients: int, seconds: float,
                      headers: str = "") -> tuple[list[GenRecord], float]:  # fmt: skip
    """`clients` streams back to back for `seconds`; the records and the wall time."""
    clock = time.perf_counter
    records: list[GenRecord] = []
    counter = iter(range(1_000_000))
    start = clock()
    end = start + seconds

    async def client() -> None:
        while clock() < end:
            req = reqs[next(counter) % len(reqs)]
            record = GenRecord(req, clock(), req.max_tokens)
            records.append(record)
            await exchange(host, port, PATH, payload(req), record, headers)

    await asyncio.gather(*(client() for _ in range(clients)))
    return records, clock() - start


async def open_loop(host: str, port: int, reqs: list[Req], rate: float, seconds: float, seed: int, drain_s: float,
                    timeout_us: int | None) -> tuple[list[GenRecord], tuple[float, float]]:  # fmt: skip
    """Poisson arrivals at `rate` for `seconds` (seeded); each request with `timeout_us` (its first-token deadline);
    waits at most `drain_s` after the last arrival (what is still open then is cut off: lost)."""
    clock = time.perf_counter
    draw = random.Random(seed)
    dues, t = [], draw.expovariate(rate)
    while t < seconds:
        dues.append(t)
        t += draw.expovariate(rate)
    records: list[GenRecord] = []
    start = clock() + 0.05
    tasks = []
    for i, due in enumerate(dues):
        delay = start + due - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        req = reqs[i % len(reqs)]
        record = GenRecord(req, start + due, req.max_tokens)
        records.append(record)
        tasks.append(asyncio.ensure_future(exchange(host, port, PATH, payload(req, timeout_us=timeout_us), record)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.status == 0 and not record.error:
            record.error = f"cut off: no answer within {drain_s:g} s of the last arrival"
    return records, (start, start + seconds)


async def ttfb_rounds(targets: dict[str, tuple[str, int, str]], body: bytes, rounds: int, per_round: int,
                      ) -> dict[str, list[list[GenRecord]]]:  # fmt: skip
    """Each round: `per_round` requests one after another to each target in turn (A B A B ...)."""
    out: dict[str, list[list[GenRecord]]] = {name: [] for name in targets}
    req = Req(0, "", 1)
    for _ in range(rounds):
        for name, (host, port, headers) in targets.items():
            records = []
            for _ in range(per_round):
                record = GenRecord(req, time.perf_counter(), 1)
                await exchange(host, port, PATH, body, record, headers)
                records.append(record)
            out[name].append(records)
    return out


# ---- the system -------------------------------------------------------------------------------------


def generation(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": 512, "long_prefill_threshold": 128,
            "block_size": 16, "kv_budget_bytes": 64 * MiB, "levels": 3, "default_level": 2}  # fmt: skip


class System:
    """A control plane, the edge agent and the cloud agent; `close()` stops them."""

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        import yaml

        from spillway.demo.models import build_bench_repository
        from spillway.demo.story import Story

        self.story = Story(workdir / "story", port=free_port(), agent_port=free_port(), interval_s=1.0)
        self.procs: dict[str, Process] = {}
        story = self.story
        story.prepare()
        story.start_control_plane()
        self.procs["controlplane"] = story.cp  # type: ignore[assignment]
        models = build_bench_repository(workdir / "models")
        with story.api() as client:
            made = client.post("/api/v1/agents", json={"name": "bench-edge", "device_class": "cpu",
                                                        "labels": {"bench": "genoverflow"}})  # fmt: skip
            made.raise_for_status()
        self.edge_id, self.edge_token = made.json()["agent"]["id"], made.json()["token"]
        self.edge_port, self.cloud_port = free_port(), free_port()
        env = {**story.env(), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        common_config = {"model_repository": str(models), "intra_op_threads": 1, "inter_op_threads": 1,
                         "generation": generation(args)}  # fmt: skip
        cloud = {**common_config, "port": self.cloud_port, "role": "cloud", "agent_id": "bench-cloud",
                 "state_dir": str(workdir / "state-cloud")}  # fmt: skip
        edge = {**common_config, "port": self.edge_port, "agent_id": self.edge_id, "control_plane": story.base,
                "export_interval_s": 1.0, "policy_poll_interval_s": 1.0, "state_dir": str(workdir / "state-edge"),
                "overflow": {"enabled": True, "max_in_flight": 64,
                             "breaker": {"error_ratio": None} if args.breaker_errors_off else {}}}  # fmt: skip
        for name, config in (("cloud", cloud), ("edge", edge)):
            (workdir / f"{name}.yaml").write_text(yaml.safe_dump(config))
            extra = {"SPILLWAY_AGENT_TOKEN": self.edge_token} if name == "edge" else {}
            self.procs[name] = story.start_agent_process(name, workdir / f"{name}.yaml", workdir / f"{name}.log",
                                                         {**env, **extra})  # fmt: skip
        for name, port in (("cloud", self.cloud_port), ("edge", self.edge_port)):
            self.procs[name].wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", timeout_s=180, interval_s=0.2)
        with story.api() as client:
            made = client.post("/api/v1/backends", json={
                "name": "bench-cloud", "url": f"http://127.0.0.1:{self.cloud_port}", "protocol": "openai",
                "models": [BENCH_LM], "max_concurrency": 2 * args.max_num_seqs, "timeout_ms": 60_000,
            })  # fmt: skip
            if made.status_code != 201:
                raise RuntimeError(f"registering the cloud failed: {made.status_code} {made.text}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with story.api() as client:
                gateway = client.get("/api/v1/status").json().get("gateway") or {}
            backends = gateway.get("backends", []) if isinstance(gateway, dict) else gateway
            if any(b["name"] == "bench-cloud" and b.get("healthy") for b in backends):
                break
            time.sleep(0.2)
        else:
            raise RuntimeError("the gateway did not count the cloud healthy within 30 s")

    def cpu(self) -> dict[str, float]:
        return {name: cpu_seconds([proc.pid]) for name, proc in self.procs.items()}

    def close(self) -> None:
        for name in ("edge", "cloud"):
            stop(self.procs.get(name))
        self.story.__exit__(None, None, None)


# ---- measuring --------------------------------------------------------------------------------------


@dataclass
class Results:
    args: argparse.Namespace
    command: str
    started: dt.datetime
    minutes: float = 0.0
    capacity: dict[str, float] | None = None
    capacity_ttft: dict[str, float | None] | None = None
    unloaded: list[GenRecord] | None = None
    overload: list[GenRecord] | None = None
    window: tuple[float, float] = (0.0, 0.0)
    rate: float = 0.0
    cpu: dict[str, float] | None = None
    ttfb: dict[str, list[list[GenRecord]]] | None = None
    rss: dict[str, int] | None = None
    load: tuple[str, str] = ("", "")


def run(args: argparse.Namespace, command: str) -> Results:
    res = Results(args, command, dt.datetime.now(dt.timezone.utc))
    started = time.monotonic()
    res.load = (loadavg(), "")
    reqs = workload(args.seed, 4000, (args.prompt_min, args.prompt_max), (args.output_min, args.output_max))
    mixed = workload(args.seed + 1, 4000, (args.prompt_min, args.prompt_max), (args.output_min, args.output_max),
                     high_share=args.high_share)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-genoverflow-") as tmp:
        workdir = Path(tmp)
        log("starting the control plane, the edge agent and the cloud agent")
        system = System(workdir, args)
        loop = asyncio.new_event_loop()
        try:
            host = "127.0.0.1"
            res.capacity, res.capacity_ttft = {}, {}
            for name, port in (("edge", system.edge_port), ("cloud", system.cloud_port)):
                clients = 2 * args.max_num_seqs
                loop.run_until_complete(closed_loop(host, port, reqs, clients, args.warmup_s))
                records, took = loop.run_until_complete(closed_loop(host, port, reqs, clients, args.capacity_s))
                whole = [r for r in records if r.ok]
                res.capacity[name] = len(whole) / took
                res.capacity_ttft[name] = percentile([r.ttft for r in whole if r.ttft is not None], 50)
                log(f"capacity {name}: {res.capacity[name]:.2f} streams/s")
            edge_cap = res.capacity["edge"]
            log("unloaded, a quarter of the edge's capacity")
            deadline_us = args.slo_ms * 1000
            unloaded = open_loop(
                host, system.edge_port, mixed, edge_cap / 4, args.unloaded_s, args.seed, 60, deadline_us
            )
            res.unloaded, _ = loop.run_until_complete(unloaded)
            res.rate = args.overload * edge_cap
            log(f"overload: {res.rate:.1f} streams/s for {args.overload_s:g} s")
            before = system.cpu()
            t0 = time.monotonic()
            overload = open_loop(
                host, system.edge_port, mixed, res.rate, args.overload_s, args.seed + 2, 60, deadline_us
            )
            res.overload, res.window = loop.run_until_complete(overload)
            took = time.monotonic() - t0
            after = system.cpu()
            res.cpu = {k: (after[k] - before[k]) / took for k in before}
            res.cpu["client"] = 0.0
            log("time to first byte: direct and through the gateway")
            body = json.dumps({"model": BENCH_LM, "prompt": "edge", "max_tokens": 1, "temperature": 0,
                               "stream": True}).encode()  # fmt: skip
            auth = f"Authorization: Bearer {system.edge_token}\r\n"
            cp_host, cp_port = common.url_parts(system.story.base)
            targets = {"direct": (host, system.cloud_port, ""), "gateway": (cp_host, cp_port, auth)}
            loop.run_until_complete(ttfb_rounds(targets, body, 1, args.ttfb_per_round))  # warm-up, not kept
            res.ttfb = loop.run_until_complete(ttfb_rounds(targets, body, args.ttfb_rounds, args.ttfb_per_round))
            res.rss = {name: vm_hwm(proc.pid) for name, proc in system.procs.items() if proc is not None}
        finally:
            loop.close()
            system.close()
    res.load = (res.load[0], loadavg())
    res.minutes = (time.monotonic() - started) / 60
    return res


# ---- the report -------------------------------------------------------------------------------------


def _ms(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value * 1000:.{digits}f}"


def _ttft(records: list[GenRecord], level: int | None = None) -> list[float]:
    return [r.ttft for r in records if r.ttft is not None and (level is None or r.req.priority == level)]


def report(res: Results) -> str:
    args = res.args
    lines = common.section_head(BEGIN, "Generative overflow: the edge, the gateway and an OpenAI-compatible cloud "
                                "(`bench/genoverflow.py`)", res.command, started=res.started, minutes=res.minutes,
                                code="code at commit " + common.revision("edge_agent", "controlplane"))  # fmt: skip
    info = common.machine()
    lines += [
        f"- Machine: {common.machine_words(info)}; load average {res.load[0]} at the start, "
        f"{res.load[1]} at the end (a shared machine: provisional numbers)",
        f"- Model: `{BENCH_LM}` (width 512, 4 layers; `spillway models build-demo --size bench`), greedy, `ignore_eos`;"
        f" prompts {args.prompt_min}-{args.prompt_max} tokens, outputs {args.output_min}-{args.output_max}, uniform, "
        f"seed {args.seed}",
        f"- Both agents: onnxruntime intra-op 1, inter-op 1, `generation: {json.dumps(generation(args))}`. Edge: "
        "`overflow: {enabled: true, max_in_flight: 64}` (a stream predicted to miss its first-token deadline goes to "
        "the gateway), "
        + (
            "the breaker with `error_ratio: null` (it never opens on failures)."
            if args.breaker_errors_off
            else "the agent's default breaker (opens above 50 % failed in 10 s, >= 5 requests, for 5 s)."
        )
        + " Cloud: `role: cloud`; backend `protocol: openai`, "
        f"`max_concurrency: {2 * args.max_num_seqs}` (twice the sequences it decodes at once: the gateway says "
        "`no_capacity` for more, which the edge's breaker does not count as a failure), `timeout_ms: 60000`",
        "- Every process on the same cores, nothing pinned: the control plane (REST API, control loop, gateway), the "
        "two agents, and this script's asyncio client (raw HTTP/1.1, a connection per stream)",
    ]
    if res.rss:
        lines.append("- Peak RSS: " + ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in res.rss.items()))
    lines.append("")
    targets: list[tuple[str, str, bool]] = []
    cap = res.capacity or {}
    lines += ["### 1. Capacity, each agent alone", "",
              f"Closed loop, {2 * args.max_num_seqs} streams, {args.warmup_s:g} s warm-up then {args.capacity_s:g} s, "
              "the other agent idle; whole streams per second.", "",
              "| agent | capacity (streams/s) | TTFT p50 (ms) |", "|---|---:|---:|"]  # fmt: skip
    for name in ("edge", "cloud"):
        lines.append(f"| {name} | {cap.get(name, 0):.2f} | {_ms((res.capacity_ttft or {}).get(name))} |")
    lines.append("")
    overload = res.overload or []
    unloaded = res.unloaded or []
    slo_s = args.slo_ms / 1000
    t0, t1 = res.window
    good = [r for r in overload if r.ok and r.ttft is not None and r.ttft <= slo_s]
    goodput = len(good) / (t1 - t0) if t1 > t0 else 0.0
    both = cap.get("edge", 0) + cap.get("cloud", 0)
    lost = [r for r in overload + unloaded if not r.ended_once()]
    p1_unloaded = percentile(_ttft(unloaded, 1), 99)
    p1_loaded = percentile(_ttft(overload, 1), 99)
    lines += ["### 2. Open loop at 3x the edge's capacity", "",
              f"Poisson arrivals (seeded), {args.high_share:.0%} at priority 1 and the rest at 3, every request with "
              f"`timeout` {args.slo_ms * 1000} us (its first-token deadline, the TTFT SLO of {args.slo_ms} ms); "
              f"unloaded: {cap.get('edge', 0) / 4:.2f} streams/s for {args.unloaded_s:g} s; overload: "
              f"{res.rate:.2f} streams/s for {args.overload_s:g} s. TTFT from when a stream was due. Goodput: whole "
              f"streams (`[DONE]`) whose first token came within {args.slo_ms} ms, served locally or in the cloud. "
              "Lost: no HTTP answer, or a stream that ended with neither `[DONE]` nor an error event.", "",
              "| offered (streams/s) | goodput (streams/s) | edge + cloud capacity | goodput / capacities | sent | "
              "lost |", "|---:|---:|---:|---:|---:|---:|",
              f"| {res.rate:.2f} | {goodput:.2f} | {both:.2f} | **{goodput / both:.1%}** | {len(overload)} | "
              f"{len(lost)} |", ""] if both else []  # fmt: skip
    outcomes = Counter((r.status, r.answered or "-", "ok" if r.ok else r.error[:40]) for r in overload)
    lines += ["| status | outcome | ending | streams | within the SLO |", "|---:|---|---|---:|---:|"]
    for (status, outcome, ending), n in outcomes.most_common():
        within = sum(1 for r in good if (r.status, r.answered or "-") == (status, outcome))
        lines.append(f"| {status} | {outcome} | {ending} | {n} | {within} |")
    lines += ["", "| priority | unloaded TTFT p50 / p99 (ms) | loaded TTFT p50 / p99 (ms) | loaded p99 / unloaded "
              "p99 |", "|---|---|---|---:|"]  # fmt: skip
    for level in (1, 3):
        u, lo = _ttft(unloaded, level), _ttft(overload, level)
        pu, pl = percentile(u, 99), percentile(lo, 99)
        ratio = f"{pl / pu:.2f}" if pu and pl else "-"
        lines.append(f"| {level} | {_ms(percentile(u, 50))} / {_ms(pu)} | {_ms(percentile(lo, 50))} / {_ms(pl)} | "
                     f"{ratio} |")  # fmt: skip
    if res.cpu:
        lines += ["", "CPU during the overload (cores): " + ", ".join(f"{k} {v:.2f}" for k, v in res.cpu.items()
                                                                       if k != "client")]  # fmt: skip
    if both:
        targets.append((f"goodput >= 90 % of edge + cloud capacity ({both:.2f} streams/s)",
                        f"{goodput:.2f} streams/s, {goodput / both:.1%}", goodput >= 0.9 * both))  # fmt: skip
    if p1_unloaded and p1_loaded:
        targets.append(("priority 1 TTFT p99 <= 2x unloaded",
                        f"{_ms(p1_loaded)} ms vs {_ms(p1_unloaded)} ms: {p1_loaded / p1_unloaded:.2f}x",
                        p1_loaded <= 2 * p1_unloaded))  # fmt: skip
    targets.append(("lost 0", str(len(lost)), not lost))
    lines += ["", "### 3. What the gateway adds to the time to first byte", ""]
    ttfb = res.ttfb or {}
    lines += [f"`POST /v1/completions` (`{BENCH_LM}`, prompt 'edge', max_tokens 1, stream), to the cloud agent "
              f"directly and through the gateway (the edge agent's token), {args.ttfb_rounds} rounds of "
              f"{args.ttfb_per_round} requests each way in turn (direct, gateway, direct ...), after one round not "
              "kept; a fresh connection per request. First byte: of the answer's body (the stream's first event: its "
              "one token); head: the answer's status line, which the gateway sends only once the backend's body has "
              "begun (so that it can still try another backend until then), while the agent sends it at admission.",
              "", "| path | first byte p50 (ms) | first byte p99 (ms) | first byte, median of round medians (ms) | "
              "head p50 (ms) | added first byte p50 vs direct (ms) | first byte p50 / direct |",
              "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    firsts: dict[str, float] = {}
    for name, rounds in ttfb.items():
        flat = [r for rr in rounds for r in rr if r.status == 200 and r.body is not None]
        body = [r.body - r.due for r in flat if r.body is not None]
        heads = [r.head - r.due for r in flat if r.head is not None]
        med = median(median([r.body - r.due for r in rr if r.body is not None]) for rr in rounds)
        firsts[name] = percentile(body, 50) or 0.0
        added = "" if name == "direct" else f"+{(firsts[name] - firsts['direct']) * 1000:.3f}"
        ratio = f"{firsts[name] / firsts['direct']:.2f}" if firsts.get("direct") else "-"
        failed = sum(1 for rr in rounds for r in rr if r.status != 200)
        lines.append(f"| {name}{f' ({failed} not 200)' if failed else ''} | {_ms(firsts[name], 3)} | "
                     f"{_ms(percentile(body, 99), 3)} | {_ms(med, 3)} | {_ms(percentile(heads, 50), 3)} | {added} | "
                     f"{ratio} |")  # fmt: skip
    if "gateway" in firsts and "direct" in firsts:
        added_s = firsts["gateway"] - firsts["direct"]
        targets.append(("the gateway adds <= 1 ms to the time to first byte at p50", f"+{added_s * 1000:.3f} ms "
                        f"({firsts['gateway'] / firsts['direct']:.2f}x direct)", added_s <= 0.001))  # fmt: skip
    lines += ["", "| target | measured | reached |", "|---|---|---|"]
    lines += [f"| {name} | {measured} | {'yes' if ok else 'no'} |" for name, measured, ok in targets]
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the section into docs/benchmarks.md")
    parser.add_argument("--quick", action="store_true", help="short points: a smoke test, not a result")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument(
        "--breaker-errors-off",
        action="store_true",
        help="the edge's breaker never opens on failures (error_ratio null): what goodput is without it",
    )
    parser.add_argument("--overload", type=float, default=3.0, help="x the edge's capacity")
    parser.add_argument("--high-share", type=float, default=0.2)
    parser.add_argument("--slo-ms", type=int, default=1000, help="the TTFT SLO (a GenAI TTFT bucket boundary)")
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=128)
    parser.add_argument("--output-min", type=int, default=16)
    parser.add_argument("--output-max", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--capacity-s", type=float, default=10.0)
    parser.add_argument("--unloaded-s", type=float, default=10.0)
    parser.add_argument("--overload-s", type=float, default=15.0)
    parser.add_argument("--ttfb-rounds", type=int, default=10)
    parser.add_argument("--ttfb-per-round", type=int, default=20)
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup_s, args.capacity_s, args.unloaded_s, args.overload_s = 1.0, 3.0, 4.0, 5.0
        args.ttfb_rounds, args.ttfb_per_round = 3, 10
    command = ".venv/bin/python bench/genoverflow.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    os.environ.pop("SPILLWAY_DATABASE_URL", None)
    res = run(args, command.strip())
    markdown = report(res)
    print(markdown)
    if args.write and not args.quick:
        common.write_docs(markdown, BEGIN, END)
        log("written to docs/benchmarks.md")


if __name__ == "__main__":
    main()
