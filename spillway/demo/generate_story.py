"""The generative act of the demo: a mixed-priority burst of streamed chat completions to tiny-lm on the edge agent,
through the `openai` package, as its clients saw it: outcomes, time to first token and time per output token per
priority, and the output tokens per second of the whole burst."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from spillway.demo.burst import nearest_rank

__all__ = ["GenerativeReport", "format_generative", "run_generative_burst"]

MIX = {1: 0.2, 2: 0.5, 3: 0.3}  # priority level -> share of the streams


@dataclass
class GenerativeReport:
    priority: int
    outcomes: dict[str, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    tokens: int = 0


Reports = dict[int, GenerativeReport]


async def run_generative_burst(base: str, *, model: str = "tiny-lm", streams: int = 24, concurrency: int = 12,
                               max_tokens: int = 32, seed: int = 7) -> tuple[Reports, float]:  # fmt: skip
    """Run the burst; the reports per priority and the burst's wall time in seconds."""
    import openai

    rng = random.Random(seed)  # noqa: S311 (a demo's traffic mix)
    priorities = rng.choices(list(MIX), weights=list(MIX.values()), k=streams)
    reports = {p: GenerativeReport(p) for p in MIX}
    gate = asyncio.Semaphore(concurrency)

    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60) as client:

        async def one(i: int, priority: int) -> None:
            report = reports[priority]
            words = " ".join(rng.choice(("edge", "cloud", "token", "stream", "burst")) for _ in range(4 + i % 12))
            async with gate:
                started = time.monotonic()
                first: float | None = None
                tokens = 0
                try:
                    stream = await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": words}], max_tokens=max_tokens,
                        temperature=0, stream=True, stream_options={"include_usage": True},
                        extra_body={"priority": priority},
                    )  # fmt: skip
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content and first is None:
                            first = time.monotonic()
                        if chunk.usage is not None:
                            tokens = chunk.usage.completion_tokens
                except openai.APIStatusError as exc:
                    key = "rejected" if exc.status_code in (429, 503) else "error"
                    report.outcomes[key] = report.outcomes.get(key, 0) + 1
                    return
                ended = time.monotonic()
            report.outcomes["local"] = report.outcomes.get("local", 0) + 1
            report.tokens += tokens
            if first is not None:
                report.ttft_s.append(first - started)
                if tokens > 1:
                    report.tpot_s.append((ended - first) / (tokens - 1))

        started = time.monotonic()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(priorities)))
    return reports, time.monotonic() - started


def format_generative(reports: dict[int, GenerativeReport], wall_s: float) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = ["  priority  streams  outcomes              TTFT p50/p99 ms  TPOT p50 ms  output tokens"]
    for priority, r in sorted(reports.items()):
        count = sum(r.outcomes.values())
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r.outcomes.items())) or "-"
        ttft = f"{ms(nearest_rank(r.ttft_s, 0.5))}/{ms(nearest_rank(r.ttft_s, 0.99))}"
        lines.append(f"  {priority:>8}  {count:>7}  {outcomes:<20}  {ttft:>15}  {ms(nearest_rank(r.tpot_s, 0.5)):>11}"
                     f"  {r.tokens:>13}")  # fmt: skip
    total = sum(r.tokens for r in reports.values())
    lines.append(f"  {total} output tokens in {wall_s:.1f} s: {total / max(wall_s, 1e-9):.0f} tokens/s")
    return "\n".join(lines)
