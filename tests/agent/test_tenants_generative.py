"""Tenants on the generative APIs: a tenant over its quota (streams at once, tokens a second) is refused before any
token with 429 in OpenAI's shape (and V2's on Triton's generate), Retry-After and `spillway-reason: tenant_quota`,
counted once as rejected and named in telemetry; its tokens come back as the fake clock runs; a request above the
tenant's priority ceiling is served at the ceiling, here and overflowed (the gateway hears `spillway-tenant` and the
clamped priority); a client that leaves mid-stream gives its tenant's stream back; gRPC's generate stream, which
goes through the same app, meets the same quota.

In process: the real OpenAI API and app over real HTTP (uvicorn on loopback) on a real tiny-lm engine, the real
tenants registry (its clock a fake one, so buckets refill without sleeping), the real telemetry read in memory, the
`openai` package as the client, and a small ASGI gateway that records what it is sent.
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

import grpc
import httpx
import openai
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from tritonclient.grpc import service_pb2, service_pb2_grpc

from edge_agent.config import GenerationSettings
from edge_agent.generation.load import load_engine
from edge_agent.generation.pool import EnginePool
from edge_agent.overflow.breaker import BreakerConfig
from edge_agent.overflow.forward import Forwarder
from edge_agent.policy.plan import ModelPlan
from edge_agent.serving.app import InferenceApp
from edge_agent.serving.grpc_server import GrpcEndpoint
from edge_agent.serving.models import ModelRegistry
from edge_agent.serving.openai_api import OpenAIApi
from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
from edge_agent.tenants import TenantRegistry
from spillway.contract import names
from spillway.contract.policy import Overflow
from spillway.contract.tenants import Tenant, hash_token
from spillway.demo.tiny_lm import TINY, TINY_LM, build_tiny_lm_version
from tests.utils.server import serving

OPERATOR = "operator-token"
LONG: dict[str, Any] = {
    "max_tokens": 500,
    "temperature": 0,
    "extra_body": {"ignore_eos": True},
}  # ~0.5 s of tokens: still running


def tenant(name: str, **limits: Any) -> Tenant:
    return Tenant(name=name, token_sha256=[hash_token(f"tok-{name}")], **limits)


TENANTS = [
    tenant("streamer", max_streams=1),
    tenant("thrifty", tokens_per_s=100),
    tenant("capped", max_priority=3),
    tenant("leaver", max_streams=1, max_in_flight=1),
    tenant("metered", tokens_per_s=1),
]


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Gate:
    plan: ModelPlan | None = None

    def plan_for(self, name: str) -> ModelPlan | None:
        return self.plan if self.plan is not None and self.plan.name == name else None


@dataclass
class Gateway:
    """A gateway that records each request's headers and body, and answers a short stream."""

    seen: list[dict[str, str]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(json.loads(body))
        chunk = {"id": "cmpl-cloud", "object": "text_completion", "created": 1, "model": TINY_LM,
                 "choices": [{"index": 0, "text": "cloud", "finish_reason": "stop"}]}  # fmt: skip
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"spillway-backend", b"fake")]})  # fmt: skip
        await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()})


