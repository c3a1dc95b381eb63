"""Applying policy documents to a running agent, in process: real onnxruntime models, the real app (through
httpx's ASGI transport, on the same event loop as the applier), the real applier. Shed and fallback at admission,
live batching parameters, variant switches (with loads, drains and unloads), refusals, telemetry."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from edge_agent.config import AgentConfig
from edge_agent.overflow.fallback import ResponseCache, inputs_key
from edge_agent.serving.server import Agent, build_agent, build_registry
from edge_agent.telemetry import AgentTelemetry, LiveTelemetry, TelemetrySettings
from spillway.contract.policy import PolicyDocument
from tests.agent.policy_support import AGENT_ID, default_output, document, infer_body, make_repository

RNG = np.random.default_rng(11)
SCENARIO_LIMIT_S = 120
T = TypeVar("T")


@pytest.fixture(scope="module")
def lite_repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only the lite version (2) served: quick to load."""
    return make_repository(demo_repo, tmp_path_factory.mktemp("lite"), versions=(2,))


@pytest.fixture(scope="module")
def v1_repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only version 1 served, version 2 on disk (a variant), no default deadlines."""
    return make_repository(demo_repo, tmp_path_factory.mktemp("v1"), versions=(1,), deadlines=False)


@pytest.fixture(scope="module")
def both_repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repository(demo_repo, tmp_path_factory.mktemp("both"), versions=(1, 2), deadlines=False)


def make_agent(repo: Path, tmp_path: Path, **settings: Any) -> Agent:
    settings.setdefault("agent_id", AGENT_ID)
    config = AgentConfig(model_repository=repo, intra_op_threads=1, state_dir=tmp_path / "state", **settings)
    return build_agent(config, build_registry(config))


def run(agent: Agent, scenario: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    """Run `scenario` with a client of the agent's app, on one event loop with the applier; close the agent after."""

    async def main() -> T:
        transport = httpx.ASGITransport(app=agent.app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://agent", timeout=60) as client:
            try:  # a generous bound, so that a request that is never answered fails the test instead of hanging it
                return await asyncio.wait_for(scenario(client), SCENARIO_LIMIT_S)
            finally:
                await agent.applier.close()

    try:
        return asyncio.run(main())
    finally:
        agent.close()


def apply(agent: Agent, body: dict[str, Any]) -> Awaitable[bool]:
    return agent.applier.apply(PolicyDocument.model_validate(body), "control_plane", f'"{body["version"]}"')


def outcomes(agent: Agent, version: int) -> dict[tuple[int, str], int]:
    model = agent.registry.loaded("mlp", version)
    assert model is not None
    return dict(model.worker.stats.outcomes)


def reference(repo: Path, version: int, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(repo / "mlp" / str(version) / "model.onnx"), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"input": x})[0])


def output(response: httpx.Response) -> np.ndarray:
    out = response.json()["outputs"][0]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


# ---- shed and fallback at admission ---------------------------------------------------------------------


def test_shed_refuses_levels_at_or_below_with_503_retry_after_and_counts_them(lite_repo: Path, tmp_path: Path) -> None:
    agent = make_agent(lite_repo, tmp_path)
    x = RNG.standard_normal((1, 512), dtype=np.float32)

    async def scenario(c: httpx.AsyncClient) -> None:
        assert await apply(agent, document(1, mlp={"shed": {"at_or_below": 2, "retry_after_s": 7}}))
        assert (await c.post("/v2/models/mlp/infer", json=infer_body(x, priority=1))).status_code == 200
        for priority in (2, 3, 0):  # 0: the model's default level, 2
            r = await c.post("/v2/models/mlp/infer", json=infer_body(x, priority=priority))
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "7"
            assert r.headers["spillway-outcome"] == "rejected" and r.headers["spillway-reason"] == "shed"
            assert r.json()["reason"] == "shed" and "shed" in r.json()["error"]
        # Recovery: a document without shed serves every level again.
        assert await apply(agent, document(2))
        assert (await c.post("/v2/models/mlp/infer", json=infer_body(x, priority=3))).status_code == 200

    run(agent, scenario)
    assert outcomes(agent, 2) == {(1, "local"): 1, (2, "rejected"): 2, (3, "rejected"): 1, (3, "local"): 1}
    model = agent.registry.loaded("mlp", 2)
    assert model is not None and model.worker.stats.execution_count == 2  # shed requests never ran


