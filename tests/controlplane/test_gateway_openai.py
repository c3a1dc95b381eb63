"""The gateway's OpenAI-compatible relay on loopback: a real control plane; as `openai` backends a real Spillway
agent in cloud role serving tiny-lm and small scripted aiohttp servers (a stream held back, a connection dropped
mid-event, a 503 or a slow first byte). The client is the `openai` package (base_url the gateway's /v1, api_key an
agent token), or httpx where the test reads raw bytes and headers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from aiohttp import web

from controlplane.gateway.relay import _Events
from spillway.demo.harness import Process
from spillway.demo.tiny_lm import TINY, TINY_LM, build_tiny_lm_version
from tests.agent.conftest import RunningAgent, start_agent, stop_agent
from tests.utils.builders import make_backend
from tests.utils.gateway import Plane, running_plane, wait_for
from tests.utils.server import free_port

CLOUD_TOKEN = "cloud-secret"
CHAT = [{"role": "user", "content": "Hello!"}]


# ---- a scripted OpenAI-compatible server ----------------------------------------------------------------------


@dataclass
class Scripted:
    """An OpenAI-compatible server in a thread of its own. `mode` says what a completion request gets:
    ok (a stream of `chunks` chunks, or a whole answer), hold (the stream waits before its last chunk until `release`
    is set), drop (two chunks, half an event, then the connection is cut), stall (one chunk, then nothing),
    status (`status` before any byte), slow_head (`delay_s` before the headers), slow_body (headers at once, the
    first chunk after `delay_s`)."""

    models: list[str]
    mode: str = "ok"
    status: int = 503
    delay_s: float = 0.0
    chunks: int = 3
    release: threading.Event = field(default_factory=threading.Event)
    last_sent: threading.Event = field(default_factory=threading.Event)  # the stream's last chunk went out
    requests: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    _stop: Any = None

    def start(self) -> Scripted:
        port = free_port()
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/chat/completions", self._complete)
            app.router.add_post("/v1/completions", self._complete)
            runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
            stop = asyncio.Event()
            self._stop = (loop, stop)
            ready.set()
            loop.run_until_complete(stop.wait())
            loop.run_until_complete(runner.cleanup())
            loop.close()

        threading.Thread(target=run, daemon=True).start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        self.release.set()
        loop, stop = self._stop
        loop.call_soon_threadsafe(stop.set)

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "test"} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"body": body, "headers": dict(request.headers), "path": request.path})
        mode = self.mode
        if mode == "empty":
            return web.Response(status=200, content_type="text/event-stream")
        if mode in ("status", "busy"):  # busy: a refusal with Retry-After (a cloud agent that cannot start it in time)
            headers = {"Retry-After": "1"} if mode == "busy" else None
            return web.json_response({"error": {"message": "busy", "type": "server_error"}}, status=self.status,
                                     headers=headers)  # fmt: skip
        if mode == "slow_head":
            await asyncio.sleep(self.delay_s)
        chat = request.path.endswith("chat/completions")
        if not body.get("stream"):
            text = "".join(f"t{i} " for i in range(self.chunks))
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0,
                      "text": text}  # fmt: skip
            return web.json_response({"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                                      "created": 1, "model": body["model"],
                                      "choices": [{**choice, "finish_reason": "stop"}]})  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        if mode == "slow_body":
            await asyncio.sleep(self.delay_s)

        def event(i: int) -> bytes:
            delta = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
            chunk = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
                     "model": body["model"], "choices": [{"index": 0, **delta, "finish_reason": None}]}  # fmt: skip
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        with contextlib.suppress(ConnectionResetError):  # the gateway went away (as it should, in some tests)
            await self._stream(response, request, event)
        return response

    async def _stream(self, response: web.StreamResponse, request: web.Request, event: Any) -> None:
        mode = self.mode
        for i in range(self.chunks):
            if mode == "hold" and i == self.chunks - 1:
                for _ in range(1000):  # bounded: 10 s at most
                    if self.release.is_set():
                        break
                    await asyncio.sleep(0.01)
            await response.write(event(i))
            if i == self.chunks - 1:
                self.last_sent.set()
            if mode == "drop" and i == 1:
                await response.write(event(2)[:20])  # half an event
                assert request.transport is not None
                request.transport.close()
                return
            if mode == "stall":
                await asyncio.sleep(self.delay_s)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()


@pytest.fixture
def scripted() -> Iterator[list[Scripted]]:
    """Scripted servers a test starts (`scripted.append(Scripted(...).start())`); stopped after it."""
    started: list[Scripted] = []
    yield started
    for server in started:
        server.stop()


def serve(started: list[Scripted], models: list[str], **how: Any) -> Scripted:
    server = Scripted(models, **how).start()
    started.append(server)
    return server


# ---- a control plane and a cloud agent ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    db = tmp_path_factory.mktemp("plane") / "gw.db"
    with running_plane(f"sqlite:///{db}", gateway_health_interval_s=0.2) as running:
        yield running


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningAgent]:
    """A Spillway agent in cloud role serving tiny-lm behind a token."""
    repo = tmp_path_factory.mktemp("repo")
    build_tiny_lm_version(repo / TINY_LM, 1, TINY)
    running = start_agent(repo, tmp_path_factory.mktemp("cloud"), intra_op_threads=1, role="cloud", token=CLOUD_TOKEN,
                          generation={"kv_budget_bytes": 64 << 20, "max_num_seqs": 4})  # fmt: skip
    yield running
    stop_agent(running)


def register(plane: Plane, url: str, models: list[str], **over: Any) -> dict[str, Any]:
    body = make_backend(**{"url": url, "protocol": "openai", "models": models, "max_concurrency": 16,
                           "timeout_ms": 5000, **over})  # fmt: skip
    created = plane.client.post(f"{plane.url}/api/v1/backends", json=body, headers=plane.operator)
    assert created.status_code == 201, created.text
    return dict(created.json())


@pytest.fixture
def clean(plane: Plane) -> Iterator[Plane]:
    """The module's plane with no backend left over from another test."""
    yield plane
    for backend in plane.get("/api/v1/backends")["items"]:
        plane.client.delete(f"{plane.url}/api/v1/backends/{backend['id']}", headers=plane.operator)


