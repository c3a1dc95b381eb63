"""The edge agent's admission of generative requests: the max_tokens cap, shed, overflow of streams through the
gateway (relayed as they come, with the spillway chunk before `[DONE]`), a gateway that fails mid-stream (an error
event, never `[DONE]`, counted by the breaker), and the fallback chain in its order (cached greedy completion, default
text, async job, 503).

Most of it runs in process: the real OpenAI API over real HTTP (uvicorn on loopback) on a real tiny-lm engine, with
a hand-written policy gate, and as the gateway either a small real aiohttp server (it streams what a test asks,
drops the connection, answers an error event) or nothing at all (a free port). One test runs real processes: an edge
agent overflowing to a cloud-role agent, through the `openai` package.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from edge_agent.config import GenerationSettings
from edge_agent.generation.load import load_engine
from edge_agent.generation.pool import EnginePool
from edge_agent.overflow.breaker import BreakerConfig
from edge_agent.overflow.forward import Forwarder
from edge_agent.overflow.jobs import JobStore
from edge_agent.overflow.queue import AsyncQueue
from edge_agent.overflow.stream import MAX_EVENT_BYTES, SseEvents, StreamBroken
from edge_agent.policy.plan import ModelPlan
from edge_agent.serving.app import InferenceApp
from edge_agent.serving.models import ModelRegistry
from edge_agent.serving.openai_api import OpenAIApi
from spillway.contract.policy import Fallback, Overflow, Shed
from spillway.demo.tiny_lm import TINY, TINY_LM, build_tiny_lm_version
from tests.agent.conftest import RunningAgent, start_agent, stop_agent
from tests.utils.server import free_port, serving

TOKEN = "edge-to-gateway-token"
HELLO = [{"role": "user", "content": "Hello!"}]
OVERFLOW_P3 = ModelPlan(TINY_LM, overflow=Overflow(at_or_below=3))


# ---- the pieces: a policy gate, a telemetry listener, a gateway that misbehaves on request ---------------------------


@dataclass
class Gate:
    """The policy as admission reads it (the agent's PolicyApplier answers the same question)."""

    plan: ModelPlan | None = None

    def plan_for(self, name: str) -> ModelPlan | None:
        return self.plan if self.plan is not None and self.plan.name == name else None


@dataclass
class Heard:
    """What the model's telemetry hears (GenerationRecorder's hooks): one outcome per answer."""

    outcomes: list[tuple[int, str]] = field(default_factory=list)
    finishes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def outcome(self, priority: int, outcome: str) -> None:
        self.outcomes.append((priority, outcome))

    def step(self, tokens: int) -> None:
        pass

    def finished(self, priority: int, outcome: str | None, **measured: Any) -> None:
        if outcome is not None:  # None: counted elsewhere (an async job's run, counted when it was accepted)
            self.outcome(priority, outcome)
        self.finishes.append((outcome or "uncounted", measured))


def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-cloud", "object": "chat.completion.chunk", "created": 1, "model": TINY_LM,
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}  # fmt: skip


