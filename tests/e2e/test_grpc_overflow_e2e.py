"""V2 gRPC end to end, with real processes on loopback: the real `tritonclient.grpc` client -> an edge agent's gRPC
port, whose every request overflows -> the control plane's gateway -> a Spillway agent in cloud role registered as a
`v2_grpc` backend (its gRPC port). The answers must equal a direct onnxruntime run of the same model, say that they
overflowed, and none may be lost.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from spillway.demo.models import build_demo_repository
from spillway.demo.story import Story
from tests.agent.conftest import RunningAgent, start_agent, stop_agent
from tests.utils.server import free_port

pytestmark = pytest.mark.slow

CLOUD_TOKEN = "cloud-grpc-secret"
VERSION = "2"  # the lite mlp: what each answer is compared with
CLIENTS, EACH = 4, 5  # requests sent concurrently from this many threads, this many each


def test_tritonclient_grpc_through_an_overflowing_edge_and_the_gateway_to_a_grpc_cloud(tmp_path: Path) -> None:
    models = build_demo_repository(tmp_path / "models", generative=False)
    session = ort.InferenceSession(str(models / "mlp" / VERSION / "model.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(15)
    inputs = [rng.standard_normal((1 + i % 3, 512)).astype(np.float32) for i in range(CLIENTS * EACH)]

    with Story(tmp_path / "story", port=free_port(), agent_port=free_port(), interval_s=1.0) as base:
        base.prepare()
        base.start_control_plane()
        with base.api() as api:
            made = api.post("/api/v1/agents", json={"name": "edge-grpc", "device_class": "jetson"})
            assert made.status_code == 201, made.text
        token = made.json()["token"]

        cloud = start_agent(models, tmp_path, role="cloud", token=CLOUD_TOKEN, intra_op_threads=1)
        edge: RunningAgent | None = None
        try:
            assert cloud.grpc, "the cloud agent serves no gRPC"
            with base.api() as api:
                backend = api.post("/api/v1/backends", json={
                    "name": "cloud-grpc", "protocol": "v2_grpc", "url": f"grpc://{cloud.grpc}", "models": ["mlp"],
                    "auth_header": f"Bearer {CLOUD_TOKEN}", "timeout_ms": 20_000, "max_concurrency": 16,
                })  # fmt: skip
                assert backend.status_code == 201, backend.text
            # Every request overflows: priority level 1 and every level below it.
            edge = start_agent(models, tmp_path, agent_token=token, intra_op_threads=1,
                               overflow={"enabled": True, "gateway": base.base, "at_or_below": 1})  # fmt: skip
            assert edge.grpc, "the edge agent serves no gRPC"

            client = triton_grpc.InferenceServerClient(edge.grpc)
            assert client.is_server_ready() and client.is_model_ready("mlp", VERSION)
            answers: dict[int, Any] = {}
            failures: list[BaseException] = []

            def send(first: int) -> None:
                own = triton_grpc.InferenceServerClient(edge.grpc)  # one channel per thread, as clients do
                try:
                    for index in range(first, first + EACH):
                        tensor = triton_grpc.InferInput("input", list(inputs[index].shape), "FP32")
                        tensor.set_data_from_numpy(inputs[index])
                        answers[index] = own.infer("mlp", [tensor], model_version=VERSION, priority=2,
                                                   outputs=[triton_grpc.InferRequestedOutput("output")])  # fmt: skip
                except BaseException as exc:
                    failures.append(exc)
                finally:
                    own.close()

            threads = [threading.Thread(target=send, args=(c * EACH,)) for c in range(CLIENTS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=300)
            assert not failures, failures
            assert sorted(answers) == list(range(CLIENTS * EACH))  # every request answered

            for index, result in answers.items():
                expected = session.run(["output"], {"input": inputs[index]})[0]
                np.testing.assert_allclose(result.as_numpy("output"), expected, rtol=1e-5, atol=1e-5)
                response = result.get_response()
                assert response.parameters["spillway_outcome"].string_param == "overflow", response.parameters
                assert response.model_name == "mlp"

            # The outcome and the backend are in the trailing metadata too, read here with tritonclient's stub.
            with grpc.insecure_channel(edge.grpc) as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                request = service_pb2.ModelInferRequest(model_name="mlp", model_version=VERSION)
                request.inputs.add(name="input", datatype="FP32", shape=[1, 512])
                request.raw_input_contents.append(inputs[0][:1].tobytes())
                answer, call = stub.ModelInfer.with_call(request, timeout=60)
                trailing = dict(call.trailing_metadata())
            assert trailing["spillway-outcome"] == "overflow" and trailing.get("spillway-backend") == "cloud-grpc"
            raw = np.frombuffer(answer.raw_output_contents[0], dtype="<f4").reshape(1, 1000)
            np.testing.assert_allclose(raw, session.run(["output"], {"input": inputs[0][:1]})[0], rtol=1e-5, atol=1e-5)

            # No request lost: the edge counted each as overflowed, the gateway sent each to the gRPC backend once.
            sent = CLIENTS * EACH + 1
            status = httpx.get(f"{edge.url}/v2/spillway/status", timeout=10).json()
            outcomes: Counter[str] = Counter()
            for item in status["outcomes"]:
                outcomes[item["outcome"]] += item["count"]
            assert outcomes == Counter({"overflow": sent}), outcomes
            with base.api() as api:
                rows = {b["name"]: b for b in api.get("/api/v1/status").json()["gateway"]["backends"]}
            assert rows["cloud-grpc"]["protocol"] == "v2_grpc"
            assert (rows["cloud-grpc"]["requests"], rows["cloud-grpc"]["errors"]) == (sent, 0), rows
            auth = {"authorization": f"Bearer {CLOUD_TOKEN}"}
            stats = httpx.get(f"{cloud.url}/v2/models/mlp/versions/{VERSION}/stats", headers=auth, timeout=10).json()
            rows_in = sum(len(x) for x in inputs) + 1
            assert sum(s["inference_count"] for s in stats["model_stats"]) == rows_in
        finally:
            if edge is not None:
                stop_agent(edge)
            stop_agent(cloud)