def gateway_row(plane: Plane, backend: dict[str, Any]) -> dict[str, Any]:
    """The backend as this plane's gateway sees it now (its status listing)."""
    rows = {row["id"]: row for row in plane.app.state.gateway.status()["backends"]}
    return dict(rows[backend["id"]])


def ready(plane: Plane, backend: dict[str, Any]) -> dict[str, Any]:
    """Wait for the backend's first readiness round and return its row."""
    gateway = plane.app.state.gateway
    wait_for(lambda: backend["id"] in gateway.pool.states)
    rounds = gateway.checker.rounds
    wait_for(lambda: gateway.checker.rounds >= rounds + 2)
    return gateway_row(plane, backend)


def client(plane: Plane, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{plane.url}/v1", api_key=plane.token, max_retries=0, timeout=30,
                         default_headers=headers or None)  # fmt: skip


def post(plane: Plane, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return plane.client.post(f"{plane.url}/v1/{path}", json=body, headers={**plane.agent, **headers})


def events_of(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


# ---- tests ----------------------------------------------------------------------------------------------------


def test_a_cloud_agent_answers_through_the_gateway_under_its_own_name(clean: Plane, cloud: RunningAgent) -> None:
    """Stream and whole answers of a real Spillway agent, the edge's `edge-lm` mapped to the cloud's `tiny-lm`,
    the backend's auth header sent (the agent refuses without it): equal to what the agent answers directly."""
    plane = clean
    backend = register(plane, cloud.url, ["edge-lm"], model_map={"edge-lm": TINY_LM},
                       auth_header=f"Bearer {CLOUD_TOKEN}")  # fmt: skip
    assert backend["protocol"] == "openai" and backend["model_map"] == {"edge-lm": TINY_LM}
    row = ready(plane, backend)
    assert row["healthy"] and row["unhealthy_models"] == [], row  # /v1/models (with the token) lists tiny-lm
    assert (row["protocol"], row["model_map"]) == ("openai", {"edge-lm": TINY_LM})

    direct = openai.OpenAI(base_url=f"{cloud.url}/v1", api_key=CLOUD_TOKEN, max_retries=0, timeout=60)
    expected = direct.chat.completions.create(model=TINY_LM, messages=CHAT, max_tokens=12, temperature=0)
    relayed = client(plane).chat.completions.with_raw_response.create(model="edge-lm", messages=CHAT, max_tokens=12,
                                                                      temperature=0)  # fmt: skip
    assert relayed.headers["spillway-backend"] == backend["name"]
    whole = relayed.parse()
    assert whole.choices[0].message.content == expected.choices[0].message.content
    assert whole.model == TINY_LM  # the cloud's answer, as it came

    stream = client(plane).chat.completions.create(model="edge-lm", messages=CHAT, max_tokens=12, temperature=0,
                                                   stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected.choices[0].message.content
    done = client(plane).completions.create(model="edge-lm", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert done.choices[0].text == direct.completions.create(model=TINY_LM, prompt="Once upon a time",
                                                             max_tokens=6, temperature=0).choices[0].text  # fmt: skip
    assert gateway_row(plane, backend)["errors"] == 0


def test_readiness_asks_v1_models_for_every_mapped_name(clean: Plane, cloud: RunningAgent, scripted: list) -> None:
    plane = clean
    missing = register(plane, cloud.url, ["edge-lm", "other"], model_map={"edge-lm": TINY_LM, "other": "big-lm"},
                       auth_header=f"Bearer {CLOUD_TOKEN}")  # fmt: skip
    no_token = register(plane, cloud.url, [TINY_LM], auth_header=None)
    assert ready(plane, missing)["unhealthy_models"] == ["other"]
    assert ready(plane, no_token)["unhealthy_models"] == [TINY_LM]  # 401 without the backend's auth header

    def unhealthy() -> dict[str, str] | None:  # the events say why, once written
        found = {e["subject_id"]: e["data"]["error"] for e in plane.events("backend.unhealthy")}
        return found if {missing["id"], no_token["id"]} <= found.keys() else None

    errors = wait_for(unhealthy)
    assert errors[missing["id"]] == "GET /v1/models does not list 'big-lm'"
    assert errors[no_token["id"]] == "GET /v1/models answered 401"
    refused = post(plane, "chat/completions", {"model": "other", "messages": CHAT})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_healthy_backend"
    assert refused.headers["spillway-reason"] == "no_healthy_backend"
    assert post(plane, "chat/completions", {"model": "edge-lm", "messages": CHAT, "max_tokens": 2}).status_code == 200


def test_the_stream_is_relayed_as_it_comes_not_gathered(clean: Plane, scripted: list[Scripted]) -> None:
    """The backend holds its last chunk until the client has seen the first ones through the gateway: a relay that
    gathered the answer would see the hold run out (10 s) before the client saw anything."""
    plane = clean
    server = serve(scripted, ["m-cloud"], mode="hold", chunks=4)
    backend = register(plane, server.url, ["m"], model_map={"m": "m-cloud"}, auth_header="Bearer other-secret")
    stream = client(plane).chat.completions.create(model="m", messages=CHAT, stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.content == "t0 "
    assert not server.last_sent.is_set()  # the client has the first chunk before the backend sent its last
    server.release.set()
    rest = [c.choices[0].delta.content for c in stream]
    assert rest == ["t1 ", "t2 ", "t3 "]
    seen = server.requests[-1]
    assert (seen["body"]["model"], seen["body"]["messages"], seen["body"]["stream"]) == ("m-cloud", CHAT, True)
    assert seen["headers"]["Authorization"] == "Bearer other-secret"  # the backend's, not the agent's token
    assert gateway_row(plane, backend)["errors"] == 0


def test_a_drop_mid_stream_ends_with_an_error_event_and_counts_against_the_backend(
    clean: Plane, scripted: list[Scripted]
) -> None:
    plane = clean
    dropping = serve(scripted, ["m"], mode="drop")
    spare = serve(scripted, ["m"])
    backend = register(plane, dropping.url, ["m"])
    with plane.client.stream("POST", f"{plane.url}/v1/chat/completions", headers=plane.agent,
                             json={"model": "m", "messages": CHAT, "stream": True}) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_raw())
    events = events_of(raw)
    assert [orjson.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:2]] == ["t0 ", "t1 "]
    assert len(events) == 3 and b"[DONE]" not in raw  # the half event is not passed on, nor a [DONE]
    error = orjson.loads(events[2].removeprefix(b"data: "))["error"]
    assert (error["type"], error["code"], error["param"]) == ("server_error", "backend_failed", None)
    assert backend["name"] in error["message"]
    row = gateway_row(plane, backend)
    assert (row["errors"], row["consecutive_failures"]) == (1, 1) and row["last_error"]

    # The openai package sees the error event as an error, never a stream that ended well; no retry elsewhere.
    spare_backend = register(plane, spare.url, ["m"])
    for _ in range(40):  # until P2C picks the dropping one (each pick is a coin toss)
        before = len(spare.requests)
        stream = client(plane).chat.completions.create(model="m", messages=CHAT, stream=True)
        got: list[str] = []
        try:
            got.extend(c.choices[0].delta.content or "" for c in stream)
        except openai.APIError as exc:
            assert "failed mid-answer" in exc.message
            assert got == ["t0 ", "t1 "] and len(spare.requests) == before  # not retried once bytes went out
            break
        assert got == ["t0 ", "t1 ", "t2 "]
    else:
        pytest.fail("the dropping backend was never picked")
    assert gateway_row(plane, backend)["errors"] >= 2 and gateway_row(plane, spare_backend)["errors"] == 0


def test_no_chunk_within_the_timeout_mid_stream_is_a_failure_too(clean: Plane, scripted: list[Scripted]) -> None:
    plane = clean
    server = serve(scripted, ["m"], mode="stall", delay_s=3.0)
    backend = register(plane, server.url, ["m"], timeout_ms=300)
    began = time.monotonic()
    response = post(plane, "completions", {"model": "m", "prompt": "x", "stream": True})
    took = time.monotonic() - began
    assert response.status_code == 200 and b"[DONE]" not in response.content
    events = events_of(response.content)
    assert orjson.loads(events[0][6:])["choices"][0]["text"] == "t0 "
    error = orjson.loads(events[-1][6:])["error"]
    assert error["code"] == "backend_failed" and "no chunk within 300 ms" in error["message"]
    assert took < server.delay_s  # cut at the backend's timeout, not after the stall
    assert gateway_row(plane, backend)["errors"] == 1


def test_a_failure_before_the_first_byte_is_retried_on_another_backend(clean: Plane, scripted: list[Scripted]) -> None:
    plane = clean
    failing = serve(scripted, ["m"], mode="status", status=503)
    good = serve(scripted, ["m"])
    bad = register(plane, failing.url, ["m"])
    fine = register(plane, good.url, ["m"])
    answers = []
    for _ in range(40):
        raw = client(plane).completions.with_raw_response.create(model="m", prompt="x")
        answers.append((raw.headers["spillway-backend"], raw.headers["spillway-attempts"], raw.parse()))
        if failing.requests:
            break
    assert failing.requests, "the failing backend was never picked"
    assert all(name == fine["name"] for name, _, _ in answers)
    assert answers[-1][1] == "2" and answers[-1][2].choices[0].text == "t0 t1 t2 "
    assert gateway_row(plane, bad)["errors"] == 1
    # Headers alone are not the first byte: a backend that sends them and then nothing is retried elsewhere too.
    failing.mode, failing.delay_s = "slow_body", 3.0
    bad_again = plane.client.patch(f"{plane.url}/api/v1/backends/{bad['id']}", json={"timeout_ms": 300},
                                   headers=plane.operator)  # fmt: skip
    assert bad_again.status_code == 200
    for _ in range(40):
        before = len(failing.requests)
        response = post(
            plane, "completions", {"model": "m", "prompt": "x", "stream": True}, **{"spillway-timeout-us": "5000000"}
        )  # not the first backend's 300 ms for all attempts
        assert response.status_code == 200 and response.content.endswith(b"data: [DONE]\n\n")
        assert response.headers["spillway-backend"] == fine["name"]
        if len(failing.requests) > before:
            assert response.headers["spillway-attempts"] == "2"
            break
    else:
        pytest.fail("the slow backend was never picked")


def test_a_slow_first_byte_is_bounded_by_the_deadline(clean: Plane, scripted: list[Scripted]) -> None:
    plane = clean
    slow = serve(scripted, ["m"], mode="slow_head", delay_s=3.0)
    backend = register(plane, slow.url, ["m"])
    began = time.monotonic()
    response = post(plane, "chat/completions", {"model": "m", "messages": CHAT}, **{"spillway-timeout-us": "300000"})
    took = time.monotonic() - began
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert response.headers["spillway-reason"] == "deadline_exceeded"
    assert took < slow.delay_s
    assert 0 < int(slow.requests[-1]["headers"]["Spillway-Timeout-Us"]) <= 300_000  # passed on, less a margin
    assert gateway_row(plane, backend)["errors"] == 1
    with pytest.raises(openai.APIStatusError) as raised:
        client(plane, **{"spillway-timeout-us": "200000"}).chat.completions.create(model="m", messages=CHAT)
    assert raised.value.status_code == 504


def test_bad_requests_are_refused_in_openais_shape(clean: Plane, scripted: list[Scripted]) -> None:
    plane = clean
    server = serve(scripted, ["m"])
    register(plane, server.url, ["m"])
    plane.register("http://127.0.0.1:9", models=["mlp"])  # a V2 backend: never an openai request's
    url = f"{plane.url}/v1/chat/completions"
    cases = [
        (plane.client.post(url, json={"model": "m", "messages": CHAT}), 401, "unauthenticated", None),
        (plane.client.post(url, json={"model": "m"}, headers=plane.operator), 403, "forbidden", None),
        (plane.client.post(url, content=b"{", headers=plane.agent), 400, "invalid_request", None),
        (plane.client.post(url, content=b"[1]", headers=plane.agent), 400, "invalid_request", None),
        (post(plane, "chat/completions", {"messages": CHAT}), 400, "invalid_request", "model"),
        (post(plane, "chat/completions", {"model": 5}), 400, "invalid_request", "model"),
        (post(plane, "chat/completions", {"model": "has space"}), 400, "invalid_model_name", "model"),
        (post(plane, "completions", {"model": "mlp", "prompt": "x"}), 503, "no_backend", None),
        (post(plane, "completions", {"model": "m"}, **{"spillway-timeout-us": "soon"}), 400, "invalid_request", None),
    ]
    for response, status, code, param in cases:
        assert response.status_code == status, (code, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["code"], error["param"]) == (code, param), error
        assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error" if status == 400
                                 else {401: "authentication_error", 403: "permission_error"}[status])  # fmt: skip
        assert response.headers["spillway-reason"] == code
    assert not server.requests
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{plane.url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="m", prompt="x"
        )


def test_a_client_that_leaves_mid_stream_frees_the_backend(clean: Plane, scripted: list[Scripted]) -> None:
    """The gateway stops relaying (and reading from the backend) when its client disconnects; not a failure."""
    plane = clean
    server = serve(scripted, ["m"], mode="hold", chunks=3)
    backend = register(plane, server.url, ["m"])
    with (
        httpx.Client(timeout=30) as once,
        once.stream(
            "POST",
            f"{plane.url}/v1/completions",
            headers=plane.agent,
            json={"model": "m", "prompt": "x", "stream": True},
        ) as answer,
    ):
        chunks = answer.iter_raw()  # kept: a generator dropped closes the connection
        assert next(chunks).startswith(b"data: ")
        assert gateway_row(plane, backend)["outstanding"] == 1
    # The connection is closed here, the backend still holding its last chunk.
    wait_for(lambda: gateway_row(plane, backend)["outstanding"] == 0, timeout_s=8)
    assert not server.last_sent.is_set()
    row = gateway_row(plane, backend)
    assert (row["errors"], row["requests"]) == (0, 1)


@pytest.mark.parametrize(
    ("chunks", "relayed"),
    [
        ([b"data: a\n\n", b"data: b\n\n"], [b"data: a\n\n", b"data: b\n\n"]),
        ([b"data: a\n\ndata: b", b"b\n\n"], [b"data: a\n\n", b"data: bb\n\n"]),
        ([b"data: a\r\n\r\ndata: ", b"b\r\n\r\n"], [b"data: a\r\n\r\n", b"data: b\r\n\r\n"]),
        ([b"data: a\n", b"\n"], [b"", b"data: a\n\n"]),
    ],
)
def test_events_are_relayed_whole(chunks: list[bytes], relayed: list[bytes]) -> None:
    events = _Events()
    assert [events.whole(c) for c in chunks] == relayed and events.held == b""


def test_when_every_backend_fails_before_the_first_byte_the_answer_says_so(
    clean: Plane, scripted: list[Scripted]
) -> None:
    plane = clean
    servers = [serve(scripted, ["m"], mode="status", status=502) for _ in range(2)]
    for server in servers:
        register(plane, server.url, ["m"])
    response = post(plane, "chat/completions", {"model": "m", "messages": CHAT, "stream": True})
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("backend_failed", "server_error")
    assert "2 attempts failed" in error["message"] and "answered 502" in error["message"]
    assert response.headers["spillway-reason"] == "backend_unavailable"
    assert response.headers["spillway-attempts"] == "2"
    assert [len(s.requests) for s in servers] == [1, 1]  # each tried once


def test_when_every_backend_is_busy_the_answer_is_no_capacity_not_a_failure(
    clean: Plane, scripted: list[Scripted]
) -> None:
    """A 503 with Retry-After is a busy cloud, not a broken one: the agent's breaker must not count it (BUSY)."""
    plane = clean
    # A cloud agent's 503 with Retry-After, and TGI's 429 at its max_concurrent_requests.
    servers = [serve(scripted, ["m"], mode="busy", status=503), serve(scripted, ["m"], mode="status", status=429)]
    backends = [register(plane, server.url, ["m"]) for server in servers]
    response = post(plane, "chat/completions", {"model": "m", "messages": CHAT, "stream": True})
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "no_capacity" == response.headers["spillway-reason"]
    assert "retry-after" in response.headers
    assert [len(s.requests) for s in servers] == [1, 1]
    assert [gateway_row(plane, backend)["errors"] for backend in backends] == [0, 0]  # busy is not a failure


def test_an_empty_success_is_no_answer_and_is_tried_elsewhere(clean: Plane, scripted: list[Scripted]) -> None:
    plane = clean
    empty, good = serve(scripted, ["m"], mode="empty"), serve(scripted, ["m"])
    bad, _ = register(plane, empty.url, ["m"]), register(plane, good.url, ["m"])
    for _ in range(40):
        raw = client(plane).completions.with_raw_response.create(model="m", prompt="x")
        assert raw.parse().choices[0].text == "t0 t1 t2 "  # never the empty one
        if empty.requests:
            break
    assert empty.requests, "the empty backend was never picked"
    assert gateway_row(plane, bad)["errors"] == 1


# ---- a third-party OpenAI-compatible server: llama-cpp-python's -------------------------------------------------

LLAMA_CPP_PYTHON = os.environ.get("SPILLWAY_LLAMA_CPP_PYTHON")
"""A Python with `llama-cpp-python[server]` and `gguf` (PyPI has no wheel of the former: its sdist builds with gcc
and cmake in about 10 CPU minutes); the test is skipped without it."""

TINY_GGUF = """
import sys
import numpy as np
import gguf

n_embd, n_ff, n_layer, n_head = 64, 128, 2, 4
tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
w = gguf.GGUFWriter(sys.argv[1], "llama")
w.add_context_length(512)
w.add_embedding_length(n_embd)
w.add_block_count(n_layer)
w.add_feed_forward_length(n_ff)
w.add_head_count(n_head)
w.add_head_count_kv(n_head)
w.add_rope_dimension_count(n_embd // n_head)
w.add_layer_norm_rms_eps(1e-5)
w.add_file_type(gguf.LlamaFileType.ALL_F32)
w.add_tokenizer_model("llama")
w.add_token_list(tokens)
w.add_token_scores([0.0] * len(tokens))
w.add_token_types(types)
w.add_bos_token_id(1)
w.add_eos_token_id(2)
w.add_chat_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}assistant:")
rng = np.random.default_rng(0)
def add(name, *shape):
    w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
add("token_embd.weight", len(tokens), n_embd)
add("output.weight", len(tokens), n_embd)
w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
for i in range(n_layer):
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        add(f"blk.{i}.{name}.weight", n_embd, n_embd)
    add(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
    add(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
    add(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
"""


@pytest.mark.skipif(LLAMA_CPP_PYTHON is None, reason="SPILLWAY_LLAMA_CPP_PYTHON: no llama-cpp-python[server]")
def test_llama_cpps_server_answers_through_the_gateway(clean: Plane, tmp_path: Path) -> None:
    """llama.cpp's OpenAI-compatible server (through llama-cpp-python) on a tiny random GGUF written by `gguf`: its
    readiness, a whole completion and a chat stream, through the gateway with the `openai` package."""
    assert LLAMA_CPP_PYTHON is not None
    plane = clean
    model = tmp_path / "tiny.gguf"
    subprocess.run([LLAMA_CPP_PYTHON, "-c", TINY_GGUF, str(model)], check=True, timeout=120)
    port = free_port()
    command = [LLAMA_CPP_PYTHON, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", "tiny-random",
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "512"]  # fmt: skip
    server = Process.start(command, name="llama.cpp server")
    try:
        server.wait_ready(f"http://127.0.0.1:{port}/v1/models", timeout_s=120, interval_s=0.2)
        backend = register(plane, f"http://127.0.0.1:{port}", ["tiny-lm"], model_map={"tiny-lm": "tiny-random"},
                           auth_header=None, timeout_ms=30_000)  # fmt: skip
        row = ready(plane, backend)
        assert row["healthy"], row
        whole = client(plane).completions.create(model="tiny-lm", prompt="Hello", max_tokens=8, temperature=0)
        assert whole.model == "tiny-random" and whole.usage is not None and whole.usage.completion_tokens == 8
        with client(plane).chat.completions.with_streaming_response.create(
            model="tiny-lm", messages=CHAT, max_tokens=8, temperature=0, stream=True
        ) as streamed:
            assert streamed.headers["spillway-backend"] == backend["name"]
            chunks = list(streamed.parse())
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert gateway_row(plane, backend)["errors"] == 0
    finally:
        server.stop()
