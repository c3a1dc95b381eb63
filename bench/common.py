"""What the benchmarks share: logging to stderr, medians and percentiles, loopback HTTP, free ports, the machine
and revision each table names, wrk and py-spy, and the writer that puts a bench's section into docs/benchmarks.md.

The processes a bench starts go through the one process harness, `spillway/demo/harness.py` (`Process`): start
with a log file, wait until ready, stop with SIGTERM then SIGKILL.

Import it as `bench.common`, with the repository's root on `sys.path` (a script run as `python bench/x.py` puts
it there first: `sys.path.insert(0, str(Path(__file__).resolve().parents[1]))`).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spillway.demo.harness import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
DOCS_HEADER = (
    "# Benchmarks\n\nHow these are measured, and why: `shared/BENCHMARKING.md` (beside this repository) "
    "and `bench/README.md`.\n\n"
)
VENV_BIN = Path(sys.executable).parent


# ---- logging ---------------------------------------------------------------------------------------


def log(message: str) -> None:
    """One progress line on stderr, with the time: stdout carries the results."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- statistics ------------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """The `q`th percentile (0-100) of `values` by nearest rank (one of the values, no interpolation); None for
    no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def median(values: Iterable[float], empty: float = math.nan) -> float:
    """The median of `values` (the mean of the middle two for an even count); `empty` for no values."""
    listed = list(values)
    return statistics.median(listed) if listed else empty


# ---- loopback HTTP ---------------------------------------------------------------------------------


def http_json(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
              timeout: float = 30.0) -> Any:  # fmt: skip
    """One request with the standard library (no client library's cost in the measured process), its JSON
    answer decoded; `body` is sent as it is when bytes, else as JSON. Raises urllib's errors (HTTPError: not 2xx)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def bearer(token: str) -> dict[str, str]:
    """The Authorization header of a bearer token (an API key, an agent's token, a cloud agent's secret)."""
    return {"Authorization": f"Bearer {token}"}


def url_parts(url: str) -> tuple[str, int]:
    """'http://127.0.0.1:8400' -> ('127.0.0.1', 8400)."""
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


# ---- the machine and the code ----------------------------------------------------------------------


def machine(*, nproc: str | None = None, cpu_fallback: str = "unknown") -> dict[str, str]:
    """What a table names of the machine: nproc (os.cpu_count() unless given), the CPU model, memory, kernel
    and Python."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), cpu_fallback)  # fmt: skip
    memory = next(line.split(":", 1)[1].strip() for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))  # fmt: skip
    return {"nproc": nproc or str(os.cpu_count()), "cpu": cpu, "memory": memory, "kernel": platform.release(),
            "python": platform.python_version()}  # fmt: skip


def machine_words(info: dict[str, str]) -> str:
    """`machine()` as a table's words: 'nproc 2, <CPU>, <memory>, Linux <kernel>'."""
    return f"nproc {info['nproc']}, {info['cpu']}, {info['memory']}, Linux {info['kernel']}"


def revision(*folders: str) -> str:
    """The short commit of HEAD, and whether the working tree changes any of `folders` (the code measured)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", *folders) if folders else ""
    changed = " or ".join(f"{folder}/" for folder in folders)
    return git("rev-parse", "--short", "HEAD") + (f" with uncommitted changes under {changed}" if dirty else "")


# ---- docs/benchmarks.md ----------------------------------------------------------------------------


def section_head(begin: str, title: str, command: str, *, started: dt.datetime, minutes: float, code: str,
                 note: str = "") -> list[str]:  # fmt: skip
    """The first lines of a bench's section: its begin marker, its title, the command that made it (and `note`),
    when it ran, how long it took, and the code it measured (e.g. 'agent at commit abc1234')."""
    return [begin, f"## {title}", "", f"- Command: `{command}`{note}",
            f"- Date: {started:%Y-%m-%d %H:%M} UTC; the run took {minutes:.1f} min; {code}"]  # fmt: skip


def write_docs(markdown: str, begin: str, end: str, path: Path = DOCS) -> None:
    """Put `markdown` (a bench's section, from its `begin` marker to its `end` marker) in place of that section
    in `path`, or at the end if it has none; every other part of the file is kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else DOCS_HEADER
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + markdown + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + markdown + "\n"
    path.write_text(text)


# ---- wrk -------------------------------------------------------------------------------------------

LUA = """\
local f = assert(io.open({body_path}, "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
{headers}
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCHJSON {{"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50.0), latency:percentile(90.0), latency:percentile(99.0), latency.mean, latency.max))
end
"""


def write_lua(path: Path, body_path: Path, headers: dict[str, str]) -> Path:
    """A wrk script that POSTs the file `body_path` with `headers` and prints a BENCHJSON summary line."""
    lines = "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items())
    path.write_text(LUA.format(body_path=json.dumps(str(body_path)), headers=lines))
    return path


@dataclass
class WrkResult:
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    client_cpu_s: float
    non_2xx_line: str | None = None

    @property
    def valid(self) -> bool:
        return self.non_2xx == 0 and self.socket_errors == 0 and self.requests > 0


def wrk_command(url: str, lua: Path, connections: int, seconds: int) -> list[str]:
    """One wrk thread (so that one core stays with the server), `connections` connections, latency percentiles."""
    return ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "--timeout", "10s", "-s", str(lua), url]