def test_fallback_default_answers_with_the_documents_outputs_and_says_so(lite_repo: Path, tmp_path: Path) -> None:
    agent = make_agent(lite_repo, tmp_path)
    x = RNG.standard_normal((3, 512), dtype=np.float32)
    fallback = {"at_or_below": 3, "mode": "default", "default_outputs": default_output(0.25, (1, 1000))}

    async def scenario(c: httpx.AsyncClient) -> None:
        assert await apply(agent, document(1, all={"fallback": fallback}))
        r = await c.post("/v2/models/mlp/infer", json={**infer_body(x, priority=3), "id": "q7"})
        assert r.status_code == 200, r.text
        assert r.headers["spillway-outcome"] == "fallback_default"
        body = r.json()
        assert (
            body["parameters"] == {"spillway_outcome": "fallback_default", "spillway_fallback": "default"}
            and body["id"] == "q7"
        )
        assert body["model_name"] == "mlp" and body["model_version"] == "2"
        np.testing.assert_array_equal(output(r), np.full((3, 1000), 0.25, np.float32))  # one row per input row
        # Binary outputs work for fallbacks too.
        binary_body = infer_body(x[:1], priority=3, binary_data_output=True)
        binary = await c.post("/v2/models/mlp/infer", json=binary_body)
        assert binary.status_code == 200 and binary.headers["spillway-outcome"] == "fallback_default"
        length = int(binary.headers["inference-header-content-length"])
        np.testing.assert_array_equal(np.frombuffer(binary.content[length:], np.float32), np.full(1000, 0.25))
        served = await c.post("/v2/models/mlp/infer", json=infer_body(x, priority=2))
        assert served.headers["spillway-outcome"] == "local" and served.json()["parameters"] == {
            "spillway_outcome": "local"
        }

    run(agent, scenario)
    assert outcomes(agent, 2) == {(3, "fallback_default"): 2, (2, "local"): 1}
    model = agent.registry.loaded("mlp", 2)
    assert model is not None and model.worker.stats.execution_count == 1


def test_fallback_cache_serves_the_last_answer_to_the_same_inputs_and_refuses_a_miss(
    lite_repo: Path, tmp_path: Path
) -> None:
    agent = make_agent(lite_repo, tmp_path)
    x, y = (RNG.standard_normal((2, 512), dtype=np.float32) for _ in range(2))

    async def scenario(c: httpx.AsyncClient) -> tuple[np.ndarray, np.ndarray]:
        first = await c.post("/v2/models/mlp/infer", json=infer_body(x, priority=1))  # fills the cache
        assert first.headers["spillway-outcome"] == "local"
        assert await apply(agent, document(1, mlp={"fallback": {"at_or_below": 2, "mode": "cache"}}))
        hit = await c.post("/v2/models/mlp/infer", json=infer_body(x, priority=3))
        assert hit.status_code == 200, hit.text
        assert hit.headers["spillway-outcome"] == "fallback_cache"
        assert (
            hit.json()["parameters"] == {"spillway_outcome": "fallback_cache", "spillway_fallback": "cache"}
            and hit.json()["model_version"] == "2"
        )
        miss = await c.post("/v2/models/mlp/infer", json=infer_body(y, priority=2))
        assert miss.status_code == 503 and miss.headers["spillway-reason"] == "fallback_miss"
        assert miss.headers["spillway-outcome"] == "rejected" and miss.headers["retry-after"] == "5"
        return output(first), output(hit)

    first, hit = run(agent, scenario)
    np.testing.assert_array_equal(hit, first)
    assert outcomes(agent, 2) == {(1, "local"): 1, (3, "fallback_cache"): 1, (2, "rejected"): 1}
    model = agent.registry.loaded("mlp", 2)
    assert model is not None and model.worker.stats.execution_count == 1


