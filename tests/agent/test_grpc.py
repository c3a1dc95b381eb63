"""The real Triton client (tritonclient.grpc) against the agent's V2 gRPC endpoint: the compatibility test of
tritonclient.http (test_compatibility.py) again, outputs checked against a direct onnxruntime run, then what only gRPC
has (typed contents, metadata auth, deadlines, trailing metadata, the decoupled generate stream)."""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton
import yaml
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from edge_agent.serving.grpc_server import GrpcEndpoint
from spillway.contract.grpc_codec import infer_request_to_v2, raw_tensor, v2_response_to_infer
from spillway.contract.v2 import TensorError, decode_request
from spillway.demo.tiny_lm import TINY_LM
from tests.agent.conftest import RunningAgent, start_agent, stop_agent

WAIT_S = 60  # the most any answer in this module may take


@pytest.fixture(scope="module")
def client(agent: RunningAgent) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=agent.grpc)


@pytest.fixture(scope="module")
def stub(agent: RunningAgent) -> Iterator[Any]:
    """The generated stub itself, for what tritonclient does not expose (typed contents, trailing metadata)."""
    with grpc.insecure_channel(agent.grpc) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _onnxruntime(repo: Path, version: str, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(repo / "mlp" / version / "model.onnx"), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"input": x})[0])


def _input(x: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


# ---- the compatibility test of tritonclient.http, over gRPC ----------------------------------------------------------


def test_server_and_model_calls(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live(client_timeout=WAIT_S) and client.is_server_ready(client_timeout=WAIT_S)
    assert client.is_model_ready("mlp", client_timeout=WAIT_S) and client.is_model_ready(
        "mlp", "1", client_timeout=WAIT_S
    )
    assert not client.is_model_ready("nope", client_timeout=WAIT_S)
    meta = client.get_model_metadata("mlp", "2", as_json=True, client_timeout=WAIT_S)
    assert meta["inputs"][0]["name"] == "input" and meta["outputs"][0]["shape"] == ["-1", "1000"]
    assert client.get_server_metadata(client_timeout=WAIT_S).name == "spillway-edge-agent"
    with pytest.raises(InferenceServerException, match="unknown model") as err:
        client.get_model_metadata("nope", client_timeout=WAIT_S)
    assert err.value.status() == "StatusCode.NOT_FOUND"


def test_a_generative_model_is_ready_with_triton_s_generate_metadata(
    agent: RunningAgent, client: triton.InferenceServerClient
) -> None:
    """As the repository index says READY: ready, and the decoupled LLM shape of Triton's vLLM backend."""
    assert client.is_model_ready(TINY_LM, client_timeout=WAIT_S)
    assert not client.is_model_ready(TINY_LM, "99", client_timeout=WAIT_S)
    meta = client.get_model_metadata(TINY_LM, as_json=True, client_timeout=WAIT_S)
    config = client.get_model_config(TINY_LM, as_json=True, client_timeout=WAIT_S)["config"]
    assert meta["platform"] == config["platform"] and meta["versions"] == [config["version_policy"]["specific"]
                                                                              ["versions"][0]]  # fmt: skip
    assert meta["inputs"][0] == {"name": "text_input", "datatype": "BYTES", "shape": ["1"]}
    assert {i["name"] for i in meta["inputs"]} >= {"stream", "sampling_parameters"}
    assert meta["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": ["1"]}]
    http = httpx.get(f"{agent.url}/v2/models/{TINY_LM}", timeout=WAIT_S)
    assert http.status_code == 200 and http.json()["inputs"][0]["name"] == "text_input"
    ready = httpx.get(f"{agent.url}/v2/models/{TINY_LM}/ready", timeout=WAIT_S)
    assert ready.status_code == 200 and ready.json() == {"name": TINY_LM, "ready": True}


@pytest.mark.parametrize("version", ["1", "2"])
def test_infer_matches_onnxruntime(client: triton.InferenceServerClient, demo_repo: Path, version: str) -> None:
    x = np.random.default_rng(int(version)).standard_normal((4, 512), dtype=np.float32)
    result = client.infer("mlp", [_input(x)], model_version=version, outputs=[triton.InferRequestedOutput("output")],
                          request_id="g1", priority=1, timeout=10_000_000, client_timeout=WAIT_S)  # fmt: skip
    got = result.as_numpy("output")
    assert got is not None and got.dtype == np.float32 and got.shape == (4, 1000)
    np.testing.assert_array_equal(got, _onnxruntime(demo_repo, version, x))
    response = result.get_response()
    assert response.id == "g1" and response.model_version == version
    assert response.parameters["spillway_outcome"].string_param == "local"


def test_bad_input_is_invalid_argument_naming_the_input(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="input") as err:
        client.infer("mlp", [_input(np.zeros((1, 500), np.float32))], client_timeout=WAIT_S)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_statistics_in_triton_shape(client: triton.InferenceServerClient) -> None:
    def successes() -> int:
        stats = client.get_inference_statistics("mlp", "2", client_timeout=WAIT_S).model_stats[0]
        assert stats.name == "mlp" and stats.version == "2"
        return int(stats.inference_stats.success.count)

    before = successes()
    client.infer("mlp", [_input(np.ones((2, 512), np.float32))], model_version="2", client_timeout=WAIT_S)
    assert successes() == before + 1
    stats = client.get_inference_statistics("mlp", "2", as_json=True, client_timeout=WAIT_S)["model_stats"][0]
    assert {"batch_size", "compute_infer"} <= set(stats["batch_stats"][0])


def test_async_infer(client: triton.InferenceServerClient, demo_repo: Path) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    x = np.random.default_rng(7).standard_normal((3, 512), dtype=np.float32)
    client.async_infer("mlp", [_input(x)], lambda result, error: answers.put((result, error)), model_version="2",
                       client_timeout=WAIT_S)  # fmt: skip
    result, error = answers.get(timeout=WAIT_S)
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("output"), _onnxruntime(demo_repo, "2", x))


