"""The gateway with `v2_grpc` backends, on loopback: a real control plane, and as backends real gRPC V2 servers
(tritonclient's generated GRPCInferenceService, served by grpcio) that run real onnxruntime models: the demo's `mlp`
and `echo`, an Identity per datatype. Requests come as agents overflow them (V2 HTTP, JSON or binary tensors, through
httpx or tritonclient.http); the answers must equal onnxruntime's, and each gRPC status must become the gateway's
outcome for it (retried elsewhere, passed on, or the gateway's own refusal)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import orjson
import pytest
import tritonclient.http as triton_http
from onnx import TensorProto, helper
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from controlplane.gateway.grpc_backend import judge
from controlplane.gateway.grpc_messages import http_answer, infer_request
from controlplane.gateway.translate import BinaryOutputs
from spillway.contract import grpc_codec
from spillway.contract.v2 import RequestedOutput, decode_request
from spillway.demo.models import DEMO_VARIANTS, build_mlp
from tests.utils.builders import make_backend
from tests.utils.gateway import Plane, running_plane, wait_for
from tests.utils.server import free_port

X = np.random.default_rng(15).standard_normal((2, 512)).astype(np.float32)
ORT_TO_V2 = {"tensor(float)": "FP32", "tensor(int64)": "INT64", "tensor(bool)": "BOOL", "tensor(float16)": "FP16",
             "tensor(string)": "BYTES", "tensor(uint8)": "UINT8"}  # fmt: skip
V2_TO_DTYPE = {"FP32": np.float32, "INT64": np.int64, "BOOL": np.bool_, "FP16": np.float16, "UINT8": np.uint8}
TYPED = {"FP32": "fp32_contents", "INT64": "int64_contents", "BOOL": "bool_contents", "BYTES": "bytes_contents",
         "UINT8": "uint_contents"}  # fmt: skip
ECHO = (("i64", TensorProto.INT64, 3), ("flag", TensorProto.BOOL, 2), ("half", TensorProto.FLOAT16, 2),
        ("text", TensorProto.STRING, 2), ("small", TensorProto.UINT8, 4))  # fmt: skip


def echo_model() -> bytes:
    """`echo`: each input `x` comes back as `x_out`, one datatype each (the codec's cases, through onnxruntime)."""
    inputs = [helper.make_tensor_value_info(name, kind, ["batch", width]) for name, kind, width in ECHO]
    outputs = [helper.make_tensor_value_info(f"{name}_out", kind, ["batch", width]) for name, kind, width in ECHO]
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name, _, _ in ECHO]
    model = helper.make_model(helper.make_graph(nodes, "echo", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)])  # fmt: skip
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.fixture(scope="module")
def sessions() -> dict[str, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    mlp = build_mlp(DEMO_VARIANTS[1]).SerializeToString()
    return {"mlp": ort.InferenceSession(mlp, options), "echo": ort.InferenceSession(echo_model(), options)}


def ort_run(sessions: dict[str, ort.InferenceSession], model: str, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """onnxruntime run directly: what the answers through the gateway must equal."""
    session = sessions[model]
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


# ---- a gRPC V2 server running onnxruntime ------------------------------------------------------------------------


@dataclass
class Seen:
    model: str
    metadata: dict[str, str]
    parameters: dict[str, Any]


@dataclass
class V2Server(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """A V2 gRPC server in this process (grpcio's threaded server). `mode`: ok, busy (UNAVAILABLE with retry-after,
    as a full Spillway agent answers), exhausted (RESOURCE_EXHAUSTED with retry-after, as an agent's 429), internal
    (INTERNAL); `delay_s` before an answer; `typed`: outputs in typed `contents` rather than raw; `ready`: what
    ServerReady says; `max_receive`: grpc's own limit on a request's size (None: its default)."""

    name: str
    sessions: dict[str, ort.InferenceSession]
    mode: str = "ok"
    delay_s: float = 0.0
    typed: bool = False
    ready: bool = True
    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    max_receive: int | None = None
    _server: Any = None

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def start(self) -> V2Server:
        options = [] if self.max_receive is None else [("grpc.max_receive_message_length", self.max_receive)]
        self._server = grpc.server(ThreadPoolExecutor(max_workers=8), options=options)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def reset(self, **change: Any) -> V2Server:
        for key, value in {"mode": "ok", "delay_s": 0.0, "typed": False, "ready": True, **change}.items():
            setattr(self, key, value)
        self.seen.clear()
        return self

    def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.ready)

    def ModelReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ModelReadyResponse(ready=self.ready and request.name in self.sessions)

    def ModelInfer(self, request: Any, context: Any) -> Any:
        metadata = {key: value for key, value in context.invocation_metadata() if isinstance(value, str)}
        self.seen.append(Seen(request.model_name, metadata, grpc_codec.parameters_to_dict(request.parameters)))
        if self.mode == "busy":
            context.set_trailing_metadata((("retry-after", "2"), ("spillway-reason", "queue_full")))
            context.abort(grpc.StatusCode.UNAVAILABLE, "the queue is full")
        if self.mode == "exhausted":
            context.set_trailing_metadata((("retry-after", "3"), ("spillway-reason", "queue_full")))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no capacity left")
        if self.mode == "internal":
            context.abort(grpc.StatusCode.INTERNAL, "the runtime failed")
        if self.delay_s:
            time.sleep(self.delay_s)
        session = self.sessions.get(request.model_name)
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"model '{request.model_name}' is not served here")
        known = {i.name for i in session.get_inputs()}
        feeds: dict[str, np.ndarray] = {}
        for index, tensor in enumerate(request.inputs):
            if tensor.name not in known:
                has = ", ".join(sorted(known))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"input '{tensor.name}': no such input (it has: {has})")
            feeds[tensor.name] = from_raw(request.raw_input_contents[index], tensor.datatype, list(tensor.shape))
        names = [o.name for o in request.outputs] or [o.name for o in session.get_outputs()]
        types = {o.name: ORT_TO_V2[o.type] for o in session.get_outputs()}
        response = service_pb2.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        response.parameters["served_by"].string_param = self.name
        for name, array in zip(names, session.run(names, feeds), strict=True):
            out = response.outputs.add(name=name, datatype=types[name], shape=array.shape)
            if self.typed:
                values = [v.encode() for v in array.ravel()] if types[name] == "BYTES" else array.ravel().tolist()
                getattr(out.contents, TYPED[types[name]]).extend(values)
            else:
                response.raw_output_contents.append(to_raw(array, types[name]))
        context.set_trailing_metadata((("spillway-outcome", "local"),))
        return response