def test_where_shed_and_fallback_both_cover_a_level_the_fallback_answers(lite_repo: Path, tmp_path: Path) -> None:
    agent = make_agent(lite_repo, tmp_path)
    x = RNG.standard_normal((1, 512), dtype=np.float32)
    policy = {"shed": {"at_or_below": 2}, "fallback": {"at_or_below": 3, "mode": "default",
                                                       "default_outputs": default_output(1.0)}}  # fmt: skip

    async def scenario(c: httpx.AsyncClient) -> list[str]:
        assert await apply(agent, document(1, mlp=policy))
        responses = [await c.post("/v2/models/mlp/infer", json=infer_body(x, priority=p)) for p in (1, 2, 3)]
        return [r.headers["spillway-outcome"] + "/" + r.headers.get("spillway-reason", "") for r in responses]

    assert run(agent, scenario) == ["local/", "rejected/shed", "fallback_default/"]


def test_the_response_cache_is_bounded_by_bytes_and_evicts_the_least_recently_used() -> None:
    row = np.zeros((1, 1000), np.float32)  # 4000 bytes of output per entry, plus the entry's overhead
    cache = ResponseCache(3 * 4300)
    keys = [inputs_key("mlp", 1, {"input": np.full((1, 4), float(i), np.float32)}) for i in range(5)]
    assert len(set(keys)) == 5
    assert inputs_key("mlp", 2, {"input": np.full((1, 4), 0.0, np.float32)}) != keys[0]  # the version counts
    assert inputs_key("mlp", 1, {"input": np.full((1, 4), 0.0, np.float64)}) != keys[0]  # so does the dtype
    for key in keys[:3]:
        assert cache.put(key, {"output": row})
    assert cache.get(keys[0]) is not None  # now the most recently used
    cache.put(keys[3], {"output": row})  # evicts keys[1], the least recently used
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None and cache.get(keys[3]) is not None
    assert len(cache) == 3 and cache.bytes <= cache.capacity_bytes
    assert not cache.put(keys[4], {"output": np.zeros((4, 1000), np.float32)})  # larger than the whole cache
    batch = np.arange(8000, dtype=np.float32).reshape(2, 4000)
    cache.put(keys[4], {"output": batch[:1, :1000]})  # a view into a batch's output is copied, not kept
    kept = cache.get(keys[4])
    assert kept is not None and kept["output"].base is None and not kept["output"].flags.writeable
    with pytest.raises(ValueError):
        ResponseCache(-1)


# ---- batching -----------------------------------------------------------------------------------------


def test_batching_parameters_change_live_and_null_restores_the_configured_ones(lite_repo: Path, tmp_path: Path) -> None:
    agent = make_agent(lite_repo, tmp_path)
    model = agent.registry.loaded("mlp", 2)
    assert model is not None
    scheduler = model.worker.scheduler

    async def scenario(c: httpx.AsyncClient) -> list[dict[str, Any]]:
        seen = []
        assert await apply(agent, document(1, mlp={"max_queue_delay_us": 500, "preferred_batch_sizes": [4, 8, 4]}))
        assert scheduler.config.max_queue_delay_s == 0.0005 and scheduler.config.preferred_batch_sizes == (4, 8)
        seen.append((await c.get("/v2/spillway/status")).json()["models"]["mlp"]["batching"])
        assert await apply(agent, document(2, all={"max_queue_delay_us": 0}))  # `*` entry, preferred as configured
        assert scheduler.config.max_queue_delay_s == 0 and scheduler.config.preferred_batch_sizes == (8, 16, 32)
        assert await apply(agent, document(3))
        seen.append((await c.get("/v2/spillway/status")).json()["models"]["mlp"]["batching"])
        return seen

    tuned, restored = run(agent, scenario)
    assert tuned == {"max_queue_delay_us": 500, "preferred_batch_sizes": [4, 8], "from_policy": True}
    assert restored == {"max_queue_delay_us": 2000, "preferred_batch_sizes": [8, 16, 32], "from_policy": False}
    assert scheduler.config == scheduler.base_config