def sse(payload: dict[str, Any] | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


GATEWAY_ERROR = {"error": {"message": "backend b1 failed mid-stream", "type": "server_error", "param": None,
                           "code": "backend_failed"}}  # fmt: skip


class FakeGateway:
    """A real aiohttp server on loopback in a thread, answering `/v1/chat/completions` as `mode` says: `ok` (two
    chunks, a last one, [DONE]), `drop` (two chunks, then the connection is cut once the test has seen them: `cut`),
    `error` (two chunks, then the gateway's error event and the end), `refuse` (503 no_backend before any byte),
    `busy` (429 as a full TGI answers it, before any byte), `huge` (two chunks, then an event that never ends)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.cut = threading.Event()
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._started.wait(30), "the fake gateway did not start"

    def _run(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        runner = self._runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((dict(request.headers), body))
        if self.mode == "refuse":
            error = {"error": {"message": "no backend serves it", "type": "server_error", "param": None,
                               "code": "no_backend"}}  # fmt: skip
            return web.json_response(error, status=503, headers={"spillway-reason": "no_backend"})
        if self.mode == "busy":  # TGI's shape: no code a client could read, only the status
            return web.json_response({"error": "Model is overloaded", "error_type": "overloaded"}, status=429)
        if not body.get("stream"):
            whole = {"id": "chatcmpl-cloud", "object": "chat.completion", "created": 1, "model": TINY_LM,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "from the cloud"},
                                  "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}  # fmt: skip
            return web.json_response(whole, headers={"spillway-backend": "fake-cloud"})
        response = web.StreamResponse(headers={"content-type": "text/event-stream", "spillway-backend": "fake-cloud"})
        await response.prepare(request)
        await response.write(sse(chunk("from ")))
        await response.write(sse(chunk("the ")))
        if self.mode == "drop":
            await asyncio.get_running_loop().run_in_executor(None, self.cut.wait, 30)
            self.cut.clear()
            assert request.transport is not None
            request.transport.close()  # cut: the chunked body never ends
            return response
        if self.mode == "error":
            await response.write(sse(GATEWAY_ERROR))
        elif self.mode == "huge":  # no blank line in sight: the agent must not hold it all
            await response.write(b"data: " + b"x" * (MAX_EVENT_BYTES + 1024))
        else:
            await response.write(sse(chunk("cloud", "stop")) + sse("[DONE]"))
        await response.write_eof()
        return response

    def close(self) -> None:
        self.cut.set()  # a `drop` answer whose client left before the cut (nobody set it) ends now, not in 30 s
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


@dataclass
class Edge:
    """The OpenAI API of an agent in process, served on loopback, whose gateway, policy and fallbacks a test sets."""

    url: str
    api: OpenAIApi
    gate: Gate
    heard: Heard
    engine: EnginePool
    forwarders: list[Forwarder]

    def gateway(self, url: str | None, **breaker: Any) -> Forwarder | None:
        if url is None:
            self.api.forwarder = None
            return None
        forwarder = Forwarder(url, TOKEN, breaker=BreakerConfig(**{"min_requests": 100, **breaker}),
                              default_timeout_s=10)  # fmt: skip
        self.forwarders.append(forwarder)
        self.api.forwarder = forwarder
        return forwarder

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def post(self, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json={"model": TINY_LM, **body}, timeout=60)

    def events(self, body: dict[str, Any], cut: threading.Event | None = None) -> tuple[httpx.Response, list[str]]:
        """A streamed chat's answer and the `data` of each of its events, in order; `cut` is set once two came."""
        lines = []
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json={"model": TINY_LM, "stream": True, **body},
                          timeout=60) as answer:  # fmt: skip
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: ") :])
                    if len(lines) == 2 and cut is not None:
                        cut.set()
        return answer, lines


@pytest.fixture(scope="module")
def lm_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    build_tiny_lm_version(repo / TINY_LM, 1, TINY)
    return repo