def from_raw(raw: bytes, datatype: str, shape: list[int]) -> np.ndarray:
    if datatype == "BYTES":
        return np.array([e.decode() for e in deserialize_bytes_tensor(raw)], dtype=object).reshape(shape)
    return np.frombuffer(raw, dtype=V2_TO_DTYPE[datatype]).reshape(shape)


def to_raw(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return bytes(serialize_byte_tensor(np.array([str(e).encode() for e in array.ravel()], dtype=object)).item())
    return np.ascontiguousarray(array).tobytes()


@pytest.fixture(scope="module")
def servers(sessions: dict[str, ort.InferenceSession]) -> Iterator[dict[str, V2Server]]:
    started = {name: V2Server(name, sessions).start() for name in ("one", "two")}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture
def one(servers: dict[str, V2Server]) -> V2Server:
    return servers["one"].reset()


@pytest.fixture
def two(servers: dict[str, V2Server]) -> V2Server:
    return servers["two"].reset()


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    with running_plane(f"sqlite:///{tmp_path / 'grpc.db'}") as running:
        yield running


@pytest.fixture
def unchecked(tmp_path: Path) -> Iterator[Plane]:
    """A control plane whose readiness checks do not run during the test (the first ran before anything was
    registered): only requests teach the gateway about the backends."""
    with running_plane(f"sqlite:///{tmp_path / 'unchecked.db'}", gateway_health_interval_s=60) as running:
        yield running


def register(plane: Plane, url: str, **over: Any) -> dict[str, Any]:
    body = make_backend(**{"url": url, "protocol": "v2_grpc", "models": ["mlp", "echo"], "max_concurrency": 16,
                           "timeout_ms": 10_000, **over})  # fmt: skip
    created = plane.client.post(f"{plane.url}/api/v1/backends", json=body, headers=plane.operator)
    assert created.status_code == 201, created.text
    return dict(created.json())


def mlp_json(**parameters: Any) -> bytes:
    tensor = {"name": "input", "datatype": "FP32", "shape": list(X.shape), "data": X.ravel().tolist()}
    return orjson.dumps({"id": "r-1", "inputs": [tensor], **({"parameters": parameters} if parameters else {})})


def json_outputs(response: Any) -> dict[str, np.ndarray]:
    body = response.json()
    return {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in body["outputs"]}


def triton(plane: Plane) -> triton_http.InferenceServerClient:
    return triton_http.InferenceServerClient(plane.url.removeprefix("http://"))


# ---- through the gateway ------------------------------------------------------------------------------------------


def test_json_and_binary_requests_answer_as_onnxruntime_does(
    plane: Plane, one: V2Server, sessions: dict[str, ort.InferenceSession]
) -> None:
    created = register(plane, one.url, auth_header="Bearer cloud-secret")
    expected = ort_run(sessions, "mlp", {"input": X})["output"]

    # JSON in, JSON out: the answer a V2 HTTP backend would give, with the backend's id and parameters.
    response = plane.infer(mlp_json(priority=2, timeout=5_000_000), **{"spillway-timeout-us": "2000000"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in response.headers
    body = response.json()
    assert (body["id"], body["model_name"], body["parameters"]["served_by"]) == ("r-1", "mlp", "one")
    np.testing.assert_array_equal(json_outputs(response)["output"].astype(np.float32), expected)
    assert response.headers["spillway-backend"] == created["name"] and response.headers["spillway-attempts"] == "1"
    assert response.headers["spillway-outcome"] == "local"  # the backend's trailing metadata, passed on
    seen = one.seen[-1]
    assert seen.metadata["authorization"] == "Bearer cloud-secret"  # the backend's, not the agent's
    assert 1_000_000 < int(seen.metadata["spillway-timeout-us"]) < 2_000_000  # what is left, less a margin
    assert seen.parameters == {"priority": 2, "timeout": 5_000_000}  # carried; binary_data_output is not

    # Binary in, binary out, through tritonclient.http as an agent's client would send it.
    tensor = triton_http.InferInput("input", list(X.shape), "FP32")
    tensor.set_data_from_numpy(X, binary_data=True)
    asked = [triton_http.InferRequestedOutput("output", binary_data=True)]
    result = triton(plane).infer("mlp", [tensor], outputs=asked, headers=plane.agent, priority=1)
    np.testing.assert_array_equal(result.as_numpy("output"), expected)
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == expected.nbytes
    assert one.seen[-1].parameters == {"priority": 1}

    # The versioned path asks the backend for that version.
    versioned = plane.client.post(f"{plane.url}/v2/models/mlp/versions/1/infer", content=mlp_json(),
                                  headers=plane.agent)  # fmt: skip
    assert versioned.status_code == 200, versioned.text


@pytest.mark.parametrize("typed", [False, True], ids=["raw_output_contents", "typed_contents"])
def test_every_datatype_round_trips_in_json_and_binary(
    plane: Plane, one: V2Server, sessions: dict[str, ort.InferenceSession], typed: bool
) -> None:
    register(plane, one.url)
    one.reset(typed=typed)
    feeds = {"i64": np.array([[1, -(2**40), 2**62], [0, -1, 7]], dtype=np.int64),
             "flag": np.array([[True, False], [False, True]]),
             "half": np.array([[0.5, -1.25], [65504.0, 2.0**-14]], dtype=np.float16),
             "text": np.array([["héllo", ""], ["a b", "x" * 300]], dtype=object),
             "small": np.array([[0, 1, 254, 255], [7, 8, 9, 10]], dtype=np.uint8)}  # fmt: skip
    if typed:  # FP16 has no typed contents field: a server answering typed contents cannot send it
        feeds.pop("half")
    expected = ort_run(sessions, "echo", {**feeds, "half": feeds.get("half", np.zeros((2, 2), np.float16))})
    client = triton(plane)
    for binary in (False, True):
        inputs = []
        for name, array in feeds.items():
            tensor = triton_http.InferInput(name, list(array.shape), ORT_TO_V2[f"tensor({_ort(array)})"])
            tensor.set_data_from_numpy(array, binary_data=binary)
            inputs.append(tensor)
        if typed:
            half = triton_http.InferInput("half", [2, 2], "FP16")
            half.set_data_from_numpy(np.zeros((2, 2), np.float16), binary_data=True)
            inputs.append(half)
        asked = [triton_http.InferRequestedOutput(f"{name}_out", binary_data=binary) for name in feeds]
        result = client.infer("echo", inputs, outputs=asked, headers=plane.agent)
        for name in feeds:
            got = result.as_numpy(f"{name}_out")
            if name == "text":
                got = np.array([e.decode() if isinstance(e, bytes) else e for e in got.ravel()], dtype=object)
                np.testing.assert_array_equal(got.reshape(2, 2), expected["text_out"])
            else:
                np.testing.assert_array_equal(got, expected[f"{name}_out"])
                assert got.dtype == expected[f"{name}_out"].dtype, name


def _ort(array: np.ndarray) -> str:
    return {"int64": "int64", "bool": "bool", "float16": "float16", "object": "string", "uint8": "uint8"}[
        array.dtype.name
    ]


def test_a_deadline_the_backend_cannot_meet_is_the_gateways_504(plane: Plane, one: V2Server) -> None:
    register(plane, one.url)
    one.reset(delay_s=1.0)
    response = plane.infer(mlp_json(), **{"spillway-timeout-us": "200000"})
    assert response.status_code == 504, response.text
    assert (
        response.json()["error"] == "deadline_exceeded" and response.headers["spillway-reason"] == "deadline_exceeded"
    )
    assert response.headers["spillway-attempts"] == "1"
    assert int(one.seen[-1].metadata["spillway-timeout-us"]) < 200_000  # the gRPC deadline's share, told too
    # The request's own `timeout` parameter bounds it the same way.
    late = plane.infer(mlp_json(timeout=200_000))
    assert late.status_code == 504 and late.json()["error"] == "deadline_exceeded", late.text


def test_an_unavailable_backend_is_tried_and_the_other_answers(unchecked: Plane, one: V2Server, two: V2Server) -> None:
    plane = unchecked
    nowhere = register(plane, f"127.0.0.1:{free_port()}", name="nowhere", models=["mlp"])  # nothing listens
    busy = register(plane, two.url, name="busy", models=["mlp"])
    good = register(plane, one.url, name="good", models=["mlp"])
    two.reset(mode="busy")
    for _ in range(12):
        response = plane.infer(mlp_json())
        assert response.status_code == 200, response.text
        assert response.headers["spillway-backend"] == good["name"]
    rows = plane.gateway()
    assert rows[nowhere["name"]]["requests"] > 0 and rows[busy["name"]]["requests"] > 0, rows
    assert rows[nowhere["name"]]["errors"] == rows[nowhere["name"]]["requests"]  # a connect failure counts
    assert "UNAVAILABLE" in rows[nowhere["name"]]["last_error"]
    assert rows[busy["name"]]["errors"] == 0 and rows[busy["name"]]["busy"] == rows[busy["name"]]["requests"]
    assert rows[good["name"]]["errors"] == 0

    # Only the busy one left: its refusal is the answer, a 503 with its Retry-After and reason.
    plane.client.delete(f"{plane.url}/api/v1/backends/{good['id']}", headers=plane.operator)
    plane.client.delete(f"{plane.url}/api/v1/backends/{nowhere['id']}", headers=plane.operator)
    refused = plane.infer(mlp_json())
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "2" and refused.headers["spillway-reason"] == "queue_full"
    assert "the queue is full" in refused.json()["error"]
    two.reset(mode="exhausted")
    full = plane.infer(mlp_json())
    assert full.status_code == 429 and "no capacity left" in full.json()["error"], full.text
    assert full.headers["retry-after"] == "3" and full.headers["spillway-reason"] == "queue_full"
    assert plane.gateway()[busy["name"]]["errors"] == 0


def test_a_request_too_large_for_the_backends_is_a_413_not_a_retry(
    unchecked: Plane, sessions: dict[str, ort.InferenceSession]
) -> None:
    """grpc's own "message larger than max" is RESOURCE_EXHAUSTED without retry-after: the same on every backend,
    so the client hears 413 (not "busy, retry") after one attempt, and no backend is held responsible."""
    plane = unchecked
    small = [V2Server(name, sessions, max_receive=64 << 10).start() for name in ("small-a", "small-b")]
    try:
        rows = [register(plane, server.url, name=server.name, models=["mlp"]) for server in small]
        big = np.zeros((64, 512), dtype=np.float32)  # 128 KiB of raw contents
        tensor = {"name": "input", "datatype": "FP32", "shape": list(big.shape), "data": big.ravel().tolist()}
        response = plane.infer(orjson.dumps({"inputs": [tensor]}))
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert "RESOURCE_EXHAUSTED" in error and "larger than max" in error, error
        assert f"backend '{response.headers['spillway-backend']}'" in error
        assert (
            response.headers["spillway-attempts"] == "1" and response.headers["spillway-reason"] == "payload_too_large"
        )
        assert "retry-after" not in response.headers
        assert not any(server.seen for server in small)  # refused by grpc before the servicer
        state = plane.gateway()
        assert all(state[row["name"]]["errors"] == 0 and state[row["name"]]["busy"] == 0 for row in rows), state
        assert plane.infer(mlp_json()).status_code == 200  # a request within the limit is served
    finally:
        for server in small:
            server.stop()


def test_the_clients_errors_pass_on_and_the_backends_errors_are_not_retried(
    unchecked: Plane, one: V2Server, two: V2Server
) -> None:
    plane = unchecked  # a check would find `nowhere-model` not ready: here the backend's NOT_FOUND is the point
    register(plane, one.url, name="first", models=["mlp", "nowhere-model"])
    register(plane, two.url, name="second", models=["mlp", "nowhere-model"])
    wrong = orjson.dumps({"inputs": [{"name": "inputx", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]})
    response = plane.infer(wrong)
    assert response.status_code == 400, response.text
    assert "inputx" in response.json()["error"] and response.headers["spillway-attempts"] == "1"
    missing = plane.infer(mlp_json(), model="nowhere-model")
    assert missing.status_code == 404 and "nowhere-model" in missing.json()["error"], missing.text
    assert len(one.seen) + len(two.seen) == 2  # each tried once: a client's error is the same everywhere

    one.reset(mode="internal")
    two.reset(mode="internal")
    broken = plane.infer(mlp_json())
    assert broken.status_code == 500 and "the runtime failed" in broken.json()["error"], broken.text
    assert broken.headers["spillway-attempts"] == "1"
    rows = plane.gateway()
    assert rows["first"]["errors"] + rows["second"]["errors"] == 1  # counted against the backend, unlike the 400

    # What the gateway can tell is malformed never reaches a backend.
    before = len(one.seen) + len(two.seen)
    bad = plane.infer(orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2], "data": [1]}]}))
    assert bad.status_code == 400 and bad.json()["error"] == "invalid_request", bad.text
    assert "'input'" in bad.json()["message"]
    assert len(one.seen) + len(two.seen) == before