# ---- variants -----------------------------------------------------------------------------------------


def test_a_variant_serves_requests_without_a_version_and_for_the_default_one(both_repo: Path, tmp_path: Path) -> None:
    agent = make_agent(both_repo, tmp_path, default_versions={"mlp": 1})
    x = RNG.standard_normal((1, 512), dtype=np.float32)

    async def served(c: httpx.AsyncClient, path: str) -> tuple[str, str | None, np.ndarray]:
        r = await c.post(path, json=infer_body(x))
        assert r.status_code == 200, r.text
        return r.json()["model_version"], r.headers.get("spillway-variant"), output(r)

    async def scenario(c: httpx.AsyncClient) -> dict[str, list[tuple[str, str | None]]]:
        paths = ("/v2/models/mlp/infer", "/v2/models/mlp/versions/1/infer", "/v2/models/mlp/versions/2/infer")
        seen: dict[str, list[tuple[str, str | None]]] = {}
        for phase, body in (("before", document(1)), ("variant", document(2, mlp={"variant": 2})),
                            ("reverted", document(3))):  # fmt: skip
            assert await apply(agent, body)
            results = [await served(c, path) for path in paths]
            for version, _, out in results:
                np.testing.assert_allclose(out, reference(both_repo, int(version), x), rtol=1e-5, atol=1e-5)
            seen[phase] = [(version, header) for version, header, _ in results]
            assert agent.registry.versions("mlp") == [1, 2]  # both configured: nothing loads or unloads
        return seen

    seen = run(agent, scenario)
    assert seen["before"] == [("1", None), ("1", None), ("2", None)]
    assert seen["variant"] == [("2", "2"), ("2", "2"), ("2", None)]  # the header says when a variant redirected
    assert seen["reverted"] == seen["before"]


