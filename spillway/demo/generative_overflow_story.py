"""The generative overflow story on one machine, for `make demo` and its end-to-end test: a control plane (its
control loop and gateway), an edge agent serving `tiny-lm` with a small engine (few sequences at once), and a
Spillway agent in cloud role serving the same model behind the gateway as an `openai` backend; all separate
processes on loopback, under closed-loop streaming chat clients (the `openai` package) at three priorities.

The degradation comes from the control plane, not from the agent's own configuration: a TTFT SLO (its threshold
measured on the spot), a rule that caps `max_tokens` when it burns, and a harsher one (further up the ladder, and
only after the burn has held a few seconds) that overflows priority 3 to the cloud. Phases: normal load served
locally; a burst of clients, where the SLO burns, the cap and then the overflow come; the cloud killed mid-phase
(streams in flight end with an error event, the rest get the fallback chain: the cached answer of the same greedy
request, else the default text, `generation.fallback_text`); the cloud back (overflow again); calm.

Every stream the clients start ends exactly once: with `data: [DONE]`, with an error event, or with an HTTP error
answer that names its outcome. The story checks each one through the `openai` package's own SSE decoder (a
counting wrapper around it) and counts them by outcome per phase.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import random
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from spillway.contract.names import GENAI_TTFT_BUCKETS
from spillway.demo.burst import nearest_rank
from spillway.demo.harness import Process, stop
from spillway.demo.story import READY_TIMEOUT_S, Story

MODEL = "tiny-lm"
OUTCOMES = ("local", "overflow", "fallback_cache", "fallback_default", "queued_async", "rejected", "error")
MAX_TOKENS = 48  # what every client asks for (ignore_eos: exactly this many, unless capped)
CAP = 24  # the cap rule's max_tokens
EDGE_SEQS = 4  # the edge engine's max_num_seqs: a small device
CLOUD_SEQS = 8  # the cloud's: a bigger one
THINK_S = 0.02  # a client's pause between two streams (longer after a refusal)
REFUSED_PAUSE_S = 0.5
SLO_NAME = "tiny-lm-ttft-burst"
OBJECTIVE = 95.0  # % of streams whose first token comes within the threshold
CAP_BURN = 2.0  # burn rate (over both windows) at which the cap rule fires
OVERFLOW_BURN = 3.0  # ... and the overflow rule, after it has held for OVERFLOW_FOR
OVERFLOW_FOR = "2s"
RECOVER_AFTER = "15s"
DEFAULT_TEXT = "The device is busy and the cloud is away: please try again in a moment."
EDGE_NAME = "jetson-hamburg-01"
EDGE_LABELS = {"site": "hamburg", "tier": "genai"}  # no example rule or SLO selects these
PROMPTS = {  # a few distinct chats per priority: a greedy request seen before can be answered from the cache
    1: ["alarm: the line stopped, what now?", "alarm: pressure high in tank two"],
    2: ["summarise the shift log", "what changed since yesterday?", "list the open tickets"],
    3: ["write a haiku about dams", "tell me about spillways", "a limerick on edge devices", "why is the sky blue?"],
}


def lm_repository(out: Path) -> Path:
    """`out/tiny-lm/{config.pbtxt,1,2}` for this story's agents: version 1 a slower build of the demo decoder
    (width 384, 4 layers: a few hundred tokens a second on one CPU thread, so that the device, not the Python
    clients parsing every token, is what a burst overloads), version 2 the demo's own (lighter) one."""
    from spillway.demo.models import TINY_LM_CONFIG, _write_atomically
    from spillway.demo.tiny_lm import TINY, TINY_LM, DecoderShape, build_tiny_lm_version

    build_tiny_lm_version(out / TINY_LM, 1, DecoderShape(width=384, layers=4, heads=6, kv_heads=3))
    build_tiny_lm_version(out / TINY_LM, 2, TINY)
    _write_atomically(out / TINY_LM / "config.pbtxt", TINY_LM_CONFIG.encode())
    return out


# ---- what the clients saw ---------------------------------------------------------------------------


@dataclass
class Ends:
    """How one answer's server-sent events ended, as the `openai` package's decoder read them."""

    done: int = 0  # `data: [DONE]` events
    errors: int = 0  # error events (`data: {"error": ...}`)
    chunks: int = 0  # other events
    spillway: dict[str, Any] | None = None  # the last `spillway` field of a chunk (the overflow chunk's)

    def saw(self, data: str) -> None:
        if data.startswith("[DONE]"):
            self.done += 1
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.chunks += 1
            return
        if isinstance(event, dict) and event.get("error"):
            self.errors += 1
        else:
            self.chunks += 1
            if isinstance(event, dict) and isinstance(event.get("spillway"), dict):
                self.spillway = event["spillway"]


