"""Policy documents applied to a generative model (tiny-lm, real onnxruntime sessions), in process with the real
app and applier on one event loop: the document's generative entries checked against the decoder; the engines'
limits lowered live under running streams and restored; a variant switch mid-traffic (running streams finish on
the old version, new ones go to the new one, the old one closes after); a load that fails keeps the running
version; the status and the active-streams gauge follow."""

from __future__ import annotations

import asyncio
import faulthandler
import shutil
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from edge_agent.config import AgentConfig
from edge_agent.generation.engine import Chunk, GenerationRequest, Stream
from edge_agent.generation.pool import EnginePool
from edge_agent.policy.plan import PolicyRefused, ServedDecoder, ServedModel, build_plan
from edge_agent.runtime.repository import load_repository
from edge_agent.serving.server import Agent, build_agent, build_registry
from edge_agent.telemetry import AgentTelemetry, LiveTelemetry, TelemetrySettings
from spillway.contract import names
from spillway.contract.policy import PolicyDocument
from spillway.demo.models import TINY_LM_CONFIG
from spillway.demo.tiny_lm import TINY, TINY_LITE, TINY_LM, build_tiny_lm_version
from tests.agent.policy_support import AGENT_ID, default_output, document

SCENARIO_LIMIT_S = 120
GATE_LIMIT_S = 20  # well below the scenario's: a gate left shut shows where it stalled, not as the scenario's timeout
T = TypeVar("T")