def test_a_variant_is_loaded_beside_traffic_moves_over_and_the_old_version_unloads_after_its_queue(
    v1_repo: Path, tmp_path: Path
) -> None:
    agent = make_agent(v1_repo, tmp_path)
    xs = RNG.standard_normal((64, 1, 512), dtype=np.float32)
    assert agent.registry.versions("mlp") == [1]
    v1 = agent.registry.loaded("mlp", 1)
    assert v1 is not None
    Result = tuple[int, str, str | None]

    async def post(c: httpx.AsyncClient, path: str, x: np.ndarray) -> Result:
        r = await c.post(path, json=infer_body(x))
        return r.status_code, r.json().get("model_version", r.text), r.headers.get("spillway-variant")

    async def scenario(c: httpx.AsyncClient) -> tuple[list[Result], list[Result], list[Any]]:
        snapshots: list[Any] = []
        # A 10 s batch window holds requests in version 1's queue, so that the switch happens while they wait.
        assert await apply(agent, document(1, mlp={"max_queue_delay_us": 10_000_000, "preferred_batch_sizes": [64]}))
        paths = ["/v2/models/mlp/infer", "/v2/models/mlp/versions/1/infer"] * 4
        queued = [asyncio.create_task(post(c, path, xs[i])) for i, path in enumerate(paths)]
        while sum(v1.worker.scheduler.depth()) < len(queued):
            await asyncio.sleep(0.001)
        assert await apply(agent, document(2, mlp={"variant": 2}))
        # Committed: version 1 left routing at once but still holds its queue, which it answers before it closes.
        snapshots.append((agent.registry.versions("mlp"), [m.version for m in agent.registry.retiring],
                          v1.worker.scheduler.idle))  # fmt: skip
        after = [await post(c, path, xs[9]) for path in paths[:2]]
        snapshots.append((await c.get("/v2/spillway/status")).json()["models"]["mlp"])
        early = await asyncio.gather(*queued)
        while agent.registry.retiring:
            await asyncio.sleep(0.01)
        snapshots.append(agent.registry.versions("mlp"))

        # Revert under continuous load: version 1 loads again beside version 2, which unloads after its queue.
        continuous: list[Result] = []
        stop = asyncio.Event()

        async def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                continuous.append(await post(c, paths[n % 2], xs[(i * 7 + n) % 64]))
                n += 1

        clients = [asyncio.create_task(client(i)) for i in range(8)]
        while len(continuous) < 16:
            await asyncio.sleep(0.01)
        assert await apply(agent, document(3))
        while agent.registry.retiring:
            await asyncio.sleep(0.01)
        snapshots.append(agent.registry.versions("mlp"))
        count = len(continuous)
        while len(continuous) < count + 16:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.gather(*clients)
        return list(early) + after, continuous, snapshots

    switched, continuous, snapshots = run(agent, scenario)
    assert snapshots[0] == ([2], [1], False)
    assert switched[:8] == [(200, "1", None)] * 8  # queued at version 1 before the switch: answered by version 1
    assert switched[8:] == [(200, "2", "2")] * 2  # new traffic: the variant, and the header says so
    status = snapshots[1]
    assert status["variant"] == 2 and status["served_version"] == 2 and status["default_version"] == 1
    assert status["loaded_versions"] == [2] and status["retiring_versions"] == [1]
    assert snapshots[2] == [2] and snapshots[3] == [1]
    assert v1.worker.scheduler.draining  # the old instance was drained and closed, not left running
    assert all(status == 200 for status, _, _ in continuous), [r for r in continuous if r[0] != 200][:3]
    assert {(version, header) for _, version, header in continuous} == {("1", None), ("2", "2")}
    assert continuous[-1] == (200, "1", None)


def test_a_variant_that_would_not_fit_in_memory_is_refused_and_the_last_good_policy_stays(
    v1_repo: Path, tmp_path: Path
) -> None:
    agent = make_agent(v1_repo, tmp_path, load_headroom_bytes=1 << 50)  # no device keeps a petabyte free
    x = RNG.standard_normal((1, 512), dtype=np.float32)

    async def scenario(c: httpx.AsyncClient) -> tuple[dict[str, Any], httpx.Response, httpx.Response]:
        assert await apply(agent, document(4, mlp={"shed": {"at_or_below": 3}}))
        assert not await apply(agent, document(5, mlp={"variant": 2}))
        status = (await c.get("/v2/spillway/status")).json()
        served = await c.post("/v2/models/mlp/infer", json=infer_body(x, priority=1))
        shed = await c.post("/v2/models/mlp/infer", json=infer_body(x, priority=3))
        return status, served, shed

    status, served, shed = run(agent, scenario)
    assert status["policy"]["version"] == 4 and status["policy"]["source"] == "control_plane"
    assert status["refusals"] == 1
    refusal = status["last_refusal"]
    assert refusal["version"] == 5 and refusal["source"] == "control_plane"
    assert "cannot load v2" in refusal["message"] and "host memory" in refusal["message"]
    assert status["models"]["mlp"]["loaded_versions"] == [1] and status["models"]["mlp"]["variant"] is None
    assert served.json()["model_version"] == "1" and "spillway-variant" not in served.headers
    assert shed.headers["spillway-reason"] == "shed"  # version 4's shed is still in force