@pytest.fixture(scope="module")
def edge(lm_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    settings = GenerationSettings(kv_budget_bytes=64 << 20, max_num_seqs=4)
    engine = load_engine(TINY_LM, lm_repo / TINY_LM / "1", settings, threads=1)
    heard = Heard()
    engine.listener = heard
    gate = Gate()
    store = JobStore(tmp_path_factory.mktemp("jobs") / "jobs.sqlite")
    jobs = AsyncQueue(store, ModelRegistry([]), [TINY_LM], drain_below=0.9)
    api = OpenAIApi({TINY_LM: engine}, max_body_bytes=1 << 20, default_max_tokens=32, policy=gate,
                    cache_bytes=1 << 20, jobs=jobs)  # fmt: skip
    app = InferenceApp(ModelRegistry([]), openai=api, jobs=jobs)
    forwarders: list[Forwarder] = []

    async def start() -> None:
        jobs.start()

    async def stop() -> None:
        await jobs.stop()
        for forwarder in forwarders:
            await forwarder.close()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
    try:
        with serving(app) as url:  # type: ignore[arg-type]
            yield Edge(url, api, gate, heard, engine, forwarders)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def fake_gateway() -> Iterator[FakeGateway]:
    gateway = FakeGateway()
    yield gateway
    gateway.close()


@pytest.fixture(autouse=True)
def _fresh(edge: Edge, fake_gateway: FakeGateway) -> None:
    """Each test sets its own policy, gateway and default text, and reads only the outcomes it caused."""
    fake_gateway.cut.clear()
    edge.gate.plan = None
    edge.gateway(None)
    edge.engine.fallback_text = None
    edge.heard.outcomes.clear()
    edge.heard.finishes.clear()


def ends(events: list[str]) -> list[str]:
    """The events that end a stream: [DONE] and error events."""
    return [e for e in events if e == "[DONE]" or "error" in json.loads(e)]


# ---- the cap and shed --------------------------------------------------------------------------------------------


def test_the_max_tokens_cap_lowers_what_asks_for_more_and_says_so(edge: Edge) -> None:
    edge.gate.plan = ModelPlan(TINY_LM, max_tokens_cap=3)
    client = edge.client()
    raw = client.chat.completions.with_raw_response.create(model=TINY_LM, messages=HELLO, max_tokens=12,
                                                           extra_body={"ignore_eos": True})  # fmt: skip
    capped = raw.parse()
    assert raw.headers["spillway-max-tokens-cap"] == "3" and raw.headers["spillway-outcome"] == "local"
    assert capped.choices[0].finish_reason == "length" and capped.usage is not None
    assert capped.usage.completion_tokens == 3
    assert (capped.model_extra or {})["spillway"]["max_tokens_cap"] == 3
    defaulted = client.chat.completions.with_raw_response.create(model=TINY_LM, messages=HELLO,
                                                                 extra_body={"ignore_eos": True})  # fmt: skip
    assert defaulted.headers["spillway-max-tokens-cap"] == "3"  # none asked: the default (32) is above the cap
    under = client.chat.completions.with_raw_response.create(model=TINY_LM, messages=HELLO, max_tokens=2,
                                                             extra_body={"ignore_eos": True})  # fmt: skip
    assert "spillway-max-tokens-cap" not in under.headers
    assert under.parse().usage is not None and under.parse().usage.completion_tokens == 2  # type: ignore[union-attr]
    stream = client.chat.completions.with_raw_response.create(model=TINY_LM, messages=HELLO, max_tokens=50,
                                                              stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    assert stream.headers["spillway-max-tokens-cap"] == "3"
    finals = [c.choices[0].finish_reason for c in stream.parse() if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]


def test_a_shed_priority_is_a_503_with_retry_after_in_openais_shape(edge: Edge) -> None:
    edge.gate.plan = ModelPlan(TINY_LM, shed=Shed(at_or_below=3, retry_after_s=7))
    with pytest.raises(openai.InternalServerError) as shed:
        edge.client().chat.completions.create(model=TINY_LM, messages=HELLO, max_tokens=2, extra_body={"priority": 3})
    response = shed.value.response
    assert response.status_code == 503 and response.headers["retry-after"] == "7"
    assert response.headers["spillway-reason"] == "shed" and response.headers["spillway-outcome"] == "rejected"
    assert shed.value.code == "shed"
    served = edge.post({"messages": HELLO, "max_tokens": 2, "priority": 1})
    assert served.status_code == 200 and served.headers["spillway-outcome"] == "local"
    assert (3, "rejected") in edge.heard.outcomes and (1, "local") in edge.heard.outcomes


def test_the_policys_fallback_answers_from_the_cache_or_with_its_default_text(edge: Edge) -> None:
    edge.gate.plan = ModelPlan(TINY_LM, fallback=Fallback(at_or_below=3, mode="cache"))
    greedy = {"messages": [{"role": "user", "content": "policy cache"}], "max_tokens": 4, "temperature": 0}
    miss = edge.post({**greedy, "priority": 3})
    assert miss.status_code == 503 and miss.headers["spillway-reason"] == "fallback_miss"
    local = edge.post({**greedy, "priority": 1})
    hit = edge.post({**greedy, "priority": 3})
    assert hit.headers["spillway-outcome"] == "fallback_cache"
    assert hit.json()["choices"] == local.json()["choices"]

    edge.gate.plan = ModelPlan(TINY_LM, fallback=Fallback(at_or_below=3, mode="default", default_text="Busy."))
    answer, events = edge.events({**greedy, "priority": 3})
    assert answer.headers["spillway-outcome"] == "fallback_default" and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Busy."
    assert chunks[-1]["spillway"]["outcome"] == "fallback_default"
    assert [o for level, o in edge.heard.outcomes if level == 3] == ["rejected", "fallback_cache", "fallback_default"]


# ---- overflow ----------------------------------------------------------------------------------------------------


def test_an_overflowed_stream_is_relayed_with_the_spillway_chunk_before_done(
    edge: Edge, fake_gateway: FakeGateway
) -> None:
    fake_gateway.mode = "ok"
    edge.gateway(fake_gateway.url)
    edge.gate.plan = ModelPlan(TINY_LM, overflow=Overflow(at_or_below=3), max_tokens_cap=2)
    answer, events = edge.events({"messages": HELLO, "max_tokens": 4, "priority": 3, "timeout": 5_000_000})
    assert answer.status_code == 200
    assert "spillway-max-tokens-cap" not in answer.headers  # the device's cap is not the cloud's
    assert answer.headers["spillway-outcome"] == "overflow" and answer.headers["spillway-backend"] == "fake-cloud"
    assert events[:3] == [json.dumps(chunk("from ")), json.dumps(chunk("the ")), json.dumps(chunk("cloud", "stop"))]
    marker = json.loads(events[3])
    assert marker["choices"] == [] and marker["id"] == "chatcmpl-cloud" and marker["object"] == "chat.completion.chunk"
    assert marker["spillway"] == {"outcome": "overflow", "backend": "fake-cloud"}
    assert events[4:] == ["[DONE]"]
    headers, body = fake_gateway.seen[-1]
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert 0 < int(headers["spillway-timeout-us"]) <= 5_000_000  # the first byte's deadline, less a margin
    assert body["priority"] == 3 and body["messages"] == HELLO and body["max_tokens"] == 4  # the same body
    assert edge.heard.outcomes == [(3, "overflow")]
    ((outcome, measured),) = edge.heard.finishes
    assert outcome == "overflow" and measured["ttft_s"] is not None and measured["ttft_s"] <= measured["duration_s"]
    assert measured["completion_tokens"] == 3  # three chunks carried text

    create = edge.client().chat.completions.with_raw_response.create
    whole = create(model=TINY_LM, messages=HELLO, max_tokens=4, extra_body={"priority": 3, "timeout": 5_000})
    assert whole.headers["spillway-outcome"] == "overflow"
    parsed = whole.parse()
    assert parsed.choices[0].message.content == "from the cloud"
    assert (parsed.model_extra or {})["spillway"] == {"outcome": "overflow", "backend": "fake-cloud"}
    # A whole answer's first byte is the whole completion: not held to the first token's 5 ms, but the default.
    assert int(fake_gateway.seen[-1][0]["spillway-timeout-us"]) > 5_000
    ((outcome, measured),) = edge.heard.finishes[1:]
    assert outcome == "overflow" and measured["ttft_s"] is not None  # its first token came with the whole answer
    local = edge.post({"messages": HELLO, "max_tokens": 4, "priority": 1})
    assert local.headers["spillway-outcome"] == "local"  # priority 1 is not overflowed


@pytest.mark.parametrize("mode", ["drop", "error"])
def test_a_gateway_failing_mid_stream_ends_it_with_one_error_event_never_done(edge: Edge, fake_gateway: FakeGateway,
                                                                              mode: str) -> None:  # fmt: skip
    fake_gateway.mode = mode
    forwarder = edge.gateway(fake_gateway.url)
    assert forwarder is not None
    edge.gate.plan = OVERFLOW_P3
    cut = fake_gateway.cut if mode == "drop" else None
    answer, events = edge.events({"messages": HELLO, "max_tokens": 4, "priority": 3}, cut)
    assert answer.headers["spillway-outcome"] == "overflow"  # told before the failure came
    assert events[:2] == [json.dumps(chunk("from ")), json.dumps(chunk("the "))]
    assert len(events) == 3 and ends(events) == events[2:] and "[DONE]" not in events
    error = json.loads(events[2])["error"]
    if mode == "error":
        assert error == GATEWAY_ERROR["error"]  # the gateway's own, relayed unchanged
    else:
        assert error["code"] == "overflow_failed" and error["type"] == "server_error"
    assert forwarder.breaker.json()["errors"] == 1 and forwarder.breaker.json()["requests"] == 1
    assert edge.heard.outcomes == [(3, "error")]
    stream = edge.client().chat.completions.create(model=TINY_LM, messages=HELLO, max_tokens=4, stream=True,
                                                   extra_body={"priority": 3})  # fmt: skip
    with pytest.raises(openai.APIError):  # the openai package raises it: the stream cannot pass for complete
        for seen, _ in enumerate(stream, start=1):
            if seen == 2 and mode == "drop":
                fake_gateway.cut.set()
    assert forwarder.breaker.json()["errors"] == 2
    # The agent counts the second stream's outcome as its relay ends, which may be after the client raised: wait for
    # it here, or it lands in the next test's listener (the engine is shared) as a second outcome there.
    deadline = time.monotonic() + 30
    while len(edge.heard.outcomes) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_client_leaving_an_overflowed_stream_ends_the_relay_without_blaming_the_gateway(
    edge: Edge, fake_gateway: FakeGateway
) -> None:
    fake_gateway.mode = "drop"  # holds the stream open after two chunks until `cut`
    forwarder = edge.gateway(fake_gateway.url)
    assert forwarder is not None
    edge.gate.plan = OVERFLOW_P3
    try:
        body = {"model": TINY_LM, "messages": HELLO, "stream": True, "priority": 3}
        with httpx.stream("POST", f"{edge.url}/v1/chat/completions", json=body, timeout=60) as answer:
            seen = []
            for line in answer.iter_lines():
                seen += [line] if line.startswith("data: ") else []
                if len(seen) == 2:
                    break  # the client leaves mid-stream
        deadline = time.monotonic() + 30
        while not edge.heard.outcomes:
            assert time.monotonic() < deadline, "the relay did not end when its client left"
            time.sleep(0.02)
    finally:
        fake_gateway.cut.set()
    assert edge.heard.outcomes == [(3, "overflow")]
    assert forwarder.in_flight == 0 and forwarder.breaker.json()["requests"] == 0  # no verdict either way


def test_an_event_over_the_limit_breaks_the_overflowed_stream(edge: Edge, fake_gateway: FakeGateway) -> None:
    events = SseEvents()
    assert events.feed(b"data: 1\n\ndata: " + b"x" * (MAX_EVENT_BYTES - 16)) == [(b"data: 1\n\n", "1")]
    with pytest.raises(StreamBroken, match="over 1 MiB"):  # the rest of an event, never the stream, is bounded
        events.feed(b"x" * 64)

    fake_gateway.mode = "huge"
    forwarder = edge.gateway(fake_gateway.url)
    assert forwarder is not None
    edge.gate.plan = OVERFLOW_P3
    _, seen = edge.events({"messages": HELLO, "max_tokens": 4, "priority": 3})
    assert seen[:2] == [json.dumps(chunk("from ")), json.dumps(chunk("the "))]
    assert len(seen) == 3 and ends(seen) == seen[2:] and "[DONE]" not in seen
    error = json.loads(seen[2])["error"]
    assert error["code"] == "overflow_failed" and "over 1 MiB" in error["message"]
    assert forwarder.breaker.json()["errors"] == 1 and forwarder.in_flight == 0
    assert edge.heard.outcomes == [(3, "error")]


def test_a_full_cloud_429_is_busy_not_a_failure_of_the_gateway(edge: Edge, fake_gateway: FakeGateway) -> None:
    fake_gateway.mode = "busy"
    forwarder = edge.gateway(fake_gateway.url, min_requests=1)
    assert forwarder is not None
    edge.gate.plan = OVERFLOW_P3
    edge.engine.fallback_text = "later"
    for _ in range(2):
        answer = edge.post({"messages": HELLO, "max_tokens": 3, "priority": 3, "stream": True})
        assert answer.headers["spillway-outcome"] == "fallback_default"
        assert answer.headers["spillway-reason"] == "gateway_429"
    assert forwarder.breaker.state == "closed" and forwarder.breaker.json()["errors"] == 0


def test_refusals_of_a_broken_engine_are_counted_once(edge: Edge) -> None:
    (instance,) = edge.engine.instances
    instance.broken = "RuntimeError: a bug of ours (the test's)"
    refused_before = instance.counts["refused"]
    try:
        answer = edge.post({"messages": HELLO, "max_tokens": 2, "priority": 1})
    finally:
        instance.broken = None
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "draining"
    assert edge.heard.outcomes == [(1, "rejected")] and instance.counts["refused"] == refused_before + 1


def test_when_overflow_fails_before_a_byte_the_fallbacks_answer_in_order(edge: Edge, fake_gateway: FakeGateway) -> None:
    fake_gateway.mode = "refuse"
    edge.gateway(fake_gateway.url)
    edge.gate.plan = OVERFLOW_P3
    greedy = {"messages": [{"role": "user", "content": "cache me"}], "max_tokens": 6, "temperature": 0}
    local = edge.post({**greedy, "priority": 1})
    assert local.headers["spillway-outcome"] == "local"
    text = local.json()["choices"][0]["message"]["content"]

    # 1. The cached completion of this very greedy request: whole, and as a proper stream.
    cached = edge.post({**greedy, "priority": 3})
    assert cached.status_code == 200 and cached.headers["spillway-outcome"] == "fallback_cache"
    assert cached.headers["spillway-reason"] == "gateway_no_backend"
    assert cached.json()["choices"][0]["message"]["content"] == text
    assert cached.json()["spillway"]["outcome"] == "fallback_cache"
    answer, events = edge.events({**greedy, "priority": 3})
    assert answer.headers["spillway-outcome"] == "fallback_cache" and ends(events) == ["[DONE]"] == events[-1:]
    streamed = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed if c["choices"]) == text
    assert streamed[-1]["spillway"]["outcome"] == "fallback_cache"

    # 2. Not cached (another max_tokens, or not greedy): the default text.
    edge.engine.fallback_text = "The device is busy; please try again."
    for other in ({**greedy, "max_tokens": 5}, {**greedy, "temperature": 0.7}):
        default = edge.post({**other, "priority": 3})
        assert default.headers["spillway-outcome"] == "fallback_default", default.text
        assert default.json()["choices"][0]["message"]["content"] == "The device is busy; please try again."

    # 3. No default text: the async queue; the job's answer is the completion, run here.
    edge.engine.fallback_text = None
    queued = edge.post({**greedy, "max_tokens": 5, "priority": 3})
    assert queued.status_code == 202 and queued.headers["spillway-outcome"] == "queued_async"
    location = queued.headers["location"]
    assert location == f"/spillway/v1/jobs/{queued.json()['id']}"
    deadline = time.monotonic() + 60
    while (job := httpx.get(f"{edge.url}{location}", timeout=10).json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    assert job["status"] == "done", job
    answered = job["response"]
    assert answered["object"] == "chat.completion" and answered["spillway"]["outcome"] == "queued_async"
    alone = edge.post({**greedy, "max_tokens": 5, "priority": 1}).json()["choices"][0]["message"]["content"]
    assert answered["choices"][0]["message"]["content"] == alone

    # 4. No queue for it either: 503 with the reason.
    jobs, edge.api.jobs = edge.api.jobs, None
    try:
        refused = edge.post({**greedy, "max_tokens": 4, "priority": 3})
    finally:
        edge.api.jobs = jobs
    assert refused.status_code == 503 and refused.headers["spillway-reason"] == "gateway_no_backend"
    assert refused.json()["error"]["code"] == "gateway_no_backend" and "retry-after" in refused.headers
    answers = [outcome for level, outcome in edge.heard.outcomes if level == 3]
    assert answers == ["fallback_cache", "fallback_cache", "fallback_default", "fallback_default", "queued_async",
                       "rejected"]  # one outcome per answer  # fmt: skip


def test_a_gateway_that_cannot_be_reached_opens_the_breaker_and_fallbacks_still_answer(edge: Edge) -> None:
    forwarder = edge.gateway(f"http://127.0.0.1:{free_port()}", min_requests=2, open_s=60)
    assert forwarder is not None
    edge.gate.plan = OVERFLOW_P3
    edge.engine.fallback_text = "later"
    reasons = []
    for _ in range(3):
        answer = edge.post({"messages": HELLO, "max_tokens": 3, "priority": 3, "stream": True})
        assert answer.headers["spillway-outcome"] == "fallback_default"
        assert answer.text.rstrip().endswith("data: [DONE]")
        reasons.append(answer.headers["spillway-reason"])
    assert reasons == ["gateway_unreachable", "gateway_unreachable", "breaker_open"]
    assert forwarder.breaker.state == "open"


# ---- real processes: an edge agent overflowing to a cloud agent, through the openai package -------------------------


@pytest.fixture(scope="module")
def cloud(lm_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningAgent]:
    running = start_agent(lm_repo, tmp_path_factory.mktemp("cloud"), role="cloud", token=TOKEN, intra_op_threads=1,
                          generation={"kv_budget_bytes": 64 << 20, "max_num_seqs": 4})  # fmt: skip
    yield running
    stop_agent(running)


def test_an_edge_agent_overflows_streams_to_a_cloud_agent_through_the_openai_package(
    lm_repo: Path, tmp_path: Path, cloud: RunningAgent
) -> None:
    agent = start_agent(lm_repo, tmp_path, agent_token=TOKEN, intra_op_threads=1,
                        generation={"kv_budget_bytes": 64 << 20, "max_num_seqs": 4},
                        overflow={"enabled": True, "gateway": cloud.url, "at_or_below": 3})  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{agent.url}/v1", api_key="unused", max_retries=0, timeout=60)
        create = client.chat.completions.with_raw_response.create
        local = create(model=TINY_LM, messages=HELLO, max_tokens=8, temperature=0, extra_body={"priority": 1})
        assert local.headers["spillway-outcome"] == "local"
        text = local.parse().choices[0].message.content

        whole = create(model=TINY_LM, messages=HELLO, max_tokens=8, temperature=0, extra_body={"priority": 3})
        assert whole.headers["spillway-outcome"] == "overflow"
        assert whole.parse().choices[0].message.content == text  # the same weights in the cloud: the same text
        assert (whole.parse().model_extra or {})["spillway"]["outcome"] == "overflow"

        streamed = create(model=TINY_LM, messages=HELLO, max_tokens=8, temperature=0, stream=True,
                          extra_body={"priority": 3})  # fmt: skip
        assert streamed.headers["spillway-outcome"] == "overflow"
        chunks = list(streamed.parse())
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].choices == [] and (chunks[-1].model_extra or {})["spillway"]["outcome"] == "overflow"
        ask = {"model": TINY_LM, "messages": HELLO, "max_tokens": 8, "temperature": 0}
        with httpx.stream("POST", f"{agent.url}/v1/chat/completions", json={**ask, "stream": True, "priority": 3},
                          timeout=60) as raw:  # fmt: skip
            events = [line for line in raw.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and sum(e == "data: [DONE]" for e in events) == 1
        status = httpx.get(f"{agent.url}/v2/spillway/status", timeout=10).json()
        assert status["overflow"]["breaker"]["state"] == "closed" and status["overflow"]["answered"] == 3
    finally:
        stop_agent(agent)


def test_triton_generate_takes_the_cap_the_shed_and_the_fallbacks_too(edge: Edge) -> None:
    url = f"{edge.url}/v2/models/{TINY_LM}/generate"
    edge.gate.plan = ModelPlan(TINY_LM, max_tokens_cap=2, shed=Shed(at_or_below=3, retry_after_s=4))
    capped = httpx.post(url, json={"text_input": "Hello", "parameters": {"max_tokens": 9, "ignore_eos": True}},
                        timeout=60)  # fmt: skip
    assert capped.status_code == 200 and capped.headers["spillway-max-tokens-cap"] == "2"
    assert capped.json()["finish_reason"] == "length" and capped.json()["usage"]["completion_tokens"] == 2
    shed = httpx.post(url, json={"text_input": "Hello", "parameters": {"priority": 3}}, timeout=60)
    assert shed.status_code == 503 and shed.headers["spillway-reason"] == "shed" and shed.headers["retry-after"] == "4"
    assert isinstance(shed.json()["error"], str)  # V2's shape on V2's route

    edge.gate.plan = OVERFLOW_P3  # no gateway speaks Triton's generate: what the device takes it serves
    served = httpx.post(url, json={"text_input": "Hello", "parameters": {"priority": 3, "max_tokens": 2}}, timeout=60)
    assert served.status_code == 200 and served.headers["spillway-outcome"] == "local"
    assert edge.heard.outcomes[-1] == (3, "local")

    edge.gate.plan = ModelPlan(TINY_LM, fallback=Fallback(at_or_below=3, mode="default", default_text="Busy."))
    edge.heard.outcomes.clear()
    for stream in (False, True):
        fallback = httpx.post(url + ("_stream" if stream else ""), json={"text_input": "Hello",
                              "parameters": {"priority": 3}}, timeout=60)  # fmt: skip
        assert fallback.status_code == 200 and fallback.headers["spillway-outcome"] == "fallback_default"
        assert "Busy." in fallback.text
    assert edge.heard.outcomes == [(3, "fallback_default")] * 2  # each answer counted, and once


def test_a_sequence_the_engine_cuts_short_is_an_error_not_a_stop(lm_repo: Path) -> None:
    """An engine closed with streams running (the drain's timeout passed) ends them `cancelled`: the client gets an
    error (an error event and no [DONE]; a 503 for a whole answer), never a completion that looks whole."""
    engine = load_engine(TINY_LM, lm_repo / TINY_LM / "1", GenerationSettings(kv_budget_bytes=16 << 20), threads=1)
    (instance,) = engine.instances
    prefill = instance.runner.prefill

    def held(*args: Any, **kwargs: Any) -> Any:  # the first step waits for the close: both sequences still run
        deadline = time.monotonic() + 30
        while not instance._stop and time.monotonic() < deadline:
            time.sleep(0.005)
        return prefill(*args, **kwargs)

    instance.runner.prefill = held  # type: ignore[method-assign]
    api = OpenAIApi({TINY_LM: engine}, max_body_bytes=1 << 20, default_max_tokens=32)
    ask = {"model": TINY_LM, "messages": HELLO, "max_tokens": 16, "ignore_eos": True}
    answers: dict[str, Any] = {}
    try:
        with serving(InferenceApp(ModelRegistry([]), openai=api)) as url:  # type: ignore[arg-type]

            def streamed() -> None:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json={**ask, "stream": True},
                                  timeout=60) as answer:  # fmt: skip
                    answers["events"] = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
                    answers["stream_status"] = answer.status_code

            def whole() -> None:
                answers["whole"] = httpx.post(f"{url}/v1/chat/completions", json=ask, timeout=60)

            clients = [threading.Thread(target=streamed), threading.Thread(target=whole)]
            for client in clients:
                client.start()
            deadline = time.monotonic() + 30
            while instance.active < 2:
                assert time.monotonic() < deadline, "the two requests were not admitted"
                time.sleep(0.01)
            engine.close()
            for client in clients:
                client.join(timeout=30)
    finally:
        engine.close()
    assert answers["stream_status"] == 200 and "[DONE]" not in answers["events"]
    assert ends(answers["events"]) == answers["events"][-1:]
    assert json.loads(answers["events"][-1])["error"]["code"] == "cancelled"
    whole_answer: httpx.Response = answers["whole"]
    assert whole_answer.status_code == 503 and whole_answer.json()["error"]["code"] == "cancelled"
    assert whole_answer.headers["spillway-outcome"] == "error"