# ---- what only gRPC has ---------------------------------------------------------------------------------------------


def _typed_request(x: np.ndarray, version: str = "2") -> Any:
    request = service_pb2.ModelInferRequest(model_name="mlp", model_version=version, id="typed")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    return request


def test_typed_contents_infer_and_the_outcome_in_trailing_metadata(stub: Any, demo_repo: Path) -> None:
    x = np.random.default_rng(3).standard_normal((2, 512), dtype=np.float32)
    response, call = stub.ModelInfer.with_call(_typed_request(x), timeout=WAIT_S)
    got = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(list(response.outputs[0].shape))
    np.testing.assert_array_equal(got, _onnxruntime(demo_repo, "2", x))
    assert response.id == "typed"
    assert dict(call.trailing_metadata())["spillway-outcome"] == "local"

    unknown = _typed_request(x)
    unknown.model_name = "nope"
    del unknown.inputs[0].contents.fp32_contents[-1]  # the model is looked up first, as over HTTP
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(unknown, timeout=WAIT_S)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    trailing = dict(err.value.trailing_metadata())
    assert trailing["spillway-outcome"] == "rejected" and trailing["spillway-reason"] == "unknown_model"


def test_contents_the_codec_refuses_are_counted_as_http_counts_a_bad_request(agent: RunningAgent, stub: Any) -> None:
    def refused() -> int:
        found = [o["count"] for o in agent.stats("2")["outcomes"] if (o["priority"], o["outcome"]) == (0, "rejected")]
        return sum(found)

    before = refused()
    short = _typed_request(np.ones((2, 512), np.float32))
    del short.inputs[0].contents.fp32_contents[-1]  # one value short of its shape
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(short, timeout=WAIT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "input 'input': fp32_contents holds 1023 values but shape [2, 512] needs 1024"
    trailing = dict(err.value.trailing_metadata())
    assert (trailing["spillway-outcome"], trailing["spillway-reason"]) == ("rejected", "invalid_request")
    assert refused() == before + 1
    http = httpx.post(f"{agent.url}/v2/models/mlp/versions/2/infer", content=b"{", timeout=WAIT_S)
    assert http.status_code == 400 and refused() == before + 2  # the same count, over HTTP


def test_a_request_just_over_the_body_limit_meets_the_agent_s_refusal_and_far_over_grpc_s(stub: Any) -> None:
    """The agent's max_body_bytes is 8 MiB here: a message a little over it reaches the app, which refuses it with its
    outcome (as over HTTP); one far over it is refused by gRPC itself."""

    def request(size: int) -> Any:
        message = service_pb2.ModelInferRequest(model_name="mlp", model_version="2")
        message.inputs.add(name="input", datatype="FP32", shape=[size // 2048, 512])
        message.raw_input_contents.append(bytes(size))
        return message

    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request((8 << 20) + 2048), timeout=WAIT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    trailing = dict(err.value.trailing_metadata())
    assert (trailing["spillway-outcome"], trailing["spillway-reason"]) == ("rejected", "payload_too_large")
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request(9 << 20), timeout=WAIT_S)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_deadline_the_model_cannot_meet_is_refused_with_its_outcome(stub: Any) -> None:
    """A budget of 1 us (`spillway-timeout-us`, the header HTTP reads; the RPC's own deadline is generous): no batch can
    be done in time, so the request is refused, UNAVAILABLE with its outcome, rather than computed for nobody: on
    arrival (`deadline_unmeetable`), or, when the scheduler lets one through to check its estimate on an idle model,
    once its deadline has passed in the queue (`timeout`)."""
    request = _typed_request(np.ones((64, 512), np.float32), version="1")
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request, metadata=[("spillway-timeout-us", "1")], timeout=WAIT_S)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    trailing = dict(err.value.trailing_metadata())
    assert trailing["spillway-outcome"] == "rejected" and "retry-after" in trailing
    assert trailing["spillway-reason"] in ("deadline_unmeetable", "timeout")
    # A budget it can meet: served.
    response = stub.ModelInfer(_typed_request(np.ones((1, 512), np.float32)), timeout=WAIT_S)
    assert list(response.outputs[0].shape) == [1, 1000]


class _ScriptedApp:
    """An ASGI app that records each request's headers and gives the answer it is told (a hand-written fake, to reach
    answers the real agent gives only under load or failure)."""

    openai = None

    def __init__(self, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.body, self.headers = status, json.dumps(body).encode(), headers
        self.seen: list[dict[bytes, bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen.append(dict(scope["headers"]))
        await receive()
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def _against(app: _ScriptedApp, *calls: Callable[[Any], Any]) -> list[Any]:
    """Each of `calls` (given the stub) against a gRPC endpoint in front of `app`; what each returned or raised."""

    async def scenario() -> list[Any]:
        endpoint = GrpcEndpoint(app, max_body_bytes=1 << 20)  # type: ignore[arg-type]
        port = endpoint.bind("127.0.0.1", 0)
        await endpoint.start()

        def run() -> list[Any]:
            found: list[Any] = []
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                for call in calls:
                    try:
                        found.append(call(stub))
                    except grpc.RpcError as exc:
                        found.append(exc)
            return found

        try:
            return await asyncio.to_thread(run)
        finally:
            await endpoint.stop(None)

    return asyncio.run(asyncio.wait_for(scenario(), WAIT_S))


def _tiny_request() -> Any:
    request = service_pb2.ModelInferRequest(model_name="m", id="r")
    request.inputs.add(name="x", datatype="INT32", shape=[1]).contents.int_contents.append(7)
    return request


def test_the_deadline_reaches_the_app_as_its_budget() -> None:
    """The RPC's time remaining arrives as `spillway-timeout-us`, the header the HTTP path reads for its budget."""
    app = _ScriptedApp(200, {"model_name": "m", "model_version": "1", "outputs": []}, [])
    # The second call has no deadline (so no budget); its wait is bounded all the same.
    _against(app, lambda stub: stub.ModelInfer(_tiny_request(), timeout=20),
             lambda stub: stub.ModelInfer.future(_tiny_request(), metadata=[("authorization", "Bearer t")]
                                                 ).result(timeout=WAIT_S))  # fmt: skip
    assert 0 < int(app.seen[0][b"spillway-timeout-us"]) <= 20_000_000
    assert b"spillway-timeout-us" not in app.seen[1] and app.seen[1][b"authorization"] == b"Bearer t"


def test_an_async_job_accepted_is_a_response_without_outputs_saying_so() -> None:
    job = {"id": "j1", "status": "queued", "model_name": "m", "outcome": "queued_async",
           "location": "/spillway/v1/jobs/j1",
           "parameters": {"spillway_outcome": "queued_async", "spillway_reason": "no_gateway"}}  # fmt: skip
    headers = [(b"spillway-outcome", b"queued_async"), (b"spillway-reason", b"no_gateway"), (b"spillway-job-id", b"j1")]
    ((response, call),) = _against(_ScriptedApp(202, job, headers),
                                   lambda s: s.ModelInfer.with_call(_tiny_request(), timeout=WAIT_S))  # fmt: skip
    assert not response.outputs and response.id == "r"
    said = {k: v.string_param for k, v in response.parameters.items()}
    assert said == {"spillway_outcome": "queued_async", "spillway_reason": "no_gateway", "spillway_job_id": "j1",
                    "spillway_job_location": "/spillway/v1/jobs/j1"}  # fmt: skip
    assert dict(call.trailing_metadata())["spillway-job-id"] == "j1"


@pytest.mark.parametrize(
    ("status", "code"),
    [(429, grpc.StatusCode.RESOURCE_EXHAUSTED), (503, grpc.StatusCode.UNAVAILABLE), (500, grpc.StatusCode.INTERNAL)],
)
def test_a_refusal_is_its_status_code_with_the_error_text_and_why_in_trailing_metadata(
    status: int, code: grpc.StatusCode
) -> None:
    body = {"error": "priority 2 queue is full", "reason": "queue_full", "outcome": "rejected"}
    headers = [(b"spillway-outcome", b"rejected"), (b"spillway-reason", b"queue_full"), (b"retry-after", b"3")]
    (error,) = _against(
        _ScriptedApp(status, body, headers), lambda stub: stub.ModelInfer(_tiny_request(), timeout=WAIT_S)
    )
    assert error.code() == code and error.details() == "priority 2 queue is full"
    trailing = dict(error.trailing_metadata())
    assert (trailing["spillway-reason"], trailing["retry-after"]) == ("queue_full", "3")


class _HeldApp(_ScriptedApp):
    """A scripted app that holds every infer call until `release` is set."""

    def __init__(self) -> None:
        super().__init__(200, {"model_name": "m", "model_version": "1", "outputs": []}, [])
        self.release = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen.append(dict(scope["headers"]))
        await self.release.wait()
        await super().__call__(scope, receive, send)
        self.seen.pop()  # counted once, above


def test_a_stream_holds_a_bounded_number_of_requests_and_answers_each_one_read_when_the_agent_drains() -> None:
    """Three requests on a stream that takes two at a time: the third waits, unread by the app. The agent drains: the
    waiting one is answered "the agent is shutting down", the two in flight are answered, and the stream, which the
    client has not closed, ends UNAVAILABLE (it would read nothing more)."""
    app = _HeldApp()
    client_done = threading.Event()

    def requests() -> Iterator[Any]:
        for ident in ("a", "b", "c"):
            request = _tiny_request()
            request.id = ident
            yield request
        client_done.wait(WAIT_S)  # the client keeps its side open

    def run(port: int) -> tuple[list[tuple[str, str]], Any]:
        answers: list[tuple[str, str]] = []
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            try:
                for response in stub.ModelStreamInfer(requests(), timeout=WAIT_S):
                    answers.append((response.infer_response.id, response.error_message))
            except grpc.RpcError as exc:
                return answers, exc.code()
            finally:
                client_done.set()
        return answers, grpc.StatusCode.OK

    async def scenario() -> tuple[int, list[tuple[str, str]], Any]:
        endpoint = GrpcEndpoint(app, max_body_bytes=1 << 20, stream_limit=2)  # type: ignore[arg-type]
        port = endpoint.bind("127.0.0.1", 0)
        await endpoint.start()
        client = asyncio.ensure_future(asyncio.to_thread(run, port))
        try:
            assert endpoint.servicer is not None
            for _ in range(WAIT_S * 100):  # until the third request waits for room (bounded: 10 ms a look)
                if any(stream.waiting is not None for stream in endpoint.servicer.streams):
                    break
                await asyncio.sleep(0.01)
            held = len(app.seen)
            stopping = asyncio.ensure_future(endpoint.stop(WAIT_S))
            await asyncio.sleep(0)  # the stop has begun: the streams are closing
            app.release.set()
            await stopping
            answers, code = await client
            return held, answers, code
        finally:
            client_done.set()
            await endpoint.stop(None)

    held, answers, code = asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    assert held == 2
    assert sorted(answers) == [("a", ""), ("b", ""), ("c", "the agent is shutting down")]
    assert code == grpc.StatusCode.UNAVAILABLE


def test_config_and_repository_index(client: triton.InferenceServerClient) -> None:
    config = client.get_model_config("mlp", client_timeout=WAIT_S).config
    assert config.name == "mlp" and config.max_batch_size == 64
    assert [i.name for i in config.input] == ["input"] and list(config.output[0].dims) == [1000]
    index = client.get_model_repository_index(client_timeout=WAIT_S)
    found = {(m.name, m.version): m.state for m in index.models}
    assert found[("mlp", "1")] == "READY" and found[("mlp", "2")] == "READY"


def test_unimplemented_extensions_say_so(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="shared memory") as err:
        client.get_system_shared_memory_status(client_timeout=WAIT_S)
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"


# ---- ModelStreamInfer -----------------------------------------------------------------------------------------------


def _text_input(text: str) -> triton.InferInput:
    tensor = triton.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    return tensor


def _scalar(name: str, value: Any, datatype: str) -> triton.InferInput:
    array = np.array([value], dtype=np.int32 if datatype == "INT32" else np.bool_)
    tensor = triton.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _stream(client: triton.InferenceServerClient, requests: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Send `requests` on one stream; every response by request id, until each request has its last one."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)), stream_timeout=WAIT_S)
    try:
        for request in requests:
            client.async_stream_infer(**request)
        found: dict[str, list[Any]] = {r["request_id"]: [] for r in requests}
        open_ = set(found)
        while open_:
            result, error = answers.get(timeout=WAIT_S)
            assert error is None, error
            response = result.get_response()
            found[response.id].append(response)
            if response.parameters["triton_final_response"].bool_param:
                open_.discard(response.id)
        return found
    finally:
        client.stop_stream()


def _text(responses: list[Any]) -> str:
    return "".join(
        r.raw_output_contents[0][4:].decode() for r in responses if r.outputs and r.outputs[0].name == "text_output"
    )


def test_model_stream_infer_generates_as_the_http_generate_does(
    agent: RunningAgent, client: triton.InferenceServerClient
) -> None:
    body = {"text_input": "Once upon a time", "parameters": {"max_tokens": 8, "temperature": 0}}
    http = httpx.post(f"{agent.url}/v2/models/{TINY_LM}/generate", json=body, timeout=WAIT_S)
    assert http.status_code == 200, http.text
    x = np.ones((1, 512), np.float32)
    found = _stream(client, [
        # As Triton's generate clients send it: the sampling settings as request parameters...
        {"model_name": TINY_LM, "inputs": [_text_input("Once upon a time")], "request_id": "a",
         "parameters": {"max_tokens": 8, "temperature": 0}},
        # ... or as the inputs of Triton's LLM backends.
        {"model_name": TINY_LM, "inputs": [_text_input("Once upon a time"), _scalar("max_tokens", 8, "INT32"),
                                           _scalar("stream", True, "BOOL")], "request_id": "b",
         "parameters": {"temperature": 0}},
        {"model_name": "mlp", "model_version": "2", "inputs": [_input(x)], "request_id": "c"},
    ])  # fmt: skip
    for ident in ("a", "b"):
        responses = found[ident]
        assert len(responses) > 1  # token by token
        assert [r.parameters["triton_final_response"].bool_param for r in responses] == [False] * (
            len(responses) - 1
        ) + [True]
        assert _text(responses) == http.json()["text_output"]
        last = responses[-1].parameters
        assert last["spillway_outcome"].string_param == "local"
        assert last["finish_reason"].string_param in ("length", "stop")
    (answer,) = found["c"]
    assert list(answer.outputs[0].shape) == [1, 1000] and answer.parameters["spillway_outcome"].string_param == "local"


def test_a_refused_stream_request_is_an_error_message_and_the_stream_goes_on(
    client: triton.InferenceServerClient,
) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)), stream_timeout=WAIT_S)
    try:
        client.async_stream_infer(TINY_LM, [_text_input("")], request_id="empty")
        result, error = answers.get(timeout=WAIT_S)
        assert result is None and "text_input" in str(error)
        client.async_stream_infer(TINY_LM, [_text_input("Hello")], request_id="next",
                                  parameters={"max_tokens": 2, "temperature": 0})  # fmt: skip
        while True:
            result, error = answers.get(timeout=WAIT_S)
            assert error is None
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()


# ---- authentication, start errors ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_agent(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningAgent]:
    running = start_agent(demo_repo, tmp_path_factory.mktemp("agent"), intra_op_threads=1, token="s3cret",
                          host="127.0.0.1")  # fmt: skip
    yield running
    stop_agent(running)


def test_the_token_travels_in_authorization_metadata(token_agent: RunningAgent) -> None:
    client = triton.InferenceServerClient(url=token_agent.grpc)
    assert client.is_server_live(client_timeout=WAIT_S)  # unauthenticated, as over HTTP
    x = np.ones((1, 512), np.float32)
    for headers in ({}, {"authorization": "Bearer wrong"}):
        with pytest.raises(InferenceServerException, match="bearer token") as err:
            client.infer("mlp", [_input(x)], headers=headers, client_timeout=WAIT_S)
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("mlp", client_timeout=WAIT_S)
    assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    short = _typed_request(x)
    del short.inputs[0].contents.fp32_contents[-1]  # the token is checked first, as over HTTP
    with grpc.insecure_channel(token_agent.grpc) as channel, pytest.raises(grpc.RpcError) as refused:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(short, timeout=WAIT_S)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = {"authorization": "Bearer s3cret"}
    result = client.infer("mlp", [_input(x)], headers=good, client_timeout=WAIT_S)
    assert result.as_numpy("output").shape == (1, 1000)
    assert client.is_server_ready(headers=good, client_timeout=WAIT_S)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)),
                        stream_timeout=WAIT_S)  # no token on this stream  # fmt: skip
    try:
        client.async_stream_infer("mlp", [_input(x)], request_id="s")
        result, error = answers.get(timeout=WAIT_S)
        assert result is None and "bearer token" in str(error)
    finally:
        client.stop_stream()