def _default(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"fallback": {"at_or_below": 2, "mode": "default", "default_outputs": outputs}}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"variant": 9}, "no version 9"),
        ({"preferred_batch_sizes": [16, 128]}, "exceed the model's max_batch_size"),
        (_default(default_output(name="logits")), "no output 'logits'"),
        (_default(default_output(shape=(999,))), "needs shape [1000] or [1, 1000]"),
        (_default(default_output(datatype="INT32", data=[1] * 1000)), "is FP32, not INT32"),
        (_default(default_output(data=[1.0] * 7)), "default output 'output'"),
        (_default(default_output() * 2), "given twice"),
    ],
    ids=["variant", "batch-size", "output-name", "output-shape", "output-datatype", "output-data", "output-twice"],
)
def test_documents_that_do_not_fit_the_served_models_are_refused(
    lite_repo: Path, tmp_path: Path, entry: dict[str, Any], message: str
) -> None:
    agent = make_agent(lite_repo, tmp_path)

    async def scenario(c: httpx.AsyncClient) -> dict[str, Any]:
        assert await apply(agent, document(1, mlp={"shed": {"at_or_below": 3}}))
        assert not await apply(agent, document(2, mlp=entry))
        return dict((await c.get("/v2/spillway/status")).json())

    status = run(agent, scenario)
    assert status["policy"]["version"] == 1 and status["models"]["mlp"]["shed"]["at_or_below"] == 3
    assert status["refusals"] == 1 and message in status["last_refusal"]["message"], status["last_refusal"]
    assert status["models"]["mlp"]["loaded_versions"] == [2]


def test_a_document_for_another_agent_is_refused(lite_repo: Path, tmp_path: Path) -> None:
    agent = make_agent(lite_repo, tmp_path)

    async def scenario(c: httpx.AsyncClient) -> bool:
        return await apply(agent, document(1, agent="edge-other", mlp={"shed": {"at_or_below": 1}}))

    assert not run(agent, scenario)
    assert agent.applier.plan.source == "local" and agent.applier.last_refusal is not None
    assert "for agent 'edge-other', not 'edge-test-1'" in agent.applier.last_refusal.message


def test_entries_for_models_the_agent_does_not_serve_are_ignored(lite_repo: Path, tmp_path: Path) -> None:
    agent = make_agent(lite_repo, tmp_path)

    async def scenario(c: httpx.AsyncClient) -> bool:
        return await apply(agent, document(1, resnet={"variant": 3}, mlp={"shed": {"at_or_below": 3}}))

    assert run(agent, scenario)
    assert agent.applier.plan.version == 1 and set(agent.applier.plan.models) == {"mlp"}


# ---- telemetry and status -----------------------------------------------------------------------------


def test_refusals_and_the_active_version_are_metrics_and_new_buckets_rebuild_telemetry(
    lite_repo: Path, tmp_path: Path
) -> None:
    agent = make_agent(lite_repo, tmp_path)
    readers: list[InMemoryMetricReader] = []
    made: list[AgentTelemetry] = []

    def factory(settings: TelemetrySettings) -> AgentTelemetry:
        readers.append(InMemoryMetricReader())
        made.append(AgentTelemetry(settings, readers=[readers[-1]], probes=False))
        return made[-1]

    applier = agent.applier
    applier.telemetry = agent.telemetry = LiveTelemetry(
        TelemetrySettings(agent_id="edge-test-1"), agent.registry, factory=factory,
        policy=lambda: (applier.plan.version or 0, applier.plan.source),
    )  # fmt: skip
    x = RNG.standard_normal((1, 512), dtype=np.float32)

    def points(reader: InMemoryMetricReader, name: str) -> list[Any]:
        data = reader.get_metrics_data()
        assert data is not None
        return [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                if m.name == name for p in m.data.data_points]  # fmt: skip

    async def scenario(c: httpx.AsyncClient) -> None:
        (gauge,) = points(readers[0], "spillway.policy.version")
        assert gauge.value == 0 and gauge.attributes == {"spillway.policy.source": "local"}
        assert not await apply(agent, document(1, mlp={"variant": 7}))
        (refused,) = points(readers[0], "spillway.policy.refusals")
        assert refused.value == 1 and refused.attributes == {"spillway.policy.source": "control_plane"}
        assert await apply(agent, {**document(2), "latency_buckets_ms": [3, 30], "export_interval_s": 2})
        assert len(made) == 2 and made[0]._closed  # the old pipeline was flushed and shut down
        await c.post("/v2/models/mlp/infer", json=infer_body(x, priority=1))
        (duration,) = points(readers[1], "spillway.request.duration")
        assert list(duration.explicit_bounds) == [0.003, 0.03]
        (gauge,) = points(readers[1], "spillway.policy.version")
        assert gauge.value == 2 and gauge.attributes == {"spillway.policy.source": "control_plane"}
        fallback = {"at_or_below": 3, "mode": "default", "default_outputs": default_output()}
        same_telemetry = {"latency_buckets_ms": [3, 30], "export_interval_s": 2}
        assert await apply(agent, {**document(3, mlp={"shed": {"at_or_below": 2}, "fallback": fallback}),
                                   **same_telemetry})  # fmt: skip
        assert len(made) == 2  # unchanged settings: the pipeline stays
        for priority in (2, 3):
            await c.post("/v2/models/mlp/infer", json=infer_body(x, priority=priority))
        counted = {(p.attributes["spillway.priority"], p.attributes["spillway.outcome"]): p.value
                   for p in points(readers[1], "spillway.requests")}  # fmt: skip
        assert counted == {(1, "local"): 1, (2, "rejected"): 1, (3, "fallback_default"): 1}
        status = (await c.get("/v2/spillway/status")).json()
        assert status["telemetry"] == {"export_interval_s": 2, "latency_buckets_ms": [3, 30]}

    run(agent, scenario)