def test_readiness_is_asked_over_grpc_and_a_removed_backend_loses_its_channel(plane: Plane, one: V2Server) -> None:
    created = register(plane, one.url, name="checked", models=["mlp", "absent"])
    gateway = plane.app.state.gateway
    wait_for(lambda: plane.gateway()["checked"]["unhealthy_models"] == ["absent"])  # ModelReady said no
    # The checks asked on the gateway's own channel (the one requests use, closed with the gateway).
    assert gateway.grpc.held() == {created["id"]: one.url}
    one.reset(ready=False)
    wait_for(lambda: plane.gateway()["checked"]["unhealthy_models"] == ["absent", "mlp"])  # ServerReady said no
    wait_for(lambda: any("ServerReady answered not ready" in (e["data"].get("error") or "")
                         for e in plane.events("backend.unhealthy")))  # fmt: skip
    refused = plane.infer(mlp_json())
    assert refused.status_code == 503 and refused.json()["error"] == "no_healthy_backend", refused.text
    one.reset()
    wait_for(lambda: plane.gateway()["checked"]["unhealthy_models"] == ["absent"])
    assert plane.infer(mlp_json()).status_code == 200

    assert gateway.grpc.held() == {created["id"]: one.url}
    # Removed while a request is in flight: that request is still answered, then the channel goes.
    one.reset(delay_s=1.0)
    answers: list[int] = []
    thread = threading.Thread(target=lambda: answers.append(plane.infer(mlp_json()).status_code))
    thread.start()
    wait_for(lambda: one.seen)
    plane.client.delete(f"{plane.url}/api/v1/backends/{created['id']}", headers=plane.operator)
    wait_for(lambda: not gateway.grpc.held())
    thread.join(timeout=30)
    assert answers == [200]