_ENDS: contextvars.ContextVar[Ends | None] = contextvars.ContextVar("spillway_demo_ends", default=None)


class _CountingDecoder:
    """The `openai` package's SSE decoder, counting each event into the `Ends` of the stream being opened."""

    def __init__(self, inner: Any, ends: Ends | None) -> None:
        self.inner, self.ends = inner, ends

    async def aiter_bytes(self, iterator: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        async for sse in self.inner.aiter_bytes(iterator):
            if self.ends is not None:
                self.ends.saw(sse.data)
            yield sse

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def counting_client(base_url: str, **kwargs: Any) -> Any:
    """An `openai.AsyncOpenAI` whose streams count their events into the `Ends` set for the calling task."""
    import openai

    class CountingOpenAI(openai.AsyncOpenAI):
        def _make_sse_decoder(self) -> Any:
            return _CountingDecoder(super()._make_sse_decoder(), _ENDS.get())

    return CountingOpenAI(base_url=base_url, **kwargs)


@dataclass
class StreamRecord:
    phase: str
    priority: int
    status: int = 0  # the HTTP status; 0: no answer at all
    outcome: str = "lost"  # spillway-outcome of the answer
    backend: str = ""  # spillway-backend (overflowed streams)
    capped: int | None = None  # spillway-max-tokens-cap
    ttft_s: float | None = None  # to the first content, from when the stream was asked for
    tokens: int = 0  # content chunks received
    finish: str | None = None  # the last chunk's finish_reason
    end: str = "lost"  # done | error event | http <status> | lost: <why>
    ends: Ends = field(default_factory=Ends)
    final_outcome: str | None = None  # the `spillway` field's outcome (the overflow chunk)

    @property
    def lost(self) -> bool:
        return self.end.startswith("lost")


@dataclass
class GenPhase:
    name: str
    clients: dict[int, int]  # priority -> closed-loop clients
    seconds: float  # at most this long
    before: Callable[[], None] | None = None  # run (in a thread) before the phase
    during: tuple[float, Callable[[], None]] | None = None  # (after seconds, action) within the phase
    until: Callable[[GenPhase], bool] | None = None  # end early, `linger_s` after this holds
    linger_s: float = 2.0
    streams: list[StreamRecord] = field(default_factory=list)
    burn: tuple[float | None, float | None] = (None, None)  # the SLO's burn rates (long, short) at the end
    took_s: float = 0.0

    def outcomes(self) -> Counter[str]:
        return Counter("lost" if s.lost else s.outcome for s in self.streams)

    def ttft_p99(self, priority: int) -> float | None:
        return nearest_rank([s.ttft_s for s in self.streams if s.priority == priority and s.ttft_s is not None], 0.99)


# ---- the processes ----------------------------------------------------------------------------------


class GenCloud:
    """The cloud: a Spillway agent in cloud role serving tiny-lm, registered as an `openai` backend."""

    def __init__(self, story: GenerativeOverflowStory, port: int) -> None:
        self.story, self.port = story, port
        self.name = "cloud-genai"
        self.url = f"http://127.0.0.1:{port}"
        self.token = f"cloud-token-genai-{random.getrandbits(64):x}"
        self.proc: Process | None = None
        self.id = ""

    def start(self) -> None:
        base = self.story.base
        config = base.root / f"{self.name}.yaml"
        config.write_text(yaml.safe_dump({
            "model_repository": str(self.story.models), "port": self.port, "role": "cloud", "token": self.token,
            "intra_op_threads": 1, "agent_id": self.name, "state_dir": str(base.root / f"state-{self.name}"),
            "generation": {"max_num_seqs": CLOUD_SEQS},
        }))  # fmt: skip
        self.proc = base.start_agent_process(f"cloud backend {self.name}", config, base.root / f"{self.name}.log",
                                             base.env())  # fmt: skip

    def wait(self) -> None:
        assert self.proc is not None
        self.proc.wait_ready(f"{self.url}/v2/health/ready", timeout_s=READY_TIMEOUT_S,
                             headers={"Authorization": f"Bearer {self.token}"})  # fmt: skip

    def register(self) -> None:
        with self.story.base.api() as client:
            made = client.post("/api/v1/backends", json={
                "name": self.name, "url": self.url, "protocol": "openai", "models": [MODEL],
                "model_map": {MODEL: MODEL}, "max_concurrency": 32, "timeout_ms": 10_000,
                "auth_header": f"Bearer {self.token}",
            })  # fmt: skip
            if made.status_code != 201:
                raise RuntimeError(f"registering the openai backend failed: {made.status_code} {made.text}")
            self.id = made.json()["id"]

    def kill(self) -> None:
        stop(self.proc, signal.SIGKILL)

    def restart(self) -> None:
        self.start()
        self.wait()
        self.story.wait_backend_usable()


class GenerativeOverflowStory:
    """The edge agent and the cloud beside a `Story`'s control plane (started by the caller)."""

    def __init__(self, base: Story, *, models: Path, edge_port: int, cloud_port: int) -> None:
        self.base, self.models = base, models
        self.edge_port = edge_port
        self.edge_url = f"http://127.0.0.1:{edge_port}"
        self.cloud = GenCloud(self, cloud_port)
        self.edge: Process | None = None
        self.edge_log = base.root / "edge-genai.log"
        self.edge_id = ""
        self.threshold_ms = 0.0
        self.slo_id = ""
        self.rule_ids: dict[str, str] = {}
        self.first_event = 0
        self.probes: list[GenPhase] = []  # the calibration's streams (the agent counts them too)
        base.cleanup.callback(self.close)

    def start(self) -> None:
        """Start the cloud and the edge agent side by side (each loads its model meanwhile), register the cloud."""
        self.first_event = max((e["id"] for e in self.base.events()), default=0)
        self.cloud.start()
        with self.base.api() as client:
            made = client.post("/api/v1/agents", json={"name": EDGE_NAME, "device_class": "jetson",
                                                        "labels": EDGE_LABELS})  # fmt: skip
            if made.status_code != 201:
                raise RuntimeError(f"enrolling {EDGE_NAME} failed: {made.status_code} {made.text}")
        body = made.json()
        self.edge_id, token = body["agent"]["id"], body["token"]
        config = self.base.root / "edge-genai.yaml"
        config.write_text(yaml.safe_dump({
            "model_repository": str(self.models), "port": self.edge_port, "agent_id": self.edge_id,
            "control_plane": self.base.base, "export_interval_s": self.base.interval_s,
            "policy_poll_interval_s": self.base.interval_s, "device_class": "jetson", "labels": EDGE_LABELS,
            "intra_op_threads": 1, "state_dir": str(self.base.root / "state-edge-genai"),
            "generation": {"max_num_seqs": EDGE_SEQS, "fallback_text": DEFAULT_TEXT},
            # Overflow only where the policy says so (the rules); the breaker opens on a dead cloud within seconds.
            "overflow": {"enabled": False, "breaker": {"min_requests": 3, "open_s": 2.0, "stat_interval_s": 2.0}},
        }))  # fmt: skip
        env = {**self.base.env(), "SPILLWAY_AGENT_TOKEN": token}
        self.edge = self.base.start_agent_process("the generative edge agent", config, self.edge_log, env)
        self.cloud.wait()
        self.cloud.register()
        self.edge.wait_ready(f"{self.edge_url}/v2/health/ready", timeout_s=READY_TIMEOUT_S)
        self.wait_backend_usable()

    def close(self) -> None:
        stop(self.edge)
        stop(self.cloud.proc)

    # ---- the control plane's side ---------------------------------------------------------------------

    def add_policy(self, threshold_ms: float) -> None:
        """The TTFT SLO and the two rules, selecting this story's edge agent only."""
        self.threshold_ms = threshold_ms
        selector = {"labels": {"site": EDGE_LABELS["site"]}, "model": MODEL}
        burn = {"kind": "burn_rate", "slo": SLO_NAME, "long_window": "2m", "short_window": "1m", "min_requests": 10}
        rules = [
            {"name": "cap-tokens-on-ttft-burn", "selector": selector,
             "description": "a burning TTFT SLO first caps max_tokens (streams end sooner, the queue moves)",
             "condition": {**burn, "threshold": CAP_BURN}, "action": {"kind": "cap_max_tokens", "max_tokens": CAP},
             "hysteresis": {"for": "0s", "recover_after": RECOVER_AFTER}},
            {"name": "overflow-p3-on-ttft-burn", "selector": selector,
             "description": "a burn that the cap does not stop overflows priority 3 to the cloud",
             "condition": {**burn, "threshold": OVERFLOW_BURN},
             "action": {"kind": "overflow", "mode": "priority", "priority_at_or_below": 3},
             "hysteresis": {"for": OVERFLOW_FOR, "recover_after": RECOVER_AFTER}},
        ]  # fmt: skip
        with self.base.api() as client:
            made = client.post("/api/v1/slos", json={
                "name": SLO_NAME, "description": f"{OBJECTIVE:g} % of {MODEL} streams start within {threshold_ms:g} ms",
                "selector": selector, "sli_kind": "ttft", "threshold_ms": threshold_ms, "objective": OBJECTIVE,
                "window": "1h", "alert_windows": [{"long": "2m", "short": "1m", "burn_rate": CAP_BURN}],
            })  # fmt: skip
            if made.status_code != 201:
                raise RuntimeError(f"creating the TTFT SLO failed: {made.status_code} {made.text}")
            self.slo_id = made.json()["id"]
            for rule in rules:
                made = client.post("/api/v1/rules", json=rule)
                if made.status_code != 201:
                    raise RuntimeError(f"creating rule {rule['name']} failed: {made.status_code} {made.text}")
                self.rule_ids[str(rule["name"])] = made.json()["id"]

    def slo_burn(self) -> tuple[float | None, float | None]:
        """The SLO's burn rates over its alert's long and short window, now (for this story's agent alone)."""
        with self.base.api() as client:
            status = client.get(f"/api/v1/slos/{self.slo_id}/status").json()
        alerts = status.get("alerts") or [{}]
        return alerts[0].get("long_burn_rate"), alerts[0].get("short_burn_rate")

    def events(self) -> list[dict[str, Any]]:
        """What the control loop and the gateway wrote since the story started, oldest first."""
        return [e for e in self.base.events(self.first_event) if e["actor"] in ("control-loop", "gateway")]

    def gateway(self) -> list[dict[str, Any]]:
        with self.base.api() as client:
            found = client.get("/api/v1/status").json().get("gateway") or {}
        return list(found.get("backends", []) if isinstance(found, dict) else found)

    def wait_backend_usable(self, deadline_s: float = 30.0) -> None:
        """Until the gateway counts the cloud healthy and not ejected."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            state = next((b for b in self.gateway() if b["name"] == self.cloud.name), None)
            if state is not None and state.get("healthy") and not state.get("ejected"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the gateway did not count backend {self.cloud.name} usable within {deadline_s:.0f} s")

    def agent_counts(self, expected: int, deadline_s: float = 15.0) -> Counter[str] | None:
        """The edge agent's streams by outcome as the control plane counted them from its telemetry (the
        `generation` entry of its metrics), once they add up to `expected` or at the deadline; None when the
        control plane shows none."""
        deadline = time.monotonic() + deadline_s
        counted: Counter[str] | None = None
        with self.base.api() as client:
            while True:
                seen = client.get(f"/api/v1/agents/{self.edge_id}/metrics", params={"window": "15m"}).json()
                row = next((g for g in seen.get("generation") or [] if g.get("model") == MODEL), None)
                if row is not None:
                    counted = Counter({k: round(v) for k, v in (row.get("outcomes") or {}).items() if round(v)})
                    if sum(counted.values()) >= expected:
                        return counted
                if time.monotonic() > deadline:
                    return counted
                time.sleep(self.base.interval_s / 2)

    def edge_status(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.edge_url}/v2/spillway/status", timeout=5).json())

    # ---- the clients --------------------------------------------------------------------------------

    def calibrate(self) -> tuple[float, float, float]:
        """(unloaded TTFT p50, a stream's duration with the engine full, the SLO threshold), in seconds. The
        threshold is the smallest TTFT bucket boundary at least half a full engine's stream duration (and 4 unloaded
        TTFTs): a stream that waits for a turn of the engine misses it, one served at once meets it."""
        probe = GenPhase("unloaded (probe)", {1: 1, 2: 1}, 1.0)
        asyncio.run(self._run([probe], None))
        full = GenPhase("engine full (probe)", {2: EDGE_SEQS}, 1.0)
        asyncio.run(self._run([full], None))
        self.probes = [probe, full]
        unloaded = nearest_rank([s.ttft_s for s in probe.streams if s.ttft_s is not None], 0.5) or 0.01
        whole = [s for s in full.streams if s.end == "done"]
        duration = full.took_s * EDGE_SEQS / max(len(whole), 1)
        want = max(duration / 2, 4 * unloaded)
        threshold = next((b for b in GENAI_TTFT_BUCKETS if b >= want), GENAI_TTFT_BUCKETS[-1])
        return unloaded, duration, threshold

    def run(self, phases: list[GenPhase], *, on_phase: Callable[[int, GenPhase], None] | None = None) -> None:
        asyncio.run(self._run(phases, on_phase))

    async def _run(self, phases: list[GenPhase], on_phase: Callable[[int, GenPhase], None] | None) -> None:
        import openai

        limits = {"max_retries": 0, "timeout": 30.0}
        async with counting_client(f"{self.edge_url}/v1", api_key="unused", **limits) as client:
            for index, phase in enumerate(phases):
                if phase.before is not None:
                    await asyncio.to_thread(phase.before)
                if on_phase is not None:
                    on_phase(index, phase)
                await self._phase(client, phase, openai)
                if self.slo_id:
                    phase.burn = await asyncio.to_thread(self.slo_burn)

    async def _phase(self, client: Any, phase: GenPhase, openai: Any) -> None:
        started = time.monotonic()
        end = started + phase.seconds
        stop_at: list[float] = []  # set once `until` holds

        def over() -> bool:
            return time.monotonic() >= (stop_at[0] if stop_at else end)

        async def one_client(priority: int, n: int) -> None:
            prompts = PROMPTS[priority]
            i = n
            while not over():
                record = StreamRecord(phase.name, priority)
                phase.streams.append(record)
                # One priority-3 client asks something new every time: no cached answer can stand in for it.
                prompt = f"question {i} of {phase.name}" if (priority, n) == (3, 0) else prompts[i % len(prompts)]
                await self._stream(client, openai, record, prompt)
                i += 1
                await asyncio.sleep(REFUSED_PAUSE_S if record.status not in (0, 200) else THINK_S)

        async def watch() -> None:
            acted = phase.during is None
            while not over():
                await asyncio.sleep(0.1)
                if not acted and phase.during is not None and time.monotonic() - started >= phase.during[0]:
                    acted = True
                    await asyncio.to_thread(phase.during[1])
                if phase.until is not None and not stop_at and phase.until(phase):
                    stop_at.append(min(end, time.monotonic() + phase.linger_s))

        await asyncio.gather(watch(), *(one_client(p, n) for p, count in phase.clients.items()
                                        for n in range(count)))  # fmt: skip
        phase.took_s = time.monotonic() - started

    async def _stream(self, client: Any, openai: Any, record: StreamRecord, prompt: str) -> None:
        ends = record.ends
        token = _ENDS.set(ends)
        started = time.monotonic()
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
                stream=True, extra_body={"priority": record.priority, "ignore_eos": True},
            )  # fmt: skip
            record.status = raw.http_response.status_code
            _headers(record, raw.headers)
            stream = raw.parse()
            async for chunk in stream:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if choice.delta.content:
                    record.tokens += 1
                    if record.ttft_s is None:
                        record.ttft_s = time.monotonic() - started
                if choice.finish_reason is not None:
                    record.finish = choice.finish_reason
            record.end = "done" if ends.done == 1 and ends.errors == 0 else f"lost: stream ended without [DONE] {ends}"
        except openai.APIStatusError as exc:
            record.status = exc.status_code
            _headers(record, exc.response.headers)
            record.end = f"http {exc.status_code}"
            if record.outcome == "lost":
                record.outcome = "rejected" if exc.status_code in (429, 503) else "error"
        except openai.APIConnectionError as exc:  # no answer, or the stream broke off without an error event
            record.end = f"lost: {type(exc).__name__}"
        except openai.APIError:  # an error event in the stream (the openai package raises it)
            record.end = "error event" if ends.errors == 1 and ends.done == 0 else f"lost: {ends}"
            record.outcome = "error"
        finally:
            _ENDS.reset(token)
        if ends.spillway is not None:
            record.final_outcome = ends.spillway.get("outcome")


def _headers(record: StreamRecord, headers: Any) -> None:
    record.outcome = headers.get("spillway-outcome") or record.outcome
    record.backend = headers.get("spillway-backend") or ""
    cap = headers.get("spillway-max-tokens-cap")
    record.capped = int(cap) if cap and cap.isdigit() else None


# ---- the act ----------------------------------------------------------------------------------------


def standard_phases(story: GenerativeOverflowStory) -> list[GenPhase]:
    """Normal load; a burst (until overflow has shown for a while); the cloud killed mid-phase; back; calm."""

    def overflowing(phase: GenPhase) -> bool:
        return sum(s.outcome == "overflow" for s in phase.streams) >= 5

    burst = {1: 1, 2: 2, 3: 9}
    return [
        GenPhase("normal", {1: 1, 2: 1, 3: 1}, 2.0),
        GenPhase("burst", burst, 25.0, until=overflowing, linger_s=2.0),
        GenPhase("cloud down", burst, 4.0, during=(1.0, story.cloud.kill)),
        GenPhase("cloud back", burst, 10.0, before=story.cloud.restart, until=overflowing, linger_s=1.5),
        GenPhase("calm", {1: 1, 2: 1, 3: 1}, 2.0),
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def format_phases(phases: list[GenPhase]) -> str:
    """A table row per phase: streams, their outcomes, lost, capped, TTFT p99 per priority, the SLO's burn."""
    shown = [o for o in OUTCOMES if any(p.outcomes()[o] for p in phases)]
    extra = sorted({o for p in phases for o in p.outcomes()} - set(OUTCOMES) - {"lost"})
    columns = shown + extra
    lines = [
        "| phase | clients P1/P2/P3 | s | streams | " + " | ".join(columns)
        + " | lost | capped | TTFT p99 P1 ms | P2 ms | P3 ms | burn 2m/1m |",
        "|---|---|---:|---:|" + "---:|" * len(columns) + "---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for phase in phases:
        counts = phase.outcomes()
        clients = "/".join(str(phase.clients.get(p, 0)) for p in (1, 2, 3))
        capped = sum(s.capped is not None for s in phase.streams)
        p99 = " | ".join(_ms(phase.ttft_p99(p)) for p in (1, 2, 3))
        burn = f"{_rate(phase.burn[0])}/{_rate(phase.burn[1])}"
        lines.append(f"| {phase.name} | {clients} | {phase.took_s:.0f} | {len(phase.streams)} | "
                     + " | ".join(str(counts[c]) for c in columns)
                     + f" | {counts['lost']} | {capped} | {p99} | {burn} |")  # fmt: skip
    return "\n".join(lines)


def describe_event(event: dict[str, Any]) -> str:
    """One event as a line: its time, kind and the numbers behind it."""
    data = event.get("data") or {}
    detail = ""
    if event["kind"].startswith("rule."):
        observed = data.get("observed") or {}
        numbers = ", ".join(f"{k} {_number(v)}" for k, v in observed.items() if k in (
            "long_burn_rate", "short_burn_rate", "requests_short"))  # fmt: skip
        detail = f"{data.get('rule')}: {numbers}"
    elif event["kind"] == "policy.published":
        detail = f"version {data.get('version')}, causes: {[c['name'] for c in data.get('causes', [])] or 'none'}"
    else:
        detail = f"{event.get('subject_name') or data.get('backend') or ''} {data.get('reason') or ''}".strip()
    return f"  {event['ts'][11:19]}  {event['kind']:18} {detail}"


def _number(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def endings(phases: list[GenPhase]) -> Counter[str]:
    """How the streams ended: `[DONE]`, an error event, an HTTP error answer, or lost."""
    ended: Counter[str] = Counter()
    for phase in phases:
        for s in phase.streams:
            ended["lost" if s.lost else "[DONE]" if s.end == "done" else "HTTP answer" if s.end.startswith("http")
                  else s.end] += 1  # fmt: skip
    return ended


def overflow_marks(phases: list[GenPhase], backend: str) -> tuple[int, int]:
    """(overflowed streams, those whose answer said so twice: header `spillway-backend: backend` and a last chunk
    `"spillway": {"outcome": "overflow", "backend": backend}` before `[DONE]`)."""
    overflowed = [s for p in phases for s in p.streams if s.outcome == "overflow"]
    marked = [s for s in overflowed if s.backend == backend and s.final_outcome == "overflow" and s.ends.spillway
              and s.ends.spillway.get("backend") == backend]  # fmt: skip
    return len(overflowed), len(marked)


def client_counts(phases: list[GenPhase]) -> Counter[str]:
    counted: Counter[str] = Counter()
    for phase in phases:
        counted.update(phase.outcomes())
    return counted


__all__ = [
    "MODEL",
    "OUTCOMES",
    "GenCloud",
    "GenPhase",
    "GenerativeOverflowStory",
    "StreamRecord",
    "client_counts",
    "counting_client",
    "describe_event",
    "endings",
    "format_phases",
    "lm_repository",
    "overflow_marks",
    "standard_phases",
]
