"""Triton's model configuration and repository endpoints on a real agent process, through the real tritonclient.http:
the config as Triton returns it (compared with config.pbtxt), the repository index, load and unload (every request
in flight answered once), 404 for routes that do not exist and 405 only for a route that exists with another
method, and the bearer token on every route but liveness."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from edge_agent.runtime.config import model_config_pb2, parse_config_file
from edge_agent.serving.app import InferenceApp
from edge_agent.serving.models import ModelRegistry
from tests.agent.conftest import RunningAgent, start_agent, stop_agent
from tests.utils.server import serving

TOKEN = "triton-endpoints-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def auth() -> dict[str, str]:
    """The token's header, a new dict each call: tritonclient adds its own headers to the dict it is given."""
    return dict(AUTH)


X = np.random.default_rng(15).standard_normal((2, 512), dtype=np.float32)


@pytest.fixture(scope="module")
def repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the demo repository (mlp, tiny-lm) that this module's agent loads from and may edit."""
    return Path(shutil.copytree(demo_repo, tmp_path_factory.mktemp("triton-repo") / "models"))


@pytest.fixture(scope="module")
def served(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningAgent]:
    running = start_agent(repo, tmp_path_factory.mktemp("triton-agent"), token=TOKEN, intra_op_threads=2)
    yield running
    stop_agent(running)


@pytest.fixture(scope="module")
def client(served: RunningAgent) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=served.url.removeprefix("http://"), concurrency=8)


def expected(repo: Path, version: int) -> np.ndarray:
    session = ort.InferenceSession(str(repo / "mlp" / str(version) / "model.onnx"), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"input": X})[0])


def infer(client: triton.InferenceServerClient, version: str = "") -> np.ndarray:
    tensor = triton.InferInput("input", list(X.shape), "FP32")
    tensor.set_data_from_numpy(X, binary_data=True)
    result = client.infer("mlp", [tensor], model_version=version, headers=auth())
    output = result.as_numpy("output")
    assert output is not None
    return output


def assert_config_says_what_the_file_says(config: dict[str, Any], path: Path) -> None:
    """Every field config.pbtxt sets comes back with its value; 64-bit integers as JSON numbers, as Triton's."""
    wanted = parse_config_file(path)
    got = json_format.ParseDict(config, model_config_pb2().ModelConfig())
    for field, value in wanted.ListFields():
        assert getattr(got, field.name) == value, field.name


# ---- the model config ------------------------------------------------------------------------------------------


def test_model_config_is_the_config_pbtxt_as_triton_returns_it(client: triton.InferenceServerClient,
                                                               repo: Path) -> None:  # fmt: skip
    config = client.get_model_config("mlp", headers=auth())
    assert_config_says_what_the_file_says(config, repo / "mlp" / "config.pbtxt")
    assert config["name"] == "mlp" and config["platform"] == "onnxruntime_onnx" and config["backend"] == "onnxruntime"
    assert config["max_batch_size"] == 64
    assert config["input"][0] == {**config["input"][0], "name": "input", "data_type": "TYPE_FP32", "dims": [512]}
    assert config["output"][0]["dims"] == [1000]
    batching = config["dynamic_batching"]
    # int64/uint64 fields are numbers (protobuf's own JSON writes them as strings), map keys stay strings.
    assert batching["max_queue_delay_microseconds"] == 2000 and batching["priority_levels"] == 3
    assert batching["default_queue_policy"]["default_timeout_microseconds"] == 100000
    assert batching["priority_queue_policy"]["3"]["max_queue_size"] == 64
    assert config["instance_group"][0]["count"] == 1 and config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["version_policy"] == {"all": {}}
    assert config["model_warmup"] == [] and config["parameters"] == {}  # defaults shown, as Triton shows them
    assert client.get_model_config("mlp", "1", headers=auth()) == config


def test_a_generative_models_config_is_served_as_parsed(client: triton.InferenceServerClient, repo: Path) -> None:
    config = client.get_model_config("tiny-lm", headers=auth())
    assert_config_says_what_the_file_says(config, repo / "tiny-lm" / "config.pbtxt")
    assert config["platform"] == "onnxruntime_decoder"
    assert config["version_policy"] == {"specific": {"versions": [1]}}
    assert config["dynamic_batching"]["priority_queue_policy"]["3"]["default_timeout_microseconds"] == 2000000
    assert client.get_model_config("tiny-lm", "1", headers=auth())["name"] == "tiny-lm"


def test_the_config_of_an_unknown_model_or_version_is_404(client: triton.InferenceServerClient) -> None:
    for name, version in (("nope", ""), ("mlp", "9"), ("tiny-lm", "2")):
        with pytest.raises(InferenceServerException, match="unknown") as refused:
            client.get_model_config(name, version, headers=auth())
        assert refused.value.status() == "404", (name, version)


# ---- routes, methods and the token -----------------------------------------------------------------------------