def test_a_call_that_cannot_be_sent_fails_the_attempt_not_the_gateway(unchecked: Plane, one: V2Server) -> None:
    register(unchecked, one.url, name="garbled", auth_header="Bearer a\nb")  # no valid gRPC metadata value
    response = unchecked.infer(mlp_json())
    assert response.status_code == 502 and response.json()["error"] == "backend_unavailable", response.text
    assert "could not be sent" in response.json()["message"]
    assert not one.seen


def test_a_grpc_backend_url_is_validated(plane: Plane) -> None:
    for url, words in (("http://127.0.0.1:8001", "grpc://host:port"), ("grpc://127.0.0.1", "grpc://host:port"),
                       ("grpc://user:pw@host:8001", "no path or credentials")):  # fmt: skip
        body = make_backend(url=url, protocol="v2_grpc")
        refused = plane.client.post(f"{plane.url}/api/v1/backends", json=body, headers=plane.operator)
        assert refused.status_code == 422, refused.text
        assert refused.json()["details"][0]["field"] == "body.url" and words in refused.json()["message"]
    plain = plane.client.post(f"{plane.url}/api/v1/backends", json=make_backend(url="grpc://host:8001"),
                              headers=plane.operator)  # fmt: skip
    assert plain.status_code == 422 and "set protocol 'v2_grpc'" in plain.json()["message"], plain.text
    for url in ("grpc://cloud.example.com:8001", "10.0.0.7:8001", "grpcs://triton.example.com:443"):
        created = plane.client.post(f"{plane.url}/api/v1/backends", json=make_backend(url=url, protocol="v2_grpc"),
                                    headers=plane.operator)  # fmt: skip
        assert created.status_code == 201 and created.json()["protocol"] == "v2_grpc", created.text