def test_the_status_endpoint_needs_the_same_token_as_the_rest_of_the_api(lite_repo: Path, tmp_path: Path) -> None:
    agent = make_agent(lite_repo, tmp_path, token="s3cret", agent_id="edge-test-1")

    async def scenario(c: httpx.AsyncClient) -> tuple[int, dict[str, Any]]:
        denied = await c.get("/v2/spillway/status")
        allowed = await c.get("/v2/spillway/status", headers={"Authorization": "Bearer s3cret"})
        return denied.status_code, allowed.json()

    denied, status = run(agent, scenario)
    assert denied == 401
    assert status["agent_id"] == "edge-test-1" and status["ready"] is True
    assert status["policy"] == {"version": None, "source": "local", "etag": None, "agent": None, "applied_at": None,
                                "causes": []}  # fmt: skip
    assert status["poll"] is None and status["last_refusal"] is None and status["refusals"] == 0
    assert status["models"]["mlp"] == {
        "default_version": 2, "served_version": 2, "variant": None, "loaded_versions": [2], "retiring_versions": [],
        "transition": None, "shed": None, "fallback": None,
        "batching": {"max_queue_delay_us": 2000, "preferred_batch_sizes": [8, 16, 32], "from_policy": False},
    }  # fmt: skip
    assert status["fallback_cache"]["capacity_bytes"] == 8 << 20


def test_default_versions_must_name_served_versions(lite_repo: Path) -> None:
    from edge_agent.runtime.config import ModelConfigError

    for defaults, message in (({"mlp": 1}, "default version 1 of model 'mlp' is not served (served: [2])"),
                              ({"resnet": 1}, "no model(s) ['resnet']")):  # fmt: skip
        with pytest.raises(ModelConfigError, match=re.escape(message)):
            build_registry(AgentConfig(model_repository=lite_repo, intra_op_threads=1, default_versions=defaults))


# ---- models loaded and unloaded through the repository extension ----------------------------------------


