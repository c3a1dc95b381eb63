"""The gateway in front of two real Spillway agents serving the demo `mlp` model: answers equal to the agents'
own, binary and JSON, through the binary path and the JSON translation, with tritonclient. (The latency the
gateway adds is measured in bench/overflow.py, beside nginx, never asserted in a test.)"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from spillway.demo.models import build_demo_repository
from tests.agent.conftest import RunningAgent, start_agent, stop_agent
from tests.utils.gateway import Plane, running_plane, wait_for

AGENT_SECRET = "cloud-agent-secret"


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningAgent, RunningAgent]]:
    """Two agents in cloud role: `binary` requires a token (the backend's auth_header), `json` does not."""
    repo = build_demo_repository(tmp_path_factory.mktemp("models"))
    work = tmp_path_factory.mktemp("agents")
    first = start_agent(repo, work, intra_op_threads=1, token=AGENT_SECRET)
    try:
        second = start_agent(repo, work, intra_op_threads=1)
    except BaseException:
        stop_agent(first)
        raise
    yield first, second
    stop_agent(first)
    stop_agent(second)


@pytest.fixture(scope="module")
def plane(agents: tuple[RunningAgent, RunningAgent], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    """The control plane with both agents registered: the first takes binary tensors, the second is registered
    JSON-only, so requests to it go through the JSON translation (the agent speaks both)."""
    db = tmp_path_factory.mktemp("gw") / "gw.db"
    with running_plane(f"sqlite:///{db}", gateway_health_interval_s=1) as running:
        running.register(agents[0].url, name="cloud-binary", auth_header=f"Bearer {AGENT_SECRET}", weight=1)
        running.register(agents[1].url, name="cloud-json", binary_tensors=False, auth_header=None, weight=1)
        yield running


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 512), dtype=np.float32)


def json_request(x: np.ndarray, binary_output: bool = False) -> bytes:
    body: dict[str, Any] = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                        "data": x.ravel().tolist()}]}  # fmt: skip
    if binary_output:
        body["outputs"] = [{"name": "output", "parameters": {"binary_data": True}}]
    return orjson.dumps(body)


def binary_request(x: np.ndarray) -> tuple[bytes, int]:
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    output = triton.InferRequestedOutput("output", binary_data=True)
    body, json_size = triton.InferenceServerClient.generate_request_body([tensor], outputs=[output])
    return body, int(json_size or len(body))


def output_of(response: httpx.Response) -> np.ndarray:
    length = response.headers.get("inference-header-content-length")
    result = triton.InferenceServerClient.parse_response_body(
        response.content, header_length=int(length) if length else None
    )
    out = result.as_numpy("output")
    assert out is not None, response.text
    return np.asarray(out)


def direct(agent: RunningAgent, body: bytes, headers: dict[str, str]) -> httpx.Response:
    auth = {"Authorization": f"Bearer {AGENT_SECRET}"}
    response = httpx.post(f"{agent.url}/v2/models/mlp/infer", content=body, headers={**auth, **headers}, timeout=30)
    assert response.status_code == 200, response.text
    return response


def test_answers_equal_the_agents_own_binary_and_json(plane: Plane, agents: tuple[RunningAgent, ...]) -> None:
    x = rows(3)
    binary, json_size = binary_request(x)
    binary_headers = {"inference-header-content-length": str(json_size), "content-type": "application/octet-stream"}
    expected = output_of(direct(agents[0], binary, binary_headers))
    assert np.array_equal(output_of(direct(agents[1], json_request(x), {})), expected)  # the same model on both
    served: Counter[str] = Counter()
    for _ in range(12):
        for body, headers, binary_answer in ((binary, binary_headers, True), (json_request(x), {}, False),
                                             (json_request(x, binary_output=True), {}, True)):  # fmt: skip
            response = plane.infer(body, **headers)
            assert response.status_code == 200, response.text
            backend = response.headers["spillway-backend"]
            served[backend] += 1
            # As the client asked: binary outputs (with the JSON header's length) or pure JSON.
            assert ("inference-header-content-length" in response.headers) is binary_answer, (backend, response.headers)
            assert np.array_equal(output_of(response), expected), backend
    assert set(served) == {"cloud-binary", "cloud-json"} and min(served.values()) >= 6, served


def test_load_spreads_over_both_agents(plane: Plane) -> None:
    names = Counter(plane.infer(json_request(rows(1))).headers["spillway-backend"] for _ in range(40))
    assert names["cloud-binary"] >= 8 and names["cloud-json"] >= 8, names


def test_tritonclient_infers_through_the_gateway(plane: Plane, agents: tuple[RunningAgent, ...]) -> None:
    client = triton.InferenceServerClient(plane.url.removeprefix("http://"))
    try:
        x = rows(4, seed=3)
        tensor = triton.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        expected = output_of(direct(agents[1], json_request(x), {}))
        seen = set()
        for _ in range(10):
            result = client.infer("mlp", [tensor], headers=plane.agent,
                                  outputs=[triton.InferRequestedOutput("output", binary_data=True)])  # fmt: skip
            assert np.array_equal(result.as_numpy("output"), expected)
            seen.add(result.get_response()["model_name"])
        assert seen == {"mlp"}
        with pytest.raises(triton.InferenceServerException, match=r"\[403\] forbidden"):
            client.infer("mlp", [tensor], headers=plane.operator)  # an operator key is refused
    finally:
        client.close()


def test_an_agent_that_stops_is_taken_out_and_the_other_answers(plane: Plane, agents: tuple[RunningAgent, ...]) -> None:
    """Last: it stops the second agent. While it drains its readiness fails; once gone, connections are refused:
    either way no request is lost (retried on the other, or never sent to it), and the checks take it out."""
    stop_agent(agents[1])
    names: Counter[str] = Counter()
    for _ in range(30):
        response = plane.infer(json_request(rows(1)), **{"spillway-timeout-us": "5000000"})
        assert response.status_code == 200, response.text
        names[response.headers["spillway-backend"]] += 1
    assert names == {"cloud-binary": 30}
    wait_for(lambda: not plane.gateway()["cloud-json"]["healthy"], timeout_s=10)
    events = wait_for(lambda: [e for e in plane.events("backend.unhealthy") if e["data"]["models"] == ["mlp"]])
    assert {e["data"]["backend"] for e in events} == {"cloud-json"}