@pytest.fixture(scope="module")
def lm_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-lm as `build-demo` writes it: v1 served, v2 (lite) on disk; and v3, a broken version that cannot load."""
    repo = tmp_path_factory.mktemp("lm-repo")
    build_tiny_lm_version(repo / TINY_LM, 1, TINY)
    build_tiny_lm_version(repo / TINY_LM, 2, TINY_LITE)
    (repo / TINY_LM / "config.pbtxt").write_text(TINY_LM_CONFIG)
    broken = repo / TINY_LM / "3"
    shutil.copytree(repo / TINY_LM / "2", broken)
    (broken / "model.onnx").write_bytes(b"not an onnx model")
    return repo


def make_agent(repo: Path, tmp_path: Path, **settings: Any) -> Agent:
    generation = {"kv_budget_bytes": 32 << 20, "max_num_seqs": 4, "max_num_batched_tokens": 64,
                  **settings.pop("generation", {})}  # fmt: skip
    config = AgentConfig(model_repository=repo, intra_op_threads=1, state_dir=tmp_path / "state", agent_id=AGENT_ID,
                         generation=generation, **settings)  # fmt: skip
    return build_agent(config, build_registry(config))


def run(agent: Agent, scenario: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    async def main() -> T:
        transport = httpx.ASGITransport(app=agent.app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://agent", timeout=60) as client:
            try:
                return await asyncio.wait_for(scenario(client), SCENARIO_LIMIT_S)
            finally:
                await agent.applier.close()

    # A scenario that stalls (once, on a busy CI machine, for its whole limit) leaves every thread's stack in the log.
    faulthandler.dump_traceback_later(SCENARIO_LIMIT_S - 10)
    try:
        return asyncio.run(main())
    finally:
        faulthandler.cancel_dump_traceback_later()
        agent.close()


def apply(agent: Agent, body: dict[str, Any]) -> Awaitable[bool]:
    return agent.applier.apply(PolicyDocument.model_validate(body), "control_plane", f'"{body["version"]}"')


def long_request(pool: EnginePool, text: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt=pool.text.encode(text), max_tokens=max_tokens, ignore_eos=True)


async def collect(stream: Stream) -> list[Chunk]:
    return [chunk async for chunk in stream]


def ended_once(chunks: list[Chunk]) -> bool:
    """The stream ended exactly once: one final chunk, the last one."""
    return [c.finish_reason is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


# ---- checking a document against the decoder -----------------------------------------------------------------------


def test_a_documents_generative_entries_are_checked_against_the_decoder(lm_repo: Path, demo_repo: Path) -> None:
    decoders = {TINY_LM: ServedDecoder(lm_repo / TINY_LM, 1)}
    mlp = load_repository(demo_repo).get("mlp", 1)
    served = {"mlp": ServedModel(mlp.config, 1, (1,), demo_repo)}

    def plan(**models: dict[str, Any]) -> Any:
        return build_plan(PolicyDocument.model_validate(document(1, **models)), "control_plane", served, decoders)

    text = {"at_or_below": 3, "mode": "default", "default_text": "busy, try later"}
    outputs = {"at_or_below": 3, "mode": "default", "default_outputs": default_output()}
    good = plan(**{TINY_LM: {"variant": 2, "max_tokens_cap": 8, "max_num_seqs": 2, "max_num_batched_tokens": 32,
                             "fallback": text, "shed": {"at_or_below": 3}}})  # fmt: skip
    model = good.models[TINY_LM]
    assert (model.decoder_variant, model.max_tokens_cap, model.max_num_seqs, model.max_num_batched_tokens) == (
        2, 8, 2, 32)  # fmt: skip
    assert model.default_text == "busy, try later" and model.admission(3) == "fallback" and model.variant is None
    assert plan(**{TINY_LM: {"variant": 1}}).models[TINY_LM].decoder_variant is None  # the default version
    # The `*` entry may give both kinds of default, for an agent serving both: each model takes its own.
    both = plan(all={"fallback": {**text, **outputs}})
    assert both.models[TINY_LM].default_text == "busy, try later" and both.models["mlp"].default_outputs is not None
    assert plan(all={"max_queue_delay_us": 500}).models[TINY_LM].max_num_seqs is None  # V2 batching from `*`: ignored

    refused = [
        ({TINY_LM: {"variant": 7}}, "models['tiny-lm'].variant: the decoder 'tiny-lm' has no version 7 on disk "
                                    "(it has: [1, 2, 3]"),
        ({TINY_LM: {"fallback": outputs}}, "models['tiny-lm'].fallback.default_outputs: 'tiny-lm' is a generative "
                                           "model: mode 'default' answers with default_text"),
        ({TINY_LM: {"fallback": {**text, **outputs}}}, "models['tiny-lm'].fallback.default_outputs"),
        ({"mlp": {"fallback": text}}, "models['mlp'].fallback.default_text: 'mlp' is a V2 model"),
        ({TINY_LM: {"max_queue_delay_us": 500}}, "models['tiny-lm']: max_queue_delay_us/preferred_batch_sizes: "
                                                 "'tiny-lm' is a generative model"),
    ]  # fmt: skip
    for models, message in refused:
        with pytest.raises(PolicyRefused) as caught:
            plan(**models)
        assert message in str(caught.value)


# ---- limits, live --------------------------------------------------------------------------------------------------


def test_limits_are_lowered_under_running_streams_and_restored(lm_repo: Path, tmp_path: Path) -> None:
    agent = make_agent(lm_repo, tmp_path)
    pool = agent.engines[TINY_LM]
    scheduler = pool.instances[0].scheduler
    steps: list[tuple[int, int, int]] = []  # (max_num_seqs, running before, running after) of every step planned
    plan_step = scheduler.step

    def recording_step(now: float | None = None) -> Any:  # on the engine thread, under the engine's lock
        before = len(scheduler.running)
        planned = plan_step(now)
        steps.append((scheduler.config.max_num_seqs, before, len(scheduler.running)))
        return planned

    scheduler.step = recording_step  # type: ignore[method-assign]

    async def scenario(c: httpx.AsyncClient) -> tuple[list[list[Chunk]], dict[str, Any], dict[str, Any]]:
        first = [pool.submit(long_request(pool, f"stream {i}", 120)) for i in range(6)]
        while pool.json()["running"] < 4:  # every place taken, two waiting
            await asyncio.sleep(0.001)
        assert await apply(agent, document(1, **{TINY_LM: {"max_num_seqs": 2, "max_num_batched_tokens": 16,
                                                           "max_tokens_cap": 32}}))  # fmt: skip
        limited = (await c.get("/v2/spillway/status")).json()["generative"][TINY_LM]
        later = [pool.submit(long_request(pool, f"later {i}", 120)) for i in range(4)]
        while pool.json()["running"] > 2:  # the running ones finish; nobody joins until fewer than two run
            await asyncio.sleep(0.001)
        assert await apply(agent, document(2))  # reverted: the configured limits again
        restored = (await c.get("/v2/spillway/status")).json()["generative"][TINY_LM]
        chunks = await asyncio.gather(*(collect(s) for s in first + later))
        return list(chunks), limited, restored

    chunks, limited, restored = run(agent, scenario)
    assert all(ended_once(c) and c[-1].finish_reason == "length" and c[-1].completion_tokens == 120 for c in chunks)
    assert limited["limits"] == {"max_num_seqs": 2, "max_num_batched_tokens": 16, "max_tokens_cap": 32}
    assert limited["configured_limits"] == {"max_num_seqs": 4, "max_num_batched_tokens": 64}
    assert restored["limits"] == {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_tokens_cap": None}
    # Never a join above the limit in force: running sequences beyond a lowered limit went on (they were not cut
    # off) while nobody joined, and after the revert more than two ran at once again.
    assert all(after <= max(before, limit) for limit, before, after in steps)
    assert any(limit == 2 and before > 2 for limit, before, _ in steps)
    reverted = max(i for i, (limit, _, _) in enumerate(steps) if limit == 2) + 1
    assert any(limit == 4 and after > 2 for limit, _, after in steps[reverted:])
    assert scheduler.config == scheduler.configured and pool.active == 0


# ---- variant switch --------------------------------------------------------------------------------------------------


def _gauge(reader: InMemoryMetricReader, name: str) -> dict[tuple[tuple[str, Any], ...], float]:
    data = reader.get_metrics_data()
    assert data is not None
    found = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        found[tuple(sorted(point.attributes.items()))] = point.value  # type: ignore[union-attr]
    return found


def test_a_variant_switch_serves_new_streams_on_v2_while_v1_finishes_its_own(lm_repo: Path, tmp_path: Path) -> None:
    agent = make_agent(lm_repo, tmp_path)
    reader = InMemoryMetricReader()
    applier = agent.applier
    applier.telemetry = agent.telemetry = LiveTelemetry(
        TelemetrySettings(agent_id=AGENT_ID), agent.registry, engines=agent.engines,
        factory=lambda settings: AgentTelemetry(settings, readers=[reader], probes=False),
    )  # fmt: skip
    v1 = agent.engines[TINY_LM]
    assert agent.app.openai is not None and agent.app.openai.engines is agent.engines is agent.app.engines
    # A gate on v1's decode steps: its streams are surely still running when the switch commits.
    gate = threading.Event()
    gate.set()
    decode = v1.instances[0].runner.decode

    def gated_decode(*args: Any) -> Any:
        gate.wait(GATE_LIMIT_S)
        return decode(*args)

    v1.instances[0].runner.decode = gated_decode  # type: ignore[method-assign]
    body = {"text_input": "Once upon a time", "parameters": {"max_tokens": 24, "temperature": 0, "ignore_eos": True}}

    async def scenario(c: httpx.AsyncClient) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        reference = (await c.post(f"/v2/models/{TINY_LM}/generate", json=body)).json()
        gate.clear()  # the prompts prefill (their first token), then v1 holds at its first decode
        old = [v1.submit(long_request(v1, "Once upon a time", 24)) for _ in range(3)]
        running = [asyncio.ensure_future(collect(s)) for s in old]
        while v1.json()["running"] < 3:
            await asyncio.sleep(0.001)
        assert await apply(agent, document(1, **{TINY_LM: {"variant": 2}}))
        v2 = agent.engines[TINY_LM]
        seen["swapped"] = (v2.version, v1.active, [p.version for p in applier.retiring_engines])
        new = await c.post(f"/v2/models/{TINY_LM}/generate", json=body)
        seen["new"] = (new.status_code, new.json(), new.headers.get("spillway-outcome"))
        completion = await c.post("/v1/completions", json={"model": TINY_LM, "prompt": "Hi", "max_tokens": 4})
        seen["completion"] = completion.status_code
        seen["status"] = (await c.get("/v2/spillway/status")).json()["generative"][TINY_LM]
        seen["gauge"] = _gauge(reader, names.ACTIVE_STREAMS)
        gate.set()
        seen["old"] = await asyncio.gather(*running)
        while applier.retiring_engines:
            await asyncio.sleep(0.01)
        seen["v1_closed"] = v1.instances[0]._thread is None or not v1.instances[0]._thread.is_alive()
        seen["reference"] = reference
        # Reverting switches back the same way: v1 loads again, v2 finishes and closes.
        assert await apply(agent, document(2))
        back = agent.engines[TINY_LM]
        again = (await c.post(f"/v2/models/{TINY_LM}/generate", json=body)).json()
        while applier.retiring_engines:
            await asyncio.sleep(0.01)
        seen["reverted"] = (back.version, again, (await c.get("/v2/spillway/status")).json()["generative"][TINY_LM])
        seen["gauge_after"] = _gauge(reader, names.ACTIVE_STREAMS)
        return seen

    seen = run(agent, scenario)
    assert seen["swapped"] == ("2", 3, ["1"])  # committed while v1 still held its three streams
    status, answer, outcome = seen["new"]
    assert status == 200 and answer["model_version"] == "2" and outcome == "local"
    assert seen["completion"] == 200
    reference = seen["reference"]
    assert reference["model_version"] == "1"
    for chunks in seen["old"]:  # each started on v1 ended once, with v1's greedy text
        assert ended_once(chunks) and "".join(c.text for c in chunks) == reference["text_output"]
    assert seen["v1_closed"]
    state = seen["status"]
    assert (state["served_version"], state["default_version"], state["variant"], state["retiring_versions"]) == (
        2, 1, 2, [1])  # fmt: skip
    assert seen["gauge"] == {(("spillway.model", TINY_LM),): 3}  # v1's three streams, under the model's name
    version, again, state = seen["reverted"]
    assert version == "1" and again["model_version"] == "1" and again["text_output"] == reference["text_output"]
    assert (state["served_version"], state["variant"], state["retiring_versions"]) == (1, None, [])
    assert seen["gauge_after"] == {(("spillway.model", TINY_LM),): 0}


def test_switching_back_while_the_old_version_drains_waits_for_it_instead_of_loading_a_third_copy(
    lm_repo: Path, tmp_path: Path
) -> None:
    agent = make_agent(lm_repo, tmp_path)
    applier = agent.applier
    v1 = agent.engines[TINY_LM]
    gate = threading.Event()
    decode = v1.instances[0].runner.decode

    def gated_decode(*args: Any) -> Any:
        gate.wait(GATE_LIMIT_S)
        return decode(*args)

    v1.instances[0].runner.decode = gated_decode  # type: ignore[method-assign]
    load = applier._load_engine
    assert load is not None
    beside: list[list[str]] = []  # the pools still finishing when each load began

    def watched_load(name: str, version: int) -> EnginePool:
        beside.append([pool.version for pool in applier.retiring_engines])
        return load(name, version)

    applier._load_engine = watched_load

    async def scenario(c: httpx.AsyncClient) -> tuple[bool, bool, list[Chunk]]:
        held = asyncio.ensure_future(collect(v1.submit(long_request(v1, "Once upon a time", 8))))
        while v1.json()["running"] < 1:
            await asyncio.sleep(0.001)
        assert await apply(agent, document(1, **{TINY_LM: {"variant": 2}}))
        back = asyncio.ensure_future(apply(agent, document(2)))  # v1 still holds its stream: the revert waits
        await asyncio.sleep(0.3)
        waited = not back.done() and applier.retiring_engines == [v1]
        gate.set()
        return waited, await back, await held

    waited, applied, chunks = run(agent, scenario)
    assert waited and applied  # not refused: it waited for v1 to close, then loaded v1 again
    assert beside == [[], []]  # neither load began beside a pool still draining
    assert ended_once(chunks) and agent.engines[TINY_LM].version == "1"


def test_a_decoder_version_that_cannot_load_refuses_the_document_and_keeps_serving(
    lm_repo: Path, tmp_path: Path
) -> None:
    agent = make_agent(lm_repo, tmp_path)
    served = agent.engines[TINY_LM]

    async def scenario(c: httpx.AsyncClient) -> tuple[bool, str, dict[str, Any]]:
        applied = await apply(agent, document(1, **{TINY_LM: {"variant": 3}}))
        assert agent.applier.last_refusal is not None
        answer = (await c.post(f"/v2/models/{TINY_LM}/generate", json={"text_input": "Hi"})).json()
        return applied, agent.applier.last_refusal.message, answer

    applied, message, answer = run(agent, scenario)
    assert not applied and message.startswith("models['tiny-lm']: cannot load v3: ")
    assert agent.engines[TINY_LM] is served and answer["model_version"] == "1"
    assert agent.applier.transitions == {} and agent.applier.retiring_engines == []


def test_a_decoder_version_that_does_not_fit_in_memory_is_refused_before_loading(lm_repo: Path, tmp_path: Path) -> None:
    agent = make_agent(lm_repo, tmp_path, load_headroom_bytes=1 << 60)

    async def scenario(_: httpx.AsyncClient) -> bool:
        return await apply(agent, document(1, **{TINY_LM: {"variant": 2}}))

    assert not run(agent, scenario)
    assert agent.applier.last_refusal is not None
    message = agent.applier.last_refusal.message
    assert message.startswith("models['tiny-lm']: cannot load v2: tiny-lm v2 needs about ") and "headroom" in message
    assert agent.engines[TINY_LM].version == "1"