def wrk_result(stdout: str, client_cpu_s: float = 0.0) -> WrkResult:
    """What a run of `write_lua`'s script printed."""
    data = None
    non_2xx_line = None
    for line in stdout.splitlines():
        if line.startswith("BENCHJSON "):
            data = json.loads(line[len("BENCHJSON ") :])
        if "Non-2xx or 3xx responses" in line:
            non_2xx_line = line.strip()
    if data is None:
        raise RuntimeError(f"wrk printed no summary:\n{stdout}")
    secs = data["duration_us"] / 1e6
    return WrkResult(
        requests=data["requests"],
        seconds=secs,
        rps=data["requests"] / secs,
        p50_ms=data["p50_us"] / 1e3,
        p90_ms=data["p90_us"] / 1e3,
        p99_ms=data["p99_us"] / 1e3,
        non_2xx=data["status"],
        socket_errors=data["connect"] + data["read"] + data["write"] + data["timeout"],
        client_cpu_s=client_cpu_s,
        non_2xx_line=non_2xx_line,
    )


def run_wrk(url: str, lua: Path, connections: int, seconds: int) -> WrkResult:
    """A closed-loop wrk run, with wrk's own CPU time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(wrk_command(url, lua, connections, seconds), capture_output=True, text=True,
                         timeout=seconds + 60, check=True)  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        return wrk_result(out.stdout, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime))
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n{out.stderr}") from None


# ---- py-spy ----------------------------------------------------------------------------------------

PY_SPY = VENV_BIN / "py-spy"


def py_spy_command(pid: int, seconds: int, out: Path) -> list[str]:
    """py-spy, non-blocking (the process runs on), every thread, 200 Hz, raw collapsed stacks into `out`."""
    return [str(PY_SPY), "record", "-d", str(seconds), "-r", "200", "--nonblocking", "--threads", "--format", "raw",
            "-o", str(out), "-p", str(pid)]  # fmt: skip


def _function(frame: str) -> str:
    """'encode_response (tensors.py:571)' -> 'encode_response (tensors.py)': lines of one function together."""
    return re.sub(r":\d+\)$", ")", frame)


_ROOTS = ("Runner.run (asyncio/runners.py", "_worker (concurrent/futures/thread.py", "Thread.run (threading.py")


def summarise_profile(raw: Path, seconds: int, rate: int = 200) -> dict[str, Any]:
    """Samples per thread; functions by self time (innermost frame) and, per thread, by inclusive time."""
    per_thread: Counter[str] = Counter()
    self_time: Counter[tuple[str, str]] = Counter()
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    stacks: dict[str, list[str]] = defaultdict(list)
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        thread, *frames = stack.split(";")
        if not frames:
            continue
        functions = [_function(f) for f in frames]
        per_thread[thread] += count
        self_time[(thread, functions[-1])] += count
        # Inclusive time counts only below the thread's root (the event loop's or the executor's run loop).
        roots = [i for i, f in enumerate(functions) if f.startswith(_ROOTS)]
        for function in set(functions[roots[-1] + 1 if roots else 0 :]):
            inclusive[thread][function] += count
        stacks[thread].append(stack)
    total = sum(per_thread.values())
    names = {t: _thread_kind(t, stacks[t]) for t in per_thread}
    busy_threads = {}
    for thread, count in per_thread.most_common():
        busy_threads[names[thread]] = {"samples": count, "inclusive": inclusive[thread].most_common(12)}
    return {
        "samples": total,
        "expected_per_thread": seconds * rate,
        "threads": busy_threads,
        "top": [
            {"thread": names[t], "function": f, "samples": n, "share": n / total if total else 0.0}
            for (t, f), n in self_time.most_common(15)
        ],
    }


def _thread_kind(thread: str, stacks: list[str]) -> str:
    """Name a thread by what its stacks contain (py-spy gives its id and Python name)."""
    joined = "\n".join(stacks)
    if "infer-" in thread or "_run (edge_agent/scheduling/worker.py" in joined or "Session.run" in joined:
        return f"inference executor, {thread}"
    if "MainThread" in thread:
        return f"event loop, {thread}"
    return thread


__all__ = [
    "DOCS", "LUA", "PY_SPY", "ROOT", "VENV_BIN", "WrkResult", "bearer", "free_port", "http_json", "log", "machine",
    "machine_words", "median", "percentile", "py_spy_command", "revision", "run_wrk", "section_head",
    "summarise_profile", "url_parts", "write_docs", "write_lua", "wrk_command", "wrk_result",
]  # fmt: skip
