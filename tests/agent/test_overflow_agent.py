"""The agent's side of overflow, with real processes: an edge agent overflowing to a Spillway agent in cloud role
(the gateway speaks the same V2 protocol on the same paths), and every fallback behind it when the cloud fails.

The gateway itself (backend choice, retries, ejection) is tested in tests/controlplane/test_gateway*.py; the
end-to-end story through it in tests/e2e/test_overflow_e2e.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from edge_agent.overflow.jobs import JobStore
from tests.agent.conftest import RunningAgent, start_agent, stop_agent
from tests.agent.policy_support import infer_body
from tests.utils.server import free_port

TOKEN = "cloud-and-edge-shared-token"  # the edge agent's token for the gateway, which the cloud agent requires here
X = np.random.default_rng(7).standard_normal((2, 512)).astype(np.float32)


@pytest.fixture(scope="module")
def cloud(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningAgent]:
    running = start_agent(demo_repo, tmp_path_factory.mktemp("cloud"), role="cloud", token=TOKEN, intra_op_threads=1)
    yield running
    stop_agent(running)


def edge_settings(gateway: str, **overflow: Any) -> dict[str, Any]:
    return {
        "agent_token": TOKEN,
        "intra_op_threads": 1,
        "overflow": {"enabled": True, "gateway": gateway, **overflow},
    }


def infer(agent: RunningAgent, priority: int, **kw: Any) -> httpx.Response:
    return httpx.post(f"{agent.url}/v2/models/mlp/infer", json=infer_body(X, priority=priority), timeout=30, **kw)


def outputs(response: httpx.Response) -> np.ndarray:
    out = response.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def status(agent: RunningAgent) -> dict[str, Any]:
    return dict(httpx.get(f"{agent.url}/v2/spillway/status", timeout=10).json())


def test_the_policy_overflows_low_priorities_to_the_cloud_with_the_same_answer(
    demo_repo: Path, tmp_path: Path, cloud: RunningAgent
) -> None:
    edge = start_agent(demo_repo, tmp_path, **edge_settings(cloud.url, at_or_below=3))
    try:
        local = infer(edge, 1)
        assert local.status_code == 200, local.text
        assert local.headers["spillway-outcome"] == "local"
        assert local.json()["parameters"]["spillway_outcome"] == "local"
        sent = infer(edge, 3)
        assert sent.status_code == 200, sent.text
        assert sent.headers["spillway-outcome"] == "overflow"
        assert sent.json()["parameters"]["spillway_outcome"] == "overflow"
        np.testing.assert_allclose(outputs(sent), outputs(local), rtol=1e-5, atol=1e-5)

        # Binary tensors both ways, through tritonclient: the body goes to the cloud unchanged.
        client = triton.InferenceServerClient(edge.url.removeprefix("http://"))
        tensor = triton.InferInput("input", list(X.shape), "FP32")
        tensor.set_data_from_numpy(X, binary_data=True)
        result = client.infer("mlp", [tensor], outputs=[triton.InferRequestedOutput("output", binary_data=True)],
                              priority=3)  # fmt: skip
        np.testing.assert_allclose(result.as_numpy("output"), outputs(local), rtol=1e-5, atol=1e-5)
        assert result.get_response()["parameters"]["spillway_outcome"] == "overflow"

        seen = status(edge)
        assert seen["overflow"]["answered"] == 2 and seen["overflow"]["breaker"]["state"] == "closed"
        auth = {"authorization": f"Bearer {TOKEN}"}
        stats = httpx.get(f"{cloud.url}/v2/models/mlp/stats", headers=auth, timeout=10).json()["model_stats"]
        assert sum(s["inference_count"] for s in stats) >= 4  # the two overflowed requests, 2 rows each
    finally:
        stop_agent(edge)


def test_when_the_cloud_is_gone_the_fallback_chain_answers_and_the_breaker_opens(
    demo_repo: Path, tmp_path: Path
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens: every overflow fails to connect
    edge = start_agent(
        demo_repo, tmp_path,
        **edge_settings(nowhere, at_or_below=3, default_outputs={}, breaker={"min_requests": 3, "open_s": 60}),
    )  # fmt: skip
    try:
        local = infer(edge, 1)  # fills the fallback cache for X
        assert local.headers["spillway-outcome"] == "local"
        cached = infer(edge, 3)
        assert cached.status_code == 200, cached.text
        assert cached.headers["spillway-outcome"] == "fallback_cache"
        assert cached.headers["spillway-reason"] == "gateway_unreachable"
        np.testing.assert_array_equal(outputs(cached), outputs(local))

        other = httpx.post(f"{edge.url}/v2/models/mlp/infer", json=infer_body(X[:1] + 1, priority=3), timeout=30)
        assert other.status_code == 503, other.text  # not cached, no default, no async queue
        assert other.json() == {"error": other.json()["error"], "reason": other.headers["spillway-reason"],
                                "outcome": "rejected"}  # fmt: skip
        assert other.headers["spillway-outcome"] == "rejected" and "retry-after" in other.headers

        for _ in range(3):
            infer(edge, 3)
        seen = status(edge)
        assert seen["overflow"]["breaker"]["state"] == "open"
        short = infer(edge, 3)
        assert short.headers["spillway-outcome"] == "fallback_cache"
        assert short.headers["spillway-reason"] == "breaker_open"
        outcomes = {(o["priority"], o["outcome"]): o["count"] for o in _outcomes(edge)}
        assert outcomes[(1, "local")] == 1 and outcomes[(3, "rejected")] == 1
        assert outcomes[(3, "fallback_cache")] == 5
    finally:
        stop_agent(edge)


def test_default_outputs_then_the_async_queue_answer_when_nothing_is_cached(demo_repo: Path, tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    default = [{"name": "output", "shape": [1, 1000], "datatype": "FP32", "data": [0.25] * 1000}]
    edge = start_agent(demo_repo, tmp_path, fallback_cache_bytes=0,
                       **edge_settings(nowhere, at_or_below=2, default_outputs={"mlp": default}))  # fmt: skip
    try:
        answer = infer(edge, 2)
        assert answer.status_code == 200, answer.text
        assert answer.headers["spillway-outcome"] == "fallback_default"
        assert answer.json()["parameters"]["spillway_outcome"] == "fallback_default"
        assert outputs(answer).shape == (2, 1000) and np.all(outputs(answer) == 0.25)
    finally:
        stop_agent(edge)

    queued = start_agent(demo_repo, tmp_path, fallback_cache_bytes=0, async_jobs={"models": ["mlp"]},
                         **edge_settings(nowhere, at_or_below=2))  # fmt: skip
    try:
        accepted = infer(queued, 2)
        assert accepted.status_code == 202, accepted.text
        assert accepted.headers["spillway-outcome"] == "queued_async"
        job_id = accepted.json()["id"]
        assert accepted.headers["location"] == f"/spillway/v1/jobs/{job_id}"
        job = queued.ended_job(job_id)
        assert job["status"] == "done", job
        assert job["response"]["parameters"]["spillway_outcome"] == "queued_async"
        local = infer(queued, 1)
        np.testing.assert_allclose(
            np.asarray(job["response"]["outputs"][0]["data"], dtype=np.float32).reshape(2, 1000), outputs(local),
            rtol=1e-5, atol=1e-5,
        )  # fmt: skip
        missing = httpx.get(f"{queued.url}/spillway/v1/jobs/no-such-job", timeout=10)
        assert missing.status_code == 404 and "no-such-job" in missing.json()["error"]
        counted = {(o["priority"], o["outcome"]): o["count"] for o in _outcomes(queued)}
        assert counted == {(2, "queued_async"): 1, (1, "local"): 1}  # the job's later run is not a second request
    finally:
        stop_agent(queued)


def test_a_job_accepted_before_a_restart_is_run_after_it(demo_repo: Path, tmp_path: Path) -> None:
    """The store is on disk: a job accepted (and then the agent killed before it ran) is served by the next agent."""
    state = tmp_path / "state"
    state.mkdir()
    settings = {"agent_id": "edge-1", "state_dir": str(state), "async_jobs": {"models": ["mlp"]}}
    with JobStore(state / "jobs-edge-1.sqlite") as store:
        job = store.submit("mlp", None, httpx.Request("POST", "/", json=infer_body(X)).read(), None)
        claimed = store.claim()  # it was running when the agent died
        assert claimed is not None and claimed.id == job.id
    agent = start_agent(demo_repo, tmp_path, **settings)
    try:
        finished = agent.ended_job(job.id)
        assert finished["status"] == "done" and finished["attempts"] == 2
    finally:
        stop_agent(agent)


def test_a_cloud_agent_refuses_to_overflow_and_bad_overflow_settings_are_refused(
    demo_repo: Path, tmp_path: Path
) -> None:
    from edge_agent.config import AgentConfig

    with pytest.raises(ValueError, match="role cloud"):
        AgentConfig(model_repository=demo_repo, role="cloud", overflow={"enabled": True, "gateway": "http://x"},
                    agent_token="t")  # fmt: skip
    with pytest.raises(ValueError, match=r"overflow\.enabled needs a gateway"):
        AgentConfig(model_repository=demo_repo, overflow={"enabled": True})
    with pytest.raises(ValueError, match="fraction"):
        AgentConfig(model_repository=demo_repo, overflow={"fraction": 2})
    bad = {"mlp": [{"name": "nope", "shape": [1000], "datatype": "FP32", "data": [0.0] * 1000}]}
    config = tmp_path / "bad.yaml"
    import subprocess
    import sys

    import yaml

    config.write_text(yaml.safe_dump({"model_repository": str(demo_repo), "overflow": {"default_outputs": bad}}))
    done = subprocess.run([sys.executable, "-m", "spillway.cli", "agent", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert "overflow.default_outputs['mlp']" in done.stderr + done.stdout and "nope" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def _outcomes(agent: RunningAgent) -> list[dict[str, Any]]:
    """Outcome counts per priority over every version of mlp."""
    merged: dict[tuple[int, str], int] = {}
    for item in status(agent)["outcomes"]:
        key = (item["priority"], item["outcome"])
        merged[key] = merged.get(key, 0) + item["count"]
    return [{"priority": p, "outcome": o, "count": c} for (p, o), c in merged.items()]


def test_a_full_async_queue_refuses_with_503_and_says_so(demo_repo: Path, tmp_path: Path) -> None:
    """The queue is bounded: with it full (one job of a model this agent does not serve, which never drains), a
    request that nothing else can answer gets 503, not a job."""
    state = tmp_path / "state"
    state.mkdir()
    with JobStore(state / "jobs-edge-2.sqlite", max_jobs=1) as store:
        store.submit("a-model-served-elsewhere", None, b"{}", None)
    nowhere = f"http://127.0.0.1:{free_port()}"
    agent = start_agent(demo_repo, tmp_path, agent_id="edge-2", state_dir=str(state), fallback_cache_bytes=0,
                        async_jobs={"models": ["mlp"], "max_jobs": 1},
                        **edge_settings(nowhere, at_or_below=2))  # fmt: skip
    try:
        refused = infer(agent, 2)
        assert refused.status_code == 503, refused.text
        assert refused.headers["spillway-outcome"] == "rejected"
        assert refused.headers["spillway-reason"] == "gateway_unreachable" and "retry-after" in refused.headers
        assert "async queue is full" in refused.json()["error"]
        assert status(agent)["async_jobs"]["counts"]["queued"] == 1
    finally:
        stop_agent(agent)


def test_an_error_of_ours_in_the_fallback_chain_is_an_error_outcome_with_json_never_a_bare_500(
    demo_repo: Path, tmp_path: Path
) -> None:
    """In process, with the real app: the async queue's store closed under it (a real sqlite3.ProgrammingError, a
    bug rather than a state of the disk) makes the chain's last step raise; the client still gets one answer that
    says `error`, and the agent counts it."""
    from edge_agent.config import AgentConfig
    from edge_agent.serving.server import build_agent, build_registry

    nowhere = f"http://127.0.0.1:{free_port()}"
    config = AgentConfig(model_repository=demo_repo, state_dir=tmp_path / "state", fallback_cache_bytes=0,
                         async_jobs={"models": ["mlp"]},
                         **edge_settings(nowhere, at_or_below=2))  # fmt: skip
    agent = build_agent(config, build_registry(config))
    assert agent.jobs is not None and agent.forwarder is not None
    agent.jobs.store.close()

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=agent.app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://agent", timeout=60) as client:
            try:
                return [await client.post("/v2/models/mlp/infer", json=infer_body(X, priority=p)) for p in (2, 2, 1)]
            finally:
                assert agent.forwarder is not None
                await agent.forwarder.close()

    try:
        broken, again, local = asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        agent.close()
    for answer in (broken, again):
        assert answer.status_code == 500, answer.text
        assert answer.headers["spillway-outcome"] == "error"
        assert answer.json() == {"error": "internal error; see the agent log", "outcome": "error"}
    assert local.status_code == 200 and local.headers["spillway-outcome"] == "local"
    counted: dict[tuple[int, str], int] = {}
    for model in agent.registry.all():
        for key, count in model.worker.stats.outcomes.items():
            counted[key] = counted.get(key, 0) + count
    assert counted == {(2, "error"): 2, (1, "local"): 1}