# ---- the messages, against the agent's codec (the opposite directions) ---------------------------------------------


def test_a_request_reads_back_through_the_agents_codec_as_it_was_sent() -> None:
    tensor = triton_http.InferInput("input", list(X.shape), "FP32")
    tensor.set_data_from_numpy(X, binary_data=True)
    text = triton_http.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"a", b"\xff\x00"], dtype=object), binary_data=True)
    body, length = triton_http.InferenceServerClient.generate_request_body(
        [tensor, text], outputs=[triton_http.InferRequestedOutput("output", binary_data=False)], request_id="7",
        parameters={"tag": "x"}, priority=3)  # fmt: skip
    request = infer_request(body, length, "mlp", "2")
    assert (request.message.model_name, request.message.model_version, request.message.id) == ("mlp", "2", "7")
    assert request.outputs == BinaryOutputs((RequestedOutput("output", False),), False)
    v2_body, v2_length = grpc_codec.infer_request_to_v2(request.message)
    decoded = decode_request(v2_body, v2_length)
    np.testing.assert_array_equal(decoded.inputs[0].array, X)
    assert decoded.inputs[1].array.tolist() == [b"a", b"\xff\x00"]
    assert decoded.parameters["tag"] == "x" and decoded.parameters["priority"] == 3


def test_an_answer_is_written_as_the_client_asked_and_a_broken_one_is_refused() -> None:
    out = np.arange(6, dtype=np.float32).reshape(2, 3)
    response = service_pb2.ModelInferResponse(model_name="mlp", model_version="1", id="9")
    response.outputs.add(name="output", datatype="FP32", shape=[2, 3])
    response.raw_output_contents.append(out.tobytes())
    body, length = http_answer(response, BinaryOutputs(None, True))
    assert length is not None and body[length:] == out.tobytes()
    as_json, none = http_answer(response, BinaryOutputs((RequestedOutput("output", False),), True))
    assert none is None and orjson.loads(as_json)["outputs"][0]["data"] == out.ravel().tolist()
    response.raw_output_contents[0] = out.tobytes()[:-4]
    with pytest.raises(ValueError, match="backend response: output 'output': 20 bytes"):
        http_answer(response, BinaryOutputs(None, False))
    with pytest.raises(ValueError, match="'other'"):
        response.raw_output_contents[0] = out.tobytes()
        http_answer(response, BinaryOutputs((RequestedOutput("other", None),), False))