def test_unknown_routes_are_404_and_known_ones_405_naming_their_method(served: RunningAgent) -> None:
    with httpx.Client(base_url=served.url, headers=auth()) as c:
        for method, path in (("GET", "/v2/nothing"), ("POST", "/v2/nothing"), ("GET", "/v2/repository"),
                             ("POST", "/v2/repository/models/mlp"), ("GET", "/v2/models/mlp/versions"),
                             ("DELETE", "/v2/models/mlp/nothing"), ("GET", "/v3/models/mlp")):  # fmt: skip
            answer = c.request(method, path)
            assert answer.status_code == 404, (method, path)
            assert "no such endpoint" in answer.json()["error"]
        for method, path, allowed in (("GET", "/v2/repository/index", "POST"),
                                      ("GET", "/v2/repository/models/mlp/load", "POST"),
                                      ("PUT", "/v2/models/mlp/infer", "POST"), ("GET", "/v2/models/mlp/infer", "POST"),
                                      ("POST", "/v2/models/mlp/config", "GET"), ("POST", "/v2/health/ready", "GET"),
                                      ("DELETE", "/metrics", "GET")):  # fmt: skip
            answer = c.request(method, path)
            assert answer.status_code == 405, (method, path)
            assert answer.headers["allow"].split(", ")[0] == allowed
            assert f"use {allowed}" in answer.json()["error"]
        assert c.post("/v2/repository/index").status_code == 200