def test_a_busy_grpc_port_named_in_the_config_is_a_start_error(demo_repo: Path, tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        config = tmp_path / "agent.yaml"
        config.write_text(yaml.safe_dump({"model_repository": str(demo_repo), "port": 0, "grpc_port": busy,
                                          "state_dir": str(tmp_path / "state"), "intra_op_threads": 1}))  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "spillway.cli", "agent", "serve", "--config", str(config)],
                              capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"grpc_port: port {busy} on 127.0.0.1 is busy" in done.stderr
    assert "Traceback" not in done.stderr
    assert "loaded mlp" not in done.stderr  # said before any model is loaded and warmed up


def _until_the_stream_ends(answers: queue.Queue[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """A stream's callbacks until the RPC itself ends (an error with a gRPC status, not one request's error)."""
    found: list[tuple[Any, Any]] = []
    while not found or found[-1][1] is None or found[-1][1].status() is None:
        found.append(answers.get(timeout=WAIT_S))
    return found


def test_sigterm_lets_a_stream_finish_answers_each_request_and_ends_open_streams_unavailable(
    demo_repo: Path, tmp_path: Path
) -> None:
    """The drain: a generation in flight on a stream gets all its tokens and its last response; a request sent once the
    drain has begun is answered "the agent is shutting down"; a stream the client keeps open then ends UNAVAILABLE
    (never a silent OK: the agent reads nothing more), an idle one as soon as the drain reaches the streams, so the
    agent exits long before its drain timeout (120 s here)."""
    running = start_agent(demo_repo, tmp_path, intra_op_threads=1, drain_timeout_s=120)
    busy, idle = triton.InferenceServerClient(running.grpc), triton.InferenceServerClient(running.grpc)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    idle_answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    try:
        idle.start_stream(callback=lambda result, error: idle_answers.put((result, error)), stream_timeout=WAIT_S)
        idle.async_stream_infer(TINY_LM, [_text_input("Hi")], request_id="i", parameters={"max_tokens": 1})
        assert idle_answers.get(timeout=WAIT_S)[1] is None  # answered: nothing in flight on it now
        busy.start_stream(callback=lambda result, error: answers.put((result, error)), stream_timeout=WAIT_S)
        busy.async_stream_infer(TINY_LM, [_text_input("Once")], request_id="long",
                                parameters={"max_tokens": 500, "ignore_eos": True, "temperature": 0})  # fmt: skip
        first = answers.get(timeout=WAIT_S)
        running.proc.terminate()
        for _ in range(WAIT_S * 100):  # until the drain has begun (bounded: 10 ms a look)
            if httpx.get(f"{running.url}/v2/health/ready", timeout=WAIT_S).status_code == 503:
                break
            time.sleep(0.01)
        for client in (busy, idle):
            client.async_stream_infer(TINY_LM, [_text_input("Late")], request_id="late", parameters={"max_tokens": 1})
        busy_seen = [first, *_until_the_stream_ends(answers)]
        idle_seen = _until_the_stream_ends(idle_answers)
        assert running.proc.wait(timeout=60) == 0
    finally:
        if running.proc.poll() is None:
            running.proc.kill()
        busy.stop_stream(cancel_requests=True)
        idle.stop_stream(cancel_requests=True)
    for seen in (busy_seen, idle_seen):
        assert seen[-1][1].status() == "StatusCode.UNAVAILABLE" and "shutting down" in seen[-1][1].message()
        refused = [error for _, error in seen[:-1] if error is not None]
        assert len(refused) == 1 and "the agent is shutting down" in refused[0].message()  # the late request's
    tokens = [result.get_response() for result, _ in busy_seen if result is not None]
    assert [r.parameters["triton_final_response"].bool_param for r in tokens].count(True) == 1
    assert tokens[-1].parameters["triton_final_response"].bool_param
    assert tokens[-1].parameters["finish_reason"].string_param == "length" and len(_text(tokens)) > 0


# ---- the codec (spillway/contract/grpc_codec.py) --------------------------------------------------------------------


def test_the_codec_writes_raw_and_typed_contents_as_the_v2_decoder_reads_them() -> None:
    request = service_pb2.ModelInferRequest(model_name="m", id="q")
    words = np.array([b"a", b"", "é".encode(), b"\x00\xff"], dtype=np.object_)
    request.inputs.add(name="w", datatype="BYTES", shape=[2, 2]).contents.bytes_contents.extend(words.tolist())
    request.inputs.add(name="b", datatype="BOOL", shape=[3]).contents.bool_contents.extend([True, False, True])
    request.inputs.add(name="i", datatype="INT8", shape=[2]).contents.int_contents.extend([-128, 127])
    request.inputs.add(name="u", datatype="UINT64", shape=[1]).contents.uint64_contents.append((1 << 64) - 1)
    request.outputs.add(name="o")
    request.parameters["priority"].uint64_param = 2
    body, length = infer_request_to_v2(request)
    decoded = decode_request(body, length)
    arrays = {t.name: t.array for t in decoded.inputs}
    assert arrays["w"].reshape(-1).tolist() == words.tolist() and arrays["w"].shape == (2, 2)
    assert arrays["b"].tolist() == [True, False, True] and arrays["i"].tolist() == [-128, 127]
    assert arrays["u"].tolist() == [(1 << 64) - 1]
    assert decoded.id == "q" and decoded.parameters == {"priority": 2}
    assert decoded.outputs is not None and decoded.outputs[0].binary is True

    raw = service_pb2.ModelInferRequest(model_name="m")
    raw.inputs.add(name="w", datatype="BYTES", shape=[2])
    raw.raw_input_contents.append(raw_tensor(np.array([b"xy", b"z"], dtype=np.object_), "BYTES"))
    decoded = decode_request(*infer_request_to_v2(raw))
    assert decoded.inputs[0].array.tolist() == [b"xy", b"z"] and decoded.parameters == {"binary_data_output": True}


@pytest.mark.parametrize(
    ("datatype", "field", "values", "shape", "words"),
    [
        ("INT8", "int_contents", [300], [1], "300 in int_contents is out of range for INT8"),
        ("FP16", "fp32_contents", [1.0], [1], "FP16 has no typed contents field; send it in raw_input_contents"),
        ("FP32", "fp32_contents", [1.0, 2.0], [3], "fp32_contents holds 2 values but shape [3] needs 3"),
    ],
)
def test_the_codec_refuses_contents_that_do_not_fit_naming_the_input(
    datatype: str, field: str, values: list[Any], shape: list[int], words: str
) -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    getattr(request.inputs.add(name="t", datatype=datatype, shape=shape).contents, field).extend(values)
    with pytest.raises(TensorError) as err:
        infer_request_to_v2(request)
    assert str(err.value) == f"input 't': {words}"


def test_the_codec_reads_json_and_binary_v2_answers_into_raw_outputs() -> None:
    outputs = [{"name": "s", "datatype": "BYTES", "shape": [2], "data": ["hé", ""]},
               {"name": "f", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}]  # fmt: skip
    head = {"model_name": "m", "model_version": "3", "id": "q", "parameters": {"spillway_outcome": "overflow"},
            "outputs": outputs}  # fmt: skip
    header = json.dumps(head).encode()
    response = v2_response_to_infer(header + np.array([1.5, -2], "<f4").tobytes(), len(header))
    assert (response.model_name, response.model_version, response.id) == ("m", "3", "q")
    assert response.parameters["spillway_outcome"].string_param == "overflow"
    assert [o.name for o in response.outputs] == ["s", "f"] and list(response.outputs[1].shape) == [2]
    assert response.raw_output_contents[0] == raw_tensor(np.array(["hé".encode(), b""], dtype=np.object_), "BYTES")
    assert np.frombuffer(response.raw_output_contents[1], "<f4").tolist() == [1.5, -2.0]
    assert "binary_data_size" not in response.outputs[1].parameters
