"""A short burst of mixed-priority V2 traffic against an agent, and a per-priority report of what happened.

`make demo` uses it to show admission and priorities at work; `spillway agent burst` runs it by hand.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# priority -> (share of traffic, timeout in microseconds or None for the level's default)
DEFAULT_MIX: dict[int, tuple[float, int | None]] = {1: (0.2, 250_000), 2: (0.5, None), 3: (0.3, 20_000)}


@dataclass
class PriorityReport:
    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)  # of requests served (outcome `local`)
    versions: Counter[str] = field(default_factory=Counter)  # the `model_version` of each answer that names one

    def percentile(self, q: float) -> float | None:
        return nearest_rank(self.latencies_ms, q)


def nearest_rank(values: list[float], q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) of `values`, one of them (no interpolation); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _body(priority: int, timeout_us: int | None, rng: random.Random, width: int) -> bytes:
    parameters: dict[str, int] = {"priority": priority}
    if timeout_us is not None:
        parameters["timeout"] = timeout_us
    data = [round(rng.uniform(-1, 1), 4) for _ in range(width)]
    return json.dumps({"inputs": [{"name": "input", "shape": [1, width], "datatype": "FP32", "data": data}],
                       "parameters": parameters}).encode()  # fmt: skip


async def run_burst(
    url: str,
    *,
    model: str = "mlp",
    version: str | None = None,
    requests: int = 600,
    concurrency: int = 48,
    mix: dict[int, tuple[float, int | None]] | None = None,
    width: int = 512,
    seed: int = 7,
) -> dict[int, PriorityReport]:
    """Send `requests` requests from `concurrency` clients, priorities drawn from `mix`; every one is counted. With
    no `version` the requests name none (`/v2/models/{model}/infer`): the agent answers with its default version, or
    the variant its policy serves in its place."""
    mix = mix or DEFAULT_MIX
    rng = random.Random(seed)  # noqa: S311 - reproducible test traffic, not secrets
    bodies = {p: _body(p, timeout, rng, width) for p, (_, timeout) in mix.items()}
    plan = rng.choices(list(mix), weights=[share for share, _ in mix.values()], k=requests)
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    reports = {p: PriorityReport() for p in mix}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for priority in plan:
        queue.put_nowait(priority)

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    requests_bytes = {
        p: (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        for p, body in bodies.items()
    }  # fmt: skip

    async def client() -> None:
        # A lean keep-alive HTTP/1.1 client: a Python HTTP library would spend more CPU than the model does.
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while not queue.empty():
                priority = queue.get_nowait()
                report = reports[priority]
                report.sent += 1
                started = time.perf_counter()
                try:
                    writer.write(requests_bytes[priority])
                    status, headers, body = await _read_response(reader)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    report.outcomes[f"transport error ({type(exc).__name__})"] += 1
                    return
                elapsed_ms = (time.perf_counter() - started) * 1e3
                outcome = headers.get("spillway-outcome", f"http {status}")
                reason = headers.get("spillway-reason")
                report.outcomes[f"{outcome} ({reason})" if reason else outcome] += 1
                if status == 200:
                    report.latencies_ms.append(elapsed_ms)
                found = _MODEL_VERSION.search(body[:300]) if status == 200 else None
                if found:
                    report.versions[found.group(1).decode()] += 1
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return reports


_MODEL_VERSION = re.compile(rb'"model_version"\s*:\s*"([^"]*)"')


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))


def answered_versions(reports: dict[int, PriorityReport]) -> Counter[str]:
    """How many answers each model version gave, over every priority."""
    return sum((r.versions for r in reports.values()), Counter())


def format_report(reports: dict[int, PriorityReport], mix: dict[int, tuple[float, int | None]] | None = None) -> str:
    mix = mix or DEFAULT_MIX
    lines = [
        "| priority | timeout | sent | outcomes | p50 ms | p99 ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for priority, report in sorted(reports.items()):
        timeout = mix.get(priority, (0.0, None))[1]
        shown = f"{timeout / 1000:.0f} ms" if timeout else "level default"
        outcomes = ", ".join(f"{name} {count}" for name, count in report.outcomes.most_common())
        p50, p99 = report.percentile(0.5), report.percentile(0.99)
        cells = [f"{v:.1f}" if v is not None else "-" for v in (p50, p99)]
        lines.append(f"| {priority} | {shown} | {report.sent} | {outcomes} | {cells[0]} | {cells[1]} |")
    served = [ms for r in reports.values() for ms in r.latencies_ms]
    if served:
        lines.append(f"\nserved {len(served)} of {sum(r.sent for r in reports.values())}, "
                     f"median {statistics.median(served):.1f} ms overall")  # fmt: skip
    versions = answered_versions(reports)
    if versions:
        lines.append("answered by version " + ", ".join(f"{v}: {n}" for v, n in sorted(versions.items())))
    return "\n".join(lines)