def test_every_route_but_liveness_needs_the_token(served: RunningAgent) -> None:
    with httpx.Client(base_url=served.url) as c:
        assert c.get("/v2/health/live").status_code == 200
        for method, path in (("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/mlp/unload"),
                             ("POST", "/v2/repository/models/mlp/load"), ("GET", "/v2/models/mlp/config"),
                             ("GET", "/metrics"), ("GET", "/v2/nothing")):  # fmt: skip
            answer = c.request(method, path)
            assert answer.status_code == 401, (method, path)
            assert answer.headers["www-authenticate"] == "Bearer"
        wrong = c.post("/v2/repository/models/mlp/unload", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert c.get("/v2/models/mlp/ready", headers=auth()).status_code == 200  # the refused unloads did nothing


# ---- the repository extension ----------------------------------------------------------------------------------


def test_the_index_lists_every_model_of_the_repository_folder(client: triton.InferenceServerClient,
                                                              served: RunningAgent) -> None:  # fmt: skip
    index = client.get_model_repository_index(headers=auth())
    rows = {(r["name"], r["version"]): (r["state"], r["reason"]) for r in index}
    assert rows == {("mlp", "1"): ("READY", ""), ("mlp", "2"): ("READY", ""), ("tiny-lm", "1"): ("READY", "")}
    with httpx.Client(base_url=served.url, headers=auth()) as c:
        assert c.post("/v2/repository/index", json={"ready": True}).json() == index
        for body in (b"{", b"[]", b'{"ready": "yes"}', b'{"redy": true}'):
            refused = c.post("/v2/repository/index", content=body)
            assert refused.status_code == 400, body
            assert "index" in refused.json()["error"]


def test_bad_loads_and_unloads_are_refused_with_what_is_wrong(served: RunningAgent, repo: Path) -> None:
    with httpx.Client(base_url=served.url, headers=auth(), timeout=60) as c:
        unknown = c.post("/v2/repository/models/nope/load")
        assert unknown.status_code == 404 and "no model 'nope'" in unknown.json()["error"]
        assert c.post("/v2/repository/models/nope/unload").status_code == 404
        assert c.post("/v2/repository/models/.hidden/load").status_code == 404
        for action in ("load", "unload"):
            generative = c.post(f"/v2/repository/models/tiny-lm/{action}")
            assert generative.status_code == 400 and "generative" in generative.json()["error"]
        for body in (b"{", b'{"parameters": 3}', b'{"parameters": {"config": "{}"}}', b'{"params": {}}'):
            refused = c.post("/v2/repository/models/mlp/load", content=body)
            assert refused.status_code == 400, body
            assert "loading 'mlp'" in refused.json()["error"]
        refused = c.post("/v2/repository/models/mlp/unload", json={"parameters": {"unload_dependents": "no"}})
        assert refused.status_code == 400 and "unload_dependents" in refused.json()["error"]
        assert c.get("/v2/models/mlp/ready").status_code == 200


def test_unload_answers_every_request_once_then_load_serves_again(
    client: triton.InferenceServerClient, served: RunningAgent, repo: Path
) -> None:
    want = {1: expected(repo, 1), 2: expected(repo, 2)}
    np.testing.assert_array_equal(infer(client), want[2])
    answers: list[tuple[int, dict[str, Any]]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    unloaded = threading.Event()
    body = {"inputs": [{"name": "input", "shape": list(X.shape), "datatype": "FP32", "data": X.ravel().tolist()}]}

    def sender(version: int) -> None:
        """Requests one after another until one is refused for the unload (bounded)."""
        with httpx.Client(base_url=served.url, headers=auth(), timeout=60) as c:
            for _ in range(2000):
                try:
                    answer = c.post(f"/v2/models/mlp/versions/{version}/infer", json=body)
                except httpx.HTTPError as exc:  # a connection error: the test fails on it below
                    with lock:
                        failures.append(exc)
                    return
                with lock:
                    answers.append((answer.status_code, {"version": version, **answer.json()}))
                if answer.status_code != 200 and unloaded.is_set():
                    return

    with ThreadPoolExecutor(8) as pool:
        senders = [pool.submit(sender, 1 + i % 2) for i in range(8)]
        deadline = time.monotonic() + 60
        while True:  # the unload starts while the senders are busy
            with lock:
                if len(answers) >= 16:
                    break
            assert not any(f.done() for f in senders), [f.result() for f in senders if f.done()]
            assert time.monotonic() < deadline, "no answers before the unload"
            time.sleep(0.01)
        client.unload_model("mlp", headers=auth())
        unloaded.set()
        for future in senders:
            future.result()

    assert failures == []
    statuses = {status for status, _ in answers}
    assert {200, 404} <= statuses <= {200, 404, 503}
    for status, answer in answers:
        if status == 200:  # answered before the unload, or drained by it
            output = np.asarray(answer["outputs"][0]["data"], dtype=np.float32).reshape(X.shape[0], 1000)
            np.testing.assert_allclose(output, want[answer["version"]], rtol=1e-6, atol=1e-6)
        elif status == 404:  # arrived once it was out of routing
            assert answer["reason"] == "unknown_model" and "unloaded" in answer["error"]
        else:  # a busy machine may time a request out in the queue; never refused as "draining"
            assert answer["reason"] in ("timeout", "deadline_unmeetable", "queue_full"), answer
    assert not client.is_model_ready("mlp", headers=auth())
    with pytest.raises(InferenceServerException, match="unloaded") as gone:
        infer(client)
    assert gone.value.status() == "404"
    index = client.get_model_repository_index(headers=auth())
    assert {(r["name"], r["version"], r["state"], r["reason"]) for r in index if r["name"] == "mlp"} == {
        ("mlp", "1", "UNAVAILABLE", "unloaded"), ("mlp", "2", "UNAVAILABLE", "unloaded")}  # fmt: skip
    with httpx.Client(base_url=served.url, headers=auth()) as c:
        assert [r["name"] for r in c.post("/v2/repository/index", json={"ready": True}).json()] == ["tiny-lm"]
    client.unload_model("mlp", headers=auth())  # unloading what is not loaded: nothing to do

    # Loading again reads the folder again: an edit to config.pbtxt takes effect.
    config = repo / "mlp" / "config.pbtxt"
    config.write_text(config.read_text().replace("delay_microseconds: 2000", "delay_microseconds: 3000"))
    client.load_model("mlp", headers=auth())
    assert client.is_model_ready("mlp", headers=auth()) and client.is_model_ready("mlp", "1", headers=auth())
    np.testing.assert_array_equal(infer(client), want[2])
    np.testing.assert_array_equal(infer(client, "1"), want[1])
    assert client.get_model_config("mlp", headers=auth())["dynamic_batching"]["max_queue_delay_microseconds"] == 3000
    client.load_model("mlp", headers=auth())  # a reload of a model that serves: the new versions take over
    np.testing.assert_array_equal(infer(client), want[2])
    assert {r["state"] for r in client.get_model_repository_index(headers=auth())} == {"READY"}


def test_a_load_that_would_not_fit_is_refused_naming_the_need_and_keeps_serving(
    demo_repo: Path, tmp_path: Path
) -> None:
    repo = Path(shutil.copytree(demo_repo / "mlp", tmp_path / "models" / "mlp")).parent
    running = start_agent(repo, tmp_path, intra_op_threads=1, load_headroom_bytes=1 << 50)
    try:
        with httpx.Client(base_url=running.url, timeout=60) as c:
            refused = c.post("/v2/repository/models/mlp/load")
            assert refused.status_code == 409
            message = refused.json()["error"]
            assert "cannot load 'mlp' v1" in message and "MiB" in message and "available" in message
            assert c.get("/v2/models/mlp/ready").status_code == 200  # the running versions still serve
            index = c.post("/v2/repository/index").json()
            assert {r["state"] for r in index} == {"READY"}
    finally:
        stop_agent(running)


# ---- /metrics --------------------------------------------------------------------------------------------------


def test_metrics_answer_what_the_exporter_says_behind_the_token() -> None:
    app = InferenceApp(ModelRegistry([]), token=TOKEN)
    with serving(app) as url, httpx.Client(base_url=url) as c:  # type: ignore[arg-type]
        off = c.get("/metrics", headers=auth())
        assert off.status_code == 404 and off.json()["error"] == "metrics are off"
        app.metrics = lambda: (b"# TYPE up gauge\nup 1.0\n", "text/plain; version=0.0.4; charset=utf-8")
        assert c.get("/metrics").status_code == 401
        on = c.get("/metrics", headers=auth())
        assert on.status_code == 200 and on.text == "# TYPE up gauge\nup 1.0\n"
        assert on.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
