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
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp") and client.is_model_ready("mlp", "1")
    assert not client.is_model_ready("nope")
    meta = client.get_model_metadata("mlp", "2", as_json=True)
    assert meta["inputs"][0]["name"] == "input" and meta["outputs"][0]["shape"] == ["-1", "1000"]
    assert client.get_server_metadata().name == "spillway-edge-agent"
    with pytest.raises(InferenceServerException, match="unknown model") as err:
        client.get_model_metadata("nope")
    assert err.value.status() == "StatusCode.NOT_FOUND"


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
        stats = client.get_inference_statistics("mlp", "2").model_stats[0]
        assert stats.name == "mlp" and stats.version == "2"
        return int(stats.inference_stats.success.count)

    before = successes()
    client.infer("mlp", [_input(np.ones((2, 512), np.float32))], model_version="2", client_timeout=WAIT_S)
    assert successes() == before + 1
    stats = client.get_inference_statistics("mlp", "2", as_json=True)["model_stats"][0]
    assert {"batch_size", "compute_infer"} <= set(stats["batch_stats"][0])


def test_async_infer(client: triton.InferenceServerClient, demo_repo: Path) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    x = np.random.default_rng(7).standard_normal((3, 512), dtype=np.float32)
    client.async_infer("mlp", [_input(x)], lambda result, error: answers.put((result, error)), model_version="2")
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

    short = _typed_request(x)
    del short.inputs[0].contents.fp32_contents[-1]  # one value short of its shape
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(short, timeout=WAIT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'input'" in err.value.details()
    assert dict(err.value.trailing_metadata())["spillway-reason"] == "invalid_request"

    unknown = _typed_request(x)
    unknown.model_name = "nope"
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(unknown, timeout=WAIT_S)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    trailing = dict(err.value.trailing_metadata())
    assert trailing["spillway-outcome"] == "rejected" and trailing["spillway-reason"] == "unknown_model"


def test_a_deadline_the_model_cannot_meet_is_refused_at_once(stub: Any) -> None:
    """The RPC's deadline is the request's: mlp v1 cannot answer 64 rows in 15 ms, so the agent refuses it on arrival
    (UNAVAILABLE, `deadline_unmeetable`) rather than compute it for nobody. The scheduler lets one request through
    now and then to check its estimate on an idle model; that one may miss the client's deadline."""
    request = _typed_request(np.ones((64, 512), np.float32), version="1")
    seen = []
    for _ in range(5):
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, timeout=0.015)
        seen.append(err.value.code())
        if err.value.code() == grpc.StatusCode.UNAVAILABLE:
            trailing = dict(err.value.trailing_metadata())
            assert trailing["spillway-reason"] == "deadline_unmeetable" and "retry-after" in trailing
            break
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert seen[-1] == grpc.StatusCode.UNAVAILABLE, seen
    # A deadline it can meet (within the model's own 100 ms default timeout): served.
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
        endpoint = GrpcEndpoint(app, max_receive_bytes=1 << 20)  # type: ignore[arg-type]
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
    _against(app, lambda stub: stub.ModelInfer(_tiny_request(), timeout=20),
             lambda stub: stub.ModelInfer(_tiny_request(), metadata=[("authorization", "Bearer t")]))  # fmt: skip
    assert 0 < int(app.seen[0][b"spillway-timeout-us"]) <= 20_000_000
    assert b"spillway-timeout-us" not in app.seen[1] and app.seen[1][b"authorization"] == b"Bearer t"


def test_an_async_job_accepted_is_a_response_without_outputs_saying_so() -> None:
    job = {"id": "j1", "status": "queued", "model_name": "m", "outcome": "queued_async",
           "location": "/spillway/v1/jobs/j1",
           "parameters": {"spillway_outcome": "queued_async", "spillway_reason": "no_gateway"}}  # fmt: skip
    headers = [(b"spillway-outcome", b"queued_async"), (b"spillway-reason", b"no_gateway"), (b"spillway-job-id", b"j1")]
    ((response, call),) = _against(_ScriptedApp(202, job, headers), lambda s: s.ModelInfer.with_call(_tiny_request()))
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
    (error,) = _against(_ScriptedApp(status, body, headers), lambda stub: stub.ModelInfer(_tiny_request()))
    assert error.code() == code and error.details() == "priority 2 queue is full"
    trailing = dict(error.trailing_metadata())
    assert (trailing["spillway-reason"], trailing["retry-after"]) == ("queue_full", "3")


def test_config_and_repository_index(client: triton.InferenceServerClient) -> None:
    config = client.get_model_config("mlp").config
    assert config.name == "mlp" and config.max_batch_size == 64
    assert [i.name for i in config.input] == ["input"] and list(config.output[0].dims) == [1000]
    index = client.get_model_repository_index()
    found = {(m.name, m.version): m.state for m in index.models}
    assert found[("mlp", "1")] == "READY" and found[("mlp", "2")] == "READY"


def test_unimplemented_extensions_say_so(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="shared memory") as err:
        client.get_system_shared_memory_status()
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
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
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
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
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
    assert client.is_server_live()  # unauthenticated, as over HTTP
    x = np.ones((1, 512), np.float32)
    for headers in ({}, {"authorization": "Bearer wrong"}):
        with pytest.raises(InferenceServerException, match="bearer token") as err:
            client.infer("mlp", [_input(x)], headers=headers, client_timeout=WAIT_S)
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("mlp")
    assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    good = {"authorization": "Bearer s3cret"}
    result = client.infer("mlp", [_input(x)], headers=good, client_timeout=WAIT_S)
    assert result.as_numpy("output").shape == (1, 1000)
    assert client.is_server_ready(headers=good)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))  # no token on this stream
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


def test_sigterm_lets_a_stream_finish_and_ends_idle_streams(demo_repo: Path, tmp_path: Path) -> None:
    """The drain: a generation in flight on a stream gets all its tokens and its last response; a stream with nothing
    in flight ends at once, so the agent exits long before its drain timeout (120 s here)."""
    running = start_agent(demo_repo, tmp_path, intra_op_threads=1, drain_timeout_s=120)
    busy, idle = triton.InferenceServerClient(running.grpc), triton.InferenceServerClient(running.grpc)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    idle_answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    try:
        idle.start_stream(callback=lambda result, error: idle_answers.put((result, error)))
        idle.async_stream_infer(TINY_LM, [_text_input("Hi")], request_id="i", parameters={"max_tokens": 1})
        assert idle_answers.get(timeout=WAIT_S)[1] is None  # answered: nothing in flight on it now
        busy.start_stream(callback=lambda result, error: answers.put((result, error)))
        busy.async_stream_infer(TINY_LM, [_text_input("Once")], request_id="long",
                                parameters={"max_tokens": 400, "ignore_eos": True, "temperature": 0})  # fmt: skip
        responses = [answers.get(timeout=WAIT_S)]
        running.proc.terminate()
        while not responses[-1][0].get_response().parameters["triton_final_response"].bool_param:
            result, error = answers.get(timeout=WAIT_S)
            assert error is None, error
            responses.append((result, error))
        assert running.proc.wait(timeout=60) == 0
    finally:
        if running.proc.poll() is None:
            running.proc.kill()
        busy.stop_stream(cancel_requests=True)
        idle.stop_stream(cancel_requests=True)
    assert responses[-1][0].get_response().parameters["finish_reason"].string_param == "length"
    assert len(_text([r.get_response() for r, _ in responses])) > 0


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
