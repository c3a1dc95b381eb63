"""The agent over real HTTP on loopback: V2 endpoints, correct outputs, scheduling parameters, bad input."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from edge_agent.config import AgentConfig
from edge_agent.serving.app import InferenceApp
from edge_agent.serving.models import ModelRegistry
from tests.agent.conftest import RunningAgent
from tests.utils.server import serving

RNG = np.random.default_rng(7)


def reference(repo: Path, version: int, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(repo / "mlp" / str(version) / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x})[0]


def infer_json(x: np.ndarray, **parameters: object) -> dict:
    body: dict = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    if parameters:
        body["parameters"] = parameters
    return body


def test_server_and_model_metadata_health_and_stats(agent: RunningAgent) -> None:
    with httpx.Client(base_url=agent.url) as c:
        assert c.get("/v2").json()["extensions"] == [
            "binary_tensor_data",
            "statistics",
            "parameters",
            "model_repository",
            "model_configuration",
        ]
        assert c.get("/v2/health/live").status_code == 200
        assert c.get("/v2/health/ready").json() == {"ready": True}
        meta = c.get("/v2/models/mlp").json()
        assert meta["versions"] == ["1", "2"]
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 512]}]
        assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 1000]}]
        assert c.get("/v2/models/mlp/versions/2/ready").json()["ready"] is True
        missing = c.get("/v2/models/nope")
        assert missing.status_code == 404 and missing.json() == {"error": "unknown model 'nope'"}
        assert c.get("/v2/models/mlp/versions/9").status_code == 404
        c.post("/v2/models/mlp/versions/2/infer", json=infer_json(RNG.standard_normal((1, 512), np.float32)))
        stats = c.get("/v2/models/mlp/versions/2/stats").json()["model_stats"][0]
        assert stats["name"] == "mlp" and stats["version"] == "2"
        assert stats["inference_stats"]["success"]["count"] >= 1
        assert stats["batch_stats"][0]["compute_infer"]["count"] >= 1
        assert len(c.get("/v2/models/stats").json()["model_stats"]) == 2


@pytest.mark.parametrize("version", [1, 2])
def test_json_inference_matches_onnxruntime_exactly(agent: RunningAgent, demo_repo: Path, version: int) -> None:
    x = RNG.standard_normal((3, 512), dtype=np.float32)
    with httpx.Client(base_url=agent.url) as c:
        response = c.post(f"/v2/models/mlp/versions/{version}/infer", json={**infer_json(x), "id": "r1"})
    assert response.status_code == 200, response.text
    assert response.headers["spillway-outcome"] == "local"
    body = response.json()
    assert body["id"] == "r1" and body["model_version"] == str(version)
    out = body["outputs"][0]
    assert out["shape"] == [3, 1000] and out["datatype"] == "FP32"
    np.testing.assert_array_equal(
        np.asarray(out["data"], np.float32).reshape(3, 1000), reference(demo_repo, version, x)
    )


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(agent: RunningAgent, demo_repo: Path) -> None:
    xs = [RNG.standard_normal((1, 512), dtype=np.float32) for _ in range(48)]
    before = agent.stats("1")["execution_count"]

    def call(x: np.ndarray) -> np.ndarray:
        with httpx.Client(base_url=agent.url, timeout=30) as c:
            # Priority 3 (1 s default deadline, not 100 ms): this is about batching, not about a busy CI machine.
            r = c.post("/v2/models/mlp/versions/1/infer", json=infer_json(x, priority=3))
            assert r.status_code == 200, r.text
            return np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(1, 1000)

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(call, xs))
    expected = reference(demo_repo, 1, np.concatenate(xs))
    np.testing.assert_allclose(np.concatenate(outs), expected, rtol=1e-5, atol=1e-5)
    batches = agent.stats("1")["execution_count"] - before
    assert batches < len(xs)  # some requests shared a batch


def test_scheduling_parameters(agent: RunningAgent) -> None:
    x = RNG.standard_normal((1, 512), dtype=np.float32)
    with httpx.Client(base_url=agent.url) as c:
        assert c.post("/v2/models/mlp/infer", json=infer_json(x, priority=1, timeout=5_000_000)).status_code == 200
        # As in Triton, a priority beyond the model's levels means its default level.
        assert c.post("/v2/models/mlp/infer", json=infer_json(x, priority=9)).status_code == 200
        bad = c.post("/v2/models/mlp/infer", json=infer_json(x, priority=-1))
        assert bad.status_code == 400 and "priority" in bad.json()["error"]
        assert c.post("/v2/models/mlp/infer", json=infer_json(x, timeout="soon")).status_code == 400
        late = c.post("/v2/models/mlp/versions/1/infer", json=infer_json(x, timeout=1))  # 1 us: cannot be met
        assert late.status_code == 503
        assert late.json()["reason"] == "deadline_unmeetable"
        assert late.headers["retry-after"] == "1" and late.headers["spillway-outcome"] == "rejected"


GARBAGE: list[tuple[str, dict, bytes | str | None, int, str]] = [
    (
        "wrong input name",
        {"inputs": [{"name": "x", "shape": [1, 512], "datatype": "FP32", "data": [0.0] * 512}]},
        None,
        400,
        "'x'",
    ),
    (
        "wrong dtype",
        {"inputs": [{"name": "input", "shape": [1, 512], "datatype": "INT64", "data": [0] * 512}]},
        None,
        400,
        "input",
    ),
    (
        "wrong shape",
        {"inputs": [{"name": "input", "shape": [1, 511], "datatype": "FP32", "data": [0.0] * 511}]},
        None,
        400,
        "input",
    ),
    (
        "short data",
        {"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.0] * 10}]},
        None,
        400,
        "input",
    ),
    (
        "huge shape",
        {"inputs": [{"name": "input", "shape": [1 << 40, 512], "datatype": "FP32", "data": [0.0]}]},
        None,
        400,
        "input",
    ),
    (
        "batch over max",
        {"inputs": [{"name": "input", "shape": [65, 512], "datatype": "FP32", "data": [0.0] * 65 * 512}]},
        None,
        400,
        "input",
    ),
    ("non-finite (binary)", {}, "nan", 400, "input"),
    ("malformed json", {}, b"{not json", 400, ""),
    ("unknown model", {}, b"{}", 404, "unknown model"),
    (
        "unknown output",
        {
            "inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.0] * 512}],
            "outputs": [{"name": "logits"}],
        },
        None,
        400,
        "logits",
    ),
    ("truncated binary", {}, "truncated", 400, "input"),
    ("binary size overrun", {}, "overrun", 400, "input"),
    ("over the body limit", {}, "huge", 413, "exceeds"),
]


def _nan_body() -> tuple[bytes, int]:
    """A binary-extension request whose FP32 data holds a NaN (JSON cannot carry one)."""
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 2048}}]}).encode()  # fmt: skip
    data = np.zeros((1, 512), np.float32)
    data[0, 7] = np.nan
    return header + data.tobytes(), len(header)


def _garbage_request(c: httpx.Client, case: tuple) -> httpx.Response:
    label, body, raw, _, _ = case
    path = "/v2/models/nope/infer" if label == "unknown model" else "/v2/models/mlp/infer"
    if raw == "nan":
        payload, length = _nan_body()
        return c.post(path, content=payload, headers={"Inference-Header-Content-Length": str(length)})
    if raw in ("truncated", "overrun"):
        payload, length = _nan_body()
        payload = payload[:-100] if raw == "truncated" else payload
        header = payload[:length].replace(b"2048", b"4096") if raw == "overrun" else payload[:length]
        return c.post(path, content=header + payload[length:],
                      headers={"Inference-Header-Content-Length": str(len(header))})  # fmt: skip
    if raw == "huge":
        return c.post(path, content=b"x" * (9 << 20))
    if raw is not None:
        return c.post(path, content=raw, headers={"Content-Type": "application/json"})
    return c.post(path, content=json.dumps(body, allow_nan=True).encode(), headers={"Content-Type": "application/json"})


def test_garbage_interleaved_with_valid_load_hurts_nobody(agent: RunningAgent, demo_repo: Path) -> None:
    xs = [RNG.standard_normal((1, 512), dtype=np.float32) for _ in range(60)]
    expected = reference(demo_repo, 2, np.concatenate(xs))
    failures: list[str] = []
    lock = threading.Lock()

    def valid(i: int) -> None:
        with httpx.Client(base_url=agent.url, timeout=30) as c:
            r = c.post("/v2/models/mlp/versions/2/infer", json=infer_json(xs[i], priority=3))  # 1 s deadline
            out = np.asarray(r.json()["outputs"][0]["data"], np.float32) if r.status_code == 200 else None
            if out is None or not np.allclose(out, expected[i], atol=1e-5):
                with lock:
                    failures.append(f"valid #{i}: {r.status_code} {r.text[:200]}")

    def garbage(i: int) -> None:
        case = GARBAGE[i % len(GARBAGE)]
        with httpx.Client(base_url=agent.url, timeout=30) as c:
            r = _garbage_request(c, case)
            if r.status_code != case[3] or case[4] not in r.json().get("error", ""):
                with lock:
                    failures.append(f"garbage {case[0]}: {r.status_code} {r.text[:200]}")

    def outcomes() -> int:
        return sum(o["count"] for o in agent.stats("2")["outcomes"])

    before = outcomes()
    with ThreadPoolExecutor(12) as pool:
        futures = []
        for i in range(60):
            futures.append(pool.submit(valid, i))
            futures.append(pool.submit(garbage, i))
        for f in futures:
            f.result()
    assert failures == []
    # Every request that reached the model got exactly one recorded outcome.
    to_unknown_model = sum(1 for i in range(60) if GARBAGE[i % len(GARBAGE)][0] == "unknown model")
    assert outcomes() - before == 60 + 60 - to_unknown_model


def test_unknown_outputs_are_refused_before_any_compute(agent: RunningAgent) -> None:
    before = agent.stats("2")["execution_count"]
    body = {**infer_json(np.zeros((1, 512), np.float32)), "outputs": [{"name": "logits"}]}
    with httpx.Client(base_url=agent.url) as c:
        r = c.post("/v2/models/mlp/versions/2/infer", json=body)
    assert r.status_code == 400 and "logits" in r.json()["error"]
    assert r.headers["spillway-outcome"] == "rejected" and r.headers["spillway-reason"] == "invalid_request"
    assert agent.stats("2")["execution_count"] == before


def test_truncated_binary_bodies_are_400(agent: RunningAgent) -> None:
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 2048}}]}).encode()  # fmt: skip
    with httpx.Client(base_url=agent.url) as c:
        for payload, length in ((header + b"\0" * 100, len(header)), (header, len(header) + 50)):
            r = c.post("/v2/models/mlp/infer", content=payload,
                       headers={"Inference-Header-Content-Length": str(length)})  # fmt: skip
            assert r.status_code == 400, r.text
        r = c.post("/v2/models/mlp/infer", content=header, headers={"Inference-Header-Content-Length": "abc"})
        assert r.status_code == 400


def test_oversized_body_is_413(agent: RunningAgent) -> None:
    with httpx.Client(base_url=agent.url) as c:
        r = c.post("/v2/models/mlp/infer", content=b"x" * (9 << 20))
    assert r.status_code == 413
    assert "exceeds" in r.json()["error"]


def test_a_token_is_required_when_configured() -> None:
    guarded = InferenceApp(ModelRegistry([]), token="s3cret-token")
    with serving(guarded) as url, httpx.Client(base_url=url) as c:  # type: ignore[arg-type]
        assert c.get("/v2/health/live").status_code == 200
        for path in ("/v2", "/v2/health/ready", "/v2/models/mlp", "/v2/models/stats"):
            assert c.get(path).status_code == 401, path
        assert c.post("/v2/models/mlp/infer", content=b"{}").status_code == 401
        assert c.get("/v2/models/mlp", headers={"Authorization": "Bearer wrong"}).status_code == 401
        # Past authentication: an empty repository has no such model.
        assert c.get("/v2/models/mlp", headers={"Authorization": "Bearer s3cret-token"}).status_code == 404


def test_beyond_loopback_needs_a_token_or_an_explicit_opt_out(demo_repo: Path) -> None:
    with pytest.raises(ValueError, match="beyond loopback"):
        AgentConfig(model_repository=demo_repo, host="0.0.0.0")
    assert AgentConfig(model_repository=demo_repo, host="0.0.0.0", token="t").token is not None
    assert AgentConfig(model_repository=demo_repo, host="0.0.0.0", allow_unauthenticated=True)
    assert AgentConfig(model_repository=demo_repo, host="::1").token is None