def test_a_reload_keeps_the_policys_variant_and_the_next_document_sees_the_reloaded_config(
    demo_repo: Path, tmp_path: Path
) -> None:
    repo = make_repository(demo_repo, tmp_path / "repo", versions=(1,), deadlines=False)  # v2 on disk: a variant
    agent = make_agent(repo, tmp_path)
    config = repo / "mlp" / "config.pbtxt"
    x = RNG.standard_normal((1, 512), dtype=np.float32)

    async def served(c: httpx.AsyncClient) -> tuple[str, str | None]:
        r = await c.post("/v2/models/mlp/infer", json=infer_body(x))
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(output(r), reference(repo, int(r.json()["model_version"]), x), rtol=1e-5, atol=1e-5)
        return r.json()["model_version"], r.headers.get("spillway-variant")

    async def settled() -> None:
        while agent.registry.retiring:  # the versions replaced answer their queues, then close
            await asyncio.sleep(0.01)

    async def scenario(c: httpx.AsyncClient) -> None:
        assert await apply(agent, document(1, mlp={"variant": 2}))
        await settled()
        assert agent.registry.versions("mlp") == [2] and await served(c) == ("2", "2")
        config.write_text(config.read_text().replace("max_batch_size: 64", "max_batch_size: 128"))
        reloaded = await c.post("/v2/repository/models/mlp/load")
        assert reloaded.status_code == 200, reloaded.text
        assert reloaded.json()["versions"] == ["2"]  # the variant, in place of the default, as the policy had it
        await settled()
        assert await served(c) == ("2", "2")  # the policy's variant still serves after the reload
        status = (await c.get("/v2/spillway/status")).json()["models"]["mlp"]
        assert (status["default_version"], status["variant"], status["loaded_versions"]) == (1, 2, [2])
        # The next document is checked against the config as reloaded (128 rows now, 64 at start).
        bigger = document(2, mlp={"variant": 2, "preferred_batch_sizes": [128]})
        assert await apply(agent, bigger), agent.applier.last_refusal
        assert await apply(agent, document(3))  # reverting loads v1 again, with the reloaded config
        await settled()
        assert agent.registry.versions("mlp") == [1] and await served(c) == ("1", None)
        v1 = agent.registry.loaded("mlp", 1)
        assert v1 is not None and v1.config.max_batch_size == 128

    run(agent, scenario)


def test_a_model_loaded_after_start_follows_the_active_policy_and_one_it_does_not_fit_is_refused(
    demo_repo: Path, tmp_path: Path
) -> None:
    repo = make_repository(demo_repo, tmp_path / "repo", versions=(2,), deadlines=False)
    agent = make_agent(repo, tmp_path)
    other = Path(shutil.copytree(repo / "mlp", repo / "other"))  # in the folder after start: not loaded
    (other / "config.pbtxt").write_text((other / "config.pbtxt").read_text().replace('name: "mlp"', 'name: "other"'))
    x = RNG.standard_normal((1, 512), dtype=np.float32)

    async def scenario(c: httpx.AsyncClient) -> None:
        assert await apply(agent, document(1, other={"shed": {"at_or_below": 2, "retry_after_s": 7}}))
        assert agent.applier.plan_for("other") is None  # not served: its entry waits
        assert (await c.post("/v2/repository/models/other/load")).status_code == 200
        shed = await c.post("/v2/models/other/infer", json=infer_body(x, priority=2))
        assert shed.status_code == 503 and shed.headers["spillway-reason"] == "shed", shed.text
        assert shed.headers["retry-after"] == "7"
        assert (await c.post("/v2/models/other/infer", json=infer_body(x, priority=1))).status_code == 200
        status = (await c.get("/v2/spillway/status")).json()
        assert status["models"]["other"]["shed"]["at_or_below"] == 2

        # Unloaded, it is no longer checked: a document it would not fit is applied; loading it then is refused.
        assert (await c.post("/v2/repository/models/other/unload")).status_code == 200
        assert await apply(agent, document(2, other={"variant": 9}))
        refused = await c.post("/v2/repository/models/other/load")
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert "the active policy does not fit it" in error and "no version 9" in error
        index = (await c.post("/v2/repository/index")).json()
        assert {r["state"] for r in index if r["name"] == "other"} == {"UNAVAILABLE"}
        assert agent.registry.names() == ["mlp"]

    run(agent, scenario)