@dataclass
class Edge:
    url: str
    api: OpenAIApi
    engine: EnginePool
    tenants: TenantRegistry
    clock: FakeClock
    gate: Gate
    gateway: Gateway
    reader: InMemoryMetricReader

    def client(self, name: str) -> openai.OpenAI:
        key = OPERATOR if name == "default" else f"tok-{name}"
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def held(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.tenants.json()["tenants"][name]
        return found

    def wait_released(self, name: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (self.held(name)["in_flight"], self.held(name)["streams"]) != (0, 0):
            assert time.monotonic() < deadline, f"{name} still holds {self.held(name)}"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    repo = tmp_path_factory.mktemp("repo")
    build_tiny_lm_version(repo / TINY_LM, 1, TINY)
    engine = load_engine(TINY_LM, repo / TINY_LM / "1", GenerationSettings(kv_budget_bytes=64 << 20, max_num_seqs=4),
                         threads=1)  # fmt: skip
    clock = FakeClock()
    tenants = TenantRegistry(TENANTS, OPERATOR, clock=clock)
    reader = InMemoryMetricReader()
    telemetry = AgentTelemetry(TelemetrySettings(agent_id="t"), readers=[reader], probes=False)
    telemetry.tenant_label = tenants.label
    engine.listener = telemetry.generation(TINY_LM)
    gate = Gate()
    gateway = Gateway()
    api = OpenAIApi({TINY_LM: engine}, max_body_bytes=1 << 20, default_max_tokens=32, policy=gate, tenants=tenants)
    app = InferenceApp(ModelRegistry([]), token=OPERATOR, openai=api, tenants=tenants)
    try:
        with serving(gateway) as gateway_url, serving(app) as url:  # type: ignore[arg-type]
            forwarder = Forwarder(gateway_url, "edge-token", breaker=BreakerConfig(min_requests=100),
                                  default_timeout_s=10)  # fmt: skip
            api.forwarder = forwarder

            async def close() -> None:
                await forwarder.close()

            app.on_shutdown.append(close)
            yield Edge(url, api, engine, tenants, clock, gate, gateway, reader)
    finally:
        engine.close()
        telemetry.shutdown()


def _points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    assert data is not None
    return [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics if m.name == name
            for p in m.data.data_points]  # fmt: skip


def _requests(reader: InMemoryMetricReader, tenant_name: str) -> dict[tuple[int, str], int]:
    """spillway.requests of one tenant: {(priority, outcome): count}."""
    return {(p.attributes[names.ATTR_PRIORITY], p.attributes[names.ATTR_OUTCOME]): p.value
            for p in _points(reader, names.REQUESTS) if p.attributes.get(names.ATTR_TENANT) == tenant_name}  # fmt: skip


def test_a_tenant_over_its_streams_gets_429_in_openai_shape_and_its_stream_back_after(edge: Edge) -> None:
    running = edge.client("streamer").completions.create(model=TINY_LM, prompt="x", stream=True, **LONG)
    first = next(iter(running))  # admitted and generating: it holds the tenant's one stream
    assert first.choices and edge.held("streamer")["streams"] == 1
    with pytest.raises(openai.RateLimitError) as refused:
        edge.client("streamer").completions.create(model=TINY_LM, prompt="again", max_tokens=2)
    error = refused.value.response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "streamer" in error["message"] and "max_streams" in error["message"]
    headers = refused.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers[names.H_REASON] == "tenant_quota" and headers[names.H_OUTCOME] == "rejected"
    # Triton's generate extension: the same quota, V2's error shape.
    generate = httpx.post(f"{edge.url}/v2/models/{TINY_LM}/generate", json={"text_input": "hi"},
                          headers={"authorization": "Bearer tok-streamer"}, timeout=30)  # fmt: skip
    assert generate.status_code == 429 and "max_streams" in generate.json()["error"]
    assert generate.headers[names.H_REASON] == "tenant_quota" and int(generate.headers["retry-after"]) >= 1
    # Another tenant is not held back by it.
    other = edge.client("thrifty").completions.create(model=TINY_LM, prompt="hi", max_tokens=2, temperature=0)
    assert other.choices[0].text is not None
    running.close()
    edge.wait_released("streamer")
    again = edge.client("streamer").completions.create(model=TINY_LM, prompt="again", max_tokens=2)
    assert again.usage is not None and again.usage.completion_tokens >= 1
    assert edge.held("streamer")["refused_by_quota"] == {"max_streams": 2}  # each refusal counted once
    assert _requests(edge.reader, "streamer")[(2, "rejected")] == 2


def test_tokens_per_s_refuses_after_a_big_prompt_until_the_bucket_refills(edge: Edge) -> None:
    client = edge.client("thrifty")
    edge.clock.now += 10  # whatever the other tests took: a full bucket (100 tokens)
    big = "a long prompt " * 20  # 280 tokens (bytes): taken although the bucket holds 100, which goes below zero
    done = client.completions.create(model=TINY_LM, prompt=big, max_tokens=4, temperature=0, extra_body={
        "ignore_eos": True})  # fmt: skip
    assert done.usage is not None and done.usage.prompt_tokens == 280 and done.usage.completion_tokens == 4
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=TINY_LM, prompt="small", max_tokens=2)
    error = refused.value.response.json()["error"]
    assert error["type"] == "tokens" and "tokens_per_s" in error["message"]
    retry = int(refused.value.response.headers["retry-after"])
    assert retry == 2  # 100 - 280 - 4 = -184 tokens: 2 s at 100 a second
    edge.clock.now += retry
    again = client.chat.completions.create(model=TINY_LM, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert again.choices[0].finish_reason in ("stop", "length")
    edge.wait_released("thrifty")


def test_a_level_above_the_ceiling_is_served_at_it_and_overflows_with_the_tenant(edge: Edge) -> None:
    asked: dict[str, Any] = {
        "model": TINY_LM,
        "prompt": "hi",
        "max_tokens": 2,
        "temperature": 0,
        "extra_body": {"priority": 1},
    }
    local = edge.client("capped").completions.create(**asked)  # level 1 asked, 3 is the ceiling: served at 3
    assert local.model_extra is not None and local.model_extra["spillway"]["outcome"] == "local"
    assert _requests(edge.reader, "capped") == {(3, "local"): 1}
    edge.gate.plan = ModelPlan(TINY_LM, overflow=Overflow(at_or_below=3))  # level 3 goes to the cloud
    try:
        edge.gateway.seen.clear()
        stream = edge.client("capped").completions.create(stream=True, **asked)
        text = "".join(c.choices[0].text for c in stream if c.choices)
        assert text == "cloud"
        (sent,) = edge.gateway.seen
        assert sent[names.H_TENANT] == "capped" and sent["spillway-priority"] == "3"
        assert edge.gateway.bodies[-1]["priority"] == 3  # the body too: a cloud that reads it is not told 1
        # The operator's request at level 1 has no ceiling: served here.
        mine = edge.client("default").completions.create(**asked)
        assert mine.model_extra is not None and mine.model_extra["spillway"]["outcome"] == "local"
        assert len(edge.gateway.seen) == 1
    finally:
        edge.gate.plan = None
    assert _requests(edge.reader, "capped") == {(3, "local"): 1, (3, "overflow"): 1}
    edge.wait_released("capped")


def test_a_client_that_leaves_mid_stream_gives_its_tenant_stream_back(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    instance = edge.engine.instances[0]
    cancelled = instance.counts["cancelled"]
    # Decode steps wait at a gate: the stream's first token (its prefill) arrives, and it cannot end on its own
    # before the client has left (on a busy machine it once did, 500 tokens before the client read the first).
    gate = threading.Event()
    decode = instance.runner.decode

    def gated_decode(*args: Any) -> Any:
        gate.wait(30)
        return decode(*args)

    monkeypatch.setattr(instance.runner, "decode", gated_decode)
    body = {"model": TINY_LM, "prompt": "x", "stream": True, "max_tokens": 500, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{edge.url}/v1/completions", json=body, timeout=30,
                          headers={"authorization": "Bearer tok-leaver"}) as answer:  # fmt: skip
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    break  # one event in: then the client goes
            assert edge.held("leaver")["in_flight"] == 1
    finally:
        gate.set()
    edge.wait_released("leaver")
    assert edge.engine.instances[0].counts["cancelled"] == cancelled + 1  # cut short, not finished
    after = edge.client("leaver").completions.create(model=TINY_LM, prompt="back", max_tokens=2)
    assert after.usage is not None and after.usage.completion_tokens >= 1
    edge.wait_released("leaver")


def test_generative_telemetry_names_the_tenant(edge: Edge) -> None:
    client = edge.client("metered")
    edge.clock.now += 10
    client.completions.create(model=TINY_LM, prompt="hello there", max_tokens=3, temperature=0)
    with pytest.raises(openai.RateLimitError):  # 1 token a second, 14 taken
        client.completions.create(model=TINY_LM, prompt="hello", max_tokens=3)
    with pytest.raises(openai.BadRequestError):  # invalid: counted before its level is known
        client.completions.create(model=TINY_LM, prompt="")
    assert _requests(edge.reader, "metered") == {(2, "local"): 1, (2, "rejected"): 1, (0, "rejected"): 1}
    durations = [p for p in _points(edge.reader, names.GENAI_TTFT) if p.attributes.get(names.ATTR_TENANT) == "metered"]
    assert len(durations) == 1 and durations[0].count == 1
    usage = {p.attributes[names.ATTR_GENAI_TOKEN_TYPE]: p.sum for p in _points(edge.reader, names.GENAI_TOKEN_USAGE)
             if p.attributes.get(names.ATTR_TENANT) == "metered"}  # fmt: skip
    assert usage["input"] == len(b"hello there")
    tenants = {p.attributes.get(names.ATTR_TENANT) for p in _points(edge.reader, names.REQUESTS)}
    assert tenants <= {"default", *(t.name for t in TENANTS)}  # bounded: the configured ones and the operator's
    edge.wait_released("metered")


def _generate_request(ident: str, text: str, **parameters: Any) -> Any:
    """A ModelStreamInfer request of Triton's generate extension: `text_input` and the sampling parameters."""
    request = service_pb2.ModelInferRequest(model_name=TINY_LM, id=ident)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(text.encode())
    for name, value in parameters.items():
        if isinstance(value, bool):
            request.parameters[name].bool_param = value
        else:
            request.parameters[name].int64_param = value
    return request


def test_grpc_generate_streams_meet_the_tenant_quota(tmp_path: Path) -> None:
    """Two ModelStreamInfer calls of a tenant with one stream: the second is an error_message saying tenant_quota
    while the first generates; once the first call is cancelled, the tenant's stream is back."""
    build_tiny_lm_version(tmp_path / TINY_LM, 1, TINY)
    engine = load_engine(TINY_LM, tmp_path / TINY_LM / "1", GenerationSettings(kv_budget_bytes=16 << 20,
                         max_num_seqs=2), threads=1)  # fmt: skip
    tenants = TenantRegistry([tenant("streamer", max_streams=1)], OPERATOR)
    api = OpenAIApi({TINY_LM: engine}, max_body_bytes=1 << 20, default_max_tokens=32, tenants=tenants)
    app = InferenceApp(ModelRegistry([]), token=OPERATOR, openai=api, tenants=tenants)
    auth = [("authorization", "Bearer tok-streamer")]

    def run(port: int) -> tuple[str, str]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            hold = threading.Event()

            def one_then_wait() -> Iterator[Any]:
                yield _generate_request("long", "x", max_tokens=500, ignore_eos=True)
                hold.wait(30)  # the stream stays open (half-closed would end it once answered)

            long = stub.ModelStreamInfer(one_then_wait(), metadata=auth, timeout=60)
            first = next(long)
            assert not first.error_message and first.infer_response.id == "long"
            (refused,) = stub.ModelStreamInfer(iter([_generate_request("short", "hi", max_tokens=2)]),
                                               metadata=auth, timeout=60)  # fmt: skip
            long.cancel()
            hold.set()
            deadline = time.monotonic() + 10
            while tenants.json()["tenants"]["streamer"]["streams"]:
                assert time.monotonic() < deadline, "the cancelled call still holds its stream"
                time.sleep(0.01)
            answers = list(stub.ModelStreamInfer(iter([_generate_request("again", "hi", max_tokens=2)]),
                                                 metadata=auth, timeout=60))  # fmt: skip
            return refused.error_message, answers[-1].error_message

    async def scenario() -> tuple[str, str]:
        endpoint = GrpcEndpoint(app, max_body_bytes=1 << 20)
        port = endpoint.bind("127.0.0.1", 0)
        await endpoint.start()
        try:
            return await asyncio.to_thread(run, port)
        finally:
            await endpoint.stop(None)

    try:
        refused, again = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        engine.close()
    assert "max_streams" in refused and "tenant_quota" in refused and "retry-after" in refused
    assert again == ""