@pytest.mark.parametrize(
    ("code", "metadata", "status", "failure", "retried", "busy"),
    [
        (grpc.StatusCode.UNAVAILABLE, {"retry-after": "1"}, 503, None, True, True),
        (grpc.StatusCode.UNAVAILABLE, {}, 503, "connect", True, False),
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            {"retry-after": "1", "spillway-reason": "queue_full"},
            429,
            None,
            True,
            True,
        ),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, {"spillway-reason": "queue_full"}, 429, None, True, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, {}, 413, None, False, False),  # grpc's "larger than max"
        (grpc.StatusCode.RESOURCE_EXHAUSTED, {"spillway-outcome": "rejected"}, 413, None, False, False),
        (grpc.StatusCode.DEADLINE_EXCEEDED, {}, 504, "timeout", True, False),
        (grpc.StatusCode.INVALID_ARGUMENT, {}, 400, None, False, False),
        (grpc.StatusCode.NOT_FOUND, {}, 404, None, False, False),
        (grpc.StatusCode.INTERNAL, {}, 500, "status_5xx", False, False),
        (grpc.StatusCode.UNIMPLEMENTED, {}, 501, "status_5xx", False, False),
    ],
)
def test_each_grpc_status_is_one_of_the_gateways_outcomes(
    code: grpc.StatusCode, metadata: dict[str, str], status: int, failure: str | None, retried: bool, busy: bool
) -> None:
    verdict = judge(code, metadata)
    assert (verdict.status, verdict.failure, verdict.retried, verdict.busy) == (status, failure, retried, busy)


def test_concurrent_requests_share_one_channel(plane: Plane, one: V2Server) -> None:
    created = register(plane, one.url)
    results: list[int] = []

    def send() -> None:
        results.append(plane.infer(mlp_json()).status_code)

    threads = [threading.Thread(target=send) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [200] * 16
    assert list(plane.app.state.gateway.grpc.held()) == [created["id"]]
