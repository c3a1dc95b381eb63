"""The real Triton client (tritonclient.http) against the agent, binary and JSON, outputs checked against
a direct onnxruntime run of the same model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.agent.conftest import RunningAgent


@pytest.fixture(scope="module")
def client(agent: RunningAgent) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=agent.url.removeprefix("http://"), concurrency=4)


def test_server_and_model_calls(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp") and client.is_model_ready("mlp", "1")
    meta = client.get_model_metadata("mlp", "2")
    assert meta["inputs"][0]["name"] == "input" and meta["outputs"][0]["shape"] == [-1, 1000]
    assert client.get_server_metadata()["name"] == "spillway-edge-agent"
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("version", ["1", "2"])
def test_infer_matches_onnxruntime(
    client: triton.InferenceServerClient, demo_repo: Path, binary: bool, version: str
) -> None:
    x = np.random.default_rng(int(version)).standard_normal((4, 512), dtype=np.float32)
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    wanted = triton.InferRequestedOutput("output", binary_data=binary)
    result = client.infer("mlp", [tensor], model_version=version, outputs=[wanted], request_id="c1", priority=1,
                          timeout=10_000_000)  # fmt: skip
    session = ort.InferenceSession(str(demo_repo / "mlp" / version / "model.onnx"), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"input": x})[0]
    got = result.as_numpy("output")
    assert got is not None and got.dtype == np.float32 and got.shape == (4, 1000)
    np.testing.assert_array_equal(got, expected)
    assert result.get_response()["id"] == "c1"


def test_bad_input_is_a_client_error_naming_the_input(client: triton.InferenceServerClient) -> None:
    tensor = triton.InferInput("input", [1, 500], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 500), np.float32), binary_data=True)
    with pytest.raises(InferenceServerException, match="input") as err:
        client.infer("mlp", [tensor])
    assert err.value.status() == "400"


def test_statistics_in_triton_shape(client: triton.InferenceServerClient) -> None:
    before = client.get_inference_statistics("mlp", "2")["model_stats"][0]["inference_stats"]["success"]["count"]
    tensor = triton.InferInput("input", [2, 512], "FP32")
    tensor.set_data_from_numpy(np.ones((2, 512), np.float32))
    client.infer("mlp", [tensor], model_version="2")
    stats = client.get_inference_statistics("mlp", "2")["model_stats"][0]
    assert stats["name"] == "mlp" and stats["version"] == "2"
    assert stats["inference_stats"]["success"]["count"] == before + 1
    assert {"batch_size", "compute_infer"} <= set(stats["batch_stats"][0])
