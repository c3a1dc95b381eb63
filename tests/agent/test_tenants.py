"""Tenants on the agent: the registry (tokens, quotas with a fake clock, ceilings, live merges from a policy) and the
agent in process (the real app through httpx's ASGI transport, a real onnxruntime model, the real applier and
telemetry): tenant tokens authenticate, quotas answer 429 with Retry-After and reason `tenant_quota`, counted once
as rejected with the tenant in /metrics, ceilings clamp, policy tenants apply live, every lease is released."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.config import AgentConfig
from edge_agent.runtime.profile import warmup_batch_sizes
from edge_agent.runtime.repository import load_repository
from edge_agent.runtime.runner import OrtRunner
from edge_agent.scheduling import ModelStats, ModelWorker, RequestOutcome, Scheduler
from edge_agent.serving.models import LoadedModel, ModelRegistry
from edge_agent.serving.server import Agent, build_agent, scheduler_config
from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
from edge_agent.tenants import QuotaExceeded, TenantRegistry
from spillway.contract import names
from spillway.contract.policy import PolicyDocument
from spillway.contract.tenants import Tenant, hash_token
from tests.agent.policy_support import AGENT_ID, document, infer_body, make_repository
from tests.utils.server import free_port

OPERATOR = "operator-token-0123456789"
ACME, GLOBEX = "acme-token-0123456789", "globex-token-0123456789"
X = np.random.default_rng(3).standard_normal((1, 512)).astype(np.float32)
POISON = 12345.0  # a request whose first value is this makes the model fail (the error path)
SCENARIO_LIMIT_S = 60
T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tenant(name: str, token: str, **limits: Any) -> Tenant:
    return Tenant(name=name, token_sha256=[hash_token(token)], **limits)


def bearer(token: str) -> bytes:
    return f"Bearer {token}".encode()


# ---- the registry ---------------------------------------------------------------------------------------------------


def test_tokens_name_their_tenant_and_anything_else_is_unauthorised() -> None:
    registry = TenantRegistry([tenant("acme", ACME), tenant("globex", GLOBEX)], OPERATOR)
    assert registry.auth_required
    assert registry.resolve(bearer(OPERATOR)) == "default"
    assert registry.resolve(bearer(ACME)) == "acme"
    assert registry.resolve(b"bearer  " + GLOBEX.encode() + b" ") == "globex"  # the scheme in any case, spaces trimmed
    wrong = [None, b"", b"Bearer", b"Bearer ", bearer("acme-token"), bearer(ACME + "x"), b"Basic " + ACME.encode()]
    for refused in [*wrong, ACME.encode()]:
        assert registry.resolve(refused) is None, refused
    # No token anywhere: every request is the operator's, as before tenants.
    open_agent = TenantRegistry([], None)
    assert not open_agent.auth_required
    assert open_agent.resolve(None) == "default" and open_agent.resolve(bearer("anything")) == "default"
    # Tenants without an operator token: a token is needed all the same.
    assert TenantRegistry([tenant("acme", ACME)], None).resolve(None) is None


def test_a_tenant_with_the_operators_token_or_a_shared_token_is_refused() -> None:
    with pytest.raises(ValueError, match="agent's own token"):
        TenantRegistry([tenant("acme", OPERATOR)], OPERATOR)
    with pytest.raises(ValueError, match="share a token"):
        TenantRegistry([tenant("acme", ACME), tenant("globex", ACME)], None)


def test_max_in_flight_counts_leases_until_each_is_released_once() -> None:
    registry = TenantRegistry([tenant("acme", ACME, max_in_flight=2)], OPERATOR, clock=Clock())
    first, second = registry.admit("acme"), registry.admit("acme")
    with pytest.raises(QuotaExceeded) as refused:
        registry.admit("acme")
    assert (refused.value.tenant, refused.value.quota, refused.value.retry_after_s) == ("acme", "max_in_flight", 1)
    assert "acme" in refused.value.message and "max_in_flight" in refused.value.message
    first.release()
    first.release()  # idempotent: the second release frees nothing more
    third = registry.admit("acme")
    with pytest.raises(QuotaExceeded):
        registry.admit("acme")
    for lease in (second, third):
        lease.release()
    acme = registry.json()["tenants"]["acme"]
    assert (acme["in_flight"], acme["admitted"], acme["refused"]) == (0, 3, 2)
    assert acme["refused_by_quota"] == {"max_in_flight": 2}
    for _ in range(50):  # the operator's tenant has no quotas
        registry.admit("default")


def test_rate_rps_is_a_token_bucket_of_one_second_of_burst() -> None:
    clock = Clock()
    registry = TenantRegistry([tenant("acme", ACME, rate_rps=4), tenant("slow", GLOBEX, rate_rps=0.25)], None, clock)
    for _ in range(4):  # a full bucket: 4 at once
        registry.admit("acme").release()
    with pytest.raises(QuotaExceeded) as refused:
        registry.admit("acme")
    assert (refused.value.quota, refused.value.retry_after_s) == ("rate_rps", 1)
    clock.now += 0.25  # one more token
    registry.admit("acme").release()
    with pytest.raises(QuotaExceeded):
        registry.admit("acme")
    clock.now += 10  # never more than the bucket holds
    for _ in range(4):
        registry.admit("acme").release()
    with pytest.raises(QuotaExceeded):
        registry.admit("acme")
    # Below one request a second: a bucket of one, and Retry-After the whole seconds until the next token.
    registry.admit("slow").release()
    with pytest.raises(QuotaExceeded) as slow:
        registry.admit("slow")
    assert slow.value.retry_after_s == 4
    clock.now += 3
    with pytest.raises(QuotaExceeded) as still:
        registry.admit("slow")
    assert still.value.retry_after_s == 1


def test_generative_quotas_streams_and_a_token_balance_that_may_go_negative() -> None:
    clock = Clock()
    registry = TenantRegistry([tenant("acme", ACME, tokens_per_s=100, max_streams=2)], None, clock)
    one = registry.admit("acme", generative=True, tokens=60)
    two = registry.admit("acme", generative=True, tokens=30)  # balance 10 >= 0: in
    with pytest.raises(QuotaExceeded) as streams:
        registry.admit("acme", generative=True)
    assert streams.value.quota == "max_streams"
    registry.admit("acme").release()  # a V2 request takes no stream and no tokens
    one.add_tokens(60)  # generated as they come: the balance goes to -50
    one.release()
    with pytest.raises(QuotaExceeded) as tokens:
        registry.admit("acme", generative=True, tokens=1)
    assert (tokens.value.quota, tokens.value.retry_after_s) == ("tokens_per_s", 1)
    clock.now += 0.5  # paid back (50 tokens a half second)
    registry.admit("acme", generative=True, tokens=500).release()  # a big prompt gets in, and puts the balance deep
    two.release()
    with pytest.raises(QuotaExceeded) as deep:
        registry.admit("acme", generative=True)
    assert deep.value.retry_after_s == 5  # 500 tokens at 100 a second
    assert registry.json()["tenants"]["acme"]["streams"] == 0


def test_the_priority_ceiling_clamps_a_level_above_it() -> None:
    registry = TenantRegistry([tenant("acme", ACME, max_priority=2), tenant("globex", GLOBEX)], None)
    assert [registry.ceiling("acme", level) for level in (1, 2, 3)] == [2, 2, 3]
    assert [registry.ceiling(name, 1) for name in ("globex", "default", "gone")] == [1, 1, 1]


def test_a_policys_tenants_merge_over_the_configured_ones_live() -> None:
    configured = [tenant("acme", ACME, weight=2, max_in_flight=1)]
    registry = TenantRegistry(configured, OPERATOR, clock=Clock())
    heard: list[dict[str, float]] = []
    registry.on_change(heard.append)
    held = registry.admit("acme")
    # A policy: acme's limits replaced (its configured token kept: the entry names none), globex added.
    registry.apply([Tenant(name="acme", weight=3), tenant("globex", GLOBEX, weight=0.5)])
    assert heard == [{"default": 1.0, "acme": 3.0, "globex": 0.5}] == [registry.weights()]
    assert registry.resolve(bearer(ACME)) == "acme" and registry.resolve(bearer(GLOBEX)) == "globex"
    registry.admit("acme").release()  # no max_in_flight any more
    state = registry.json()["tenants"]
    assert state["globex"]["source"] == "policy" and state["acme"]["source"] == "policy"
    # Refused whole: a policy tenant with the operator's token; nothing changes.
    with pytest.raises(ValueError, match="agent's own token"):
        registry.apply([tenant("mallory", OPERATOR)])
    assert registry.resolve(bearer(GLOBEX)) == "globex" and len(heard) == 1
    # None: the configured tenants alone again; globex is unknown now (its token too, and telemetry calls it other).
    registry.apply(None)
    assert heard[-1] == {"default": 1.0, "acme": 2.0}
    assert registry.resolve(bearer(GLOBEX)) is None
    assert [registry.label(n) for n in ("acme", "default", "globex")] == ["acme", "default", "other"]
    with pytest.raises(QuotaExceeded):  # the configured max_in_flight again, with the lease taken before still held
        registry.admit("acme")
    held.release()
    registry.admit("acme").release()


def test_telemetry_names_the_tenant_with_bounded_values() -> None:
    reader = InMemoryMetricReader()
    telemetry = AgentTelemetry(TelemetrySettings(agent_id="t"), readers=[reader], probes=False)
    registry = TenantRegistry([tenant("acme", ACME)], OPERATOR)
    telemetry.tenant_label = registry.label
    stats = ModelStats(listener=telemetry.recorder("mlp", 1))
    RequestOutcome(stats, 1, tenant="acme").ran("local", 0.001, 0.002, 0.004)
    RequestOutcome(stats, 2, tenant="acme").refused()
    RequestOutcome(stats, 2, tenant="removed-meanwhile").refused()
    RequestOutcome(stats, 2).refused()
    telemetry.generation("tiny-lm").finished(1, "local", operation="chat", prompt_tokens=3, completion_tokens=2,
                                             ttft_s=0.01, duration_s=0.02, tenant="acme")  # fmt: skip
    data = reader.get_metrics_data()
    assert data is not None
    metrics = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    counted = {}
    for point in metrics[names.REQUESTS].data.data_points:
        assert isinstance(point, NumberDataPoint)
        found = dict(point.attributes or {})
        counted[(found[names.ATTR_MODEL], found[names.ATTR_OUTCOME], found[names.ATTR_TENANT])] = point.value
    assert counted == {("mlp", "local", "acme"): 1, ("mlp", "rejected", "acme"): 1, ("mlp", "rejected", "other"): 1,
                       ("mlp", "rejected", "default"): 1, ("tiny-lm", "local", "acme"): 1}  # fmt: skip
    (duration,) = metrics[names.REQUEST_DURATION].data.data_points
    assert dict(duration.attributes or {})[names.ATTR_TENANT] == "acme"
    (genai,) = metrics[names.GENAI_REQUEST_DURATION].data.data_points
    assert dict(genai.attributes or {})[names.ATTR_TENANT] == "acme"
    telemetry.shutdown()


# ---- the agent, in process -------------------------------------------------------------------------------------------


class Gated:
    """The real onnxruntime runner behind a gate the test closes to hold a batch running; fails a poisoned input."""

    def __init__(self, runner: OrtRunner) -> None:
        self.runner = runner
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.entered.set()
        self.gate.wait(30)
        if float(inputs["input"].flat[0]) == POISON:
            raise RuntimeError("poisoned input")
        return self.runner.run(inputs)


@pytest.fixture(scope="module")
def lite_repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The lite version (2) alone, no default deadlines: quick to load, and nothing times out on a busy machine."""
    return make_repository(demo_repo, tmp_path_factory.mktemp("lite"), versions=(2,), deadlines=False)


def make_agent(repo: Path, tmp_path: Path, heard: list[dict[str, float]] | None = None,
               **settings: Any) -> tuple[Agent, Gated]:  # fmt: skip
    """The agent with the operator's token and tenants acme (2 in flight at most, ceiling 2) and globex (a request
    every 10 s), its one model run by a gated real runner (`heard`: the weights its worker is given)."""
    tenants = [{"name": "acme", "token": ACME, "max_in_flight": 2, "max_priority": 2},
               {"name": "globex", "token": GLOBEX, "rate_rps": 0.001}]  # fmt: skip
    config = AgentConfig(model_repository=repo, intra_op_threads=1, state_dir=tmp_path / "state", agent_id=AGENT_ID,
                         token=OPERATOR, tenants=tenants, **settings)  # fmt: skip
    (version,) = list(load_repository(repo))
    runner = OrtRunner(version, intra_op_threads=1)
    profile = runner.warm_up(warmup_batch_sizes(version.config.max_batch_size))
    gated = Gated(runner)
    worker = ModelWorker(Scheduler(scheduler_config(version.config, config), profile), [gated], profile, batching=True,
                         name="mlp")  # fmt: skip
    if heard is not None:
        worker.set_weights = heard.append  # type: ignore[method-assign,assignment]
    registry = ModelRegistry([LoadedModel(version.config, version.version, worker, tuple(runner.providers))])
    return build_agent(config, registry), gated


def run(agent: Agent, scenario: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    async def main() -> T:
        transport = httpx.ASGITransport(app=agent.app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://agent", timeout=30) as client:
            try:
                return await asyncio.wait_for(scenario(client), SCENARIO_LIMIT_S)
            finally:
                await agent.stop()

    try:
        return asyncio.run(main())
    finally:
        agent.close()


def infer(
    client: httpx.AsyncClient, token: str | None, x: np.ndarray = X, **parameters: Any
) -> Awaitable[httpx.Response]:
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    return client.post("/v2/models/mlp/infer", json=infer_body(x, **parameters), headers=headers)


def requests_counted(body: str) -> dict[tuple[str, str, str, str], float]:
    """spillway_requests_total by (priority, outcome, tenant, model version)."""
    (family,) = [f for f in text_string_to_metric_families(body) if f.name == "spillway_requests"]
    return {(s.labels["spillway_priority"], s.labels["spillway_outcome"], s.labels["spillway_tenant"],
             s.labels["spillway_model_version"]): s.value for s in family.samples}  # fmt: skip


def test_tenant_tokens_authenticate_and_quotas_answer_429_counted_once_with_the_tenant(
    lite_repo: Path, tmp_path: Path
) -> None:
    agent, gated = make_agent(lite_repo, tmp_path)

    async def scenario(c: httpx.AsyncClient) -> dict[str, Any]:
        for token in (None, "wrong-token"):  # a token is required, even on loopback, once tenants exist
            refused = await infer(c, token)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert (await c.get("/v2/health/ready")).status_code == 401
        assert (await c.get("/v2/health/live")).status_code == 200
        for token in (OPERATOR, ACME, GLOBEX):
            answer = await infer(c, token, priority=1)
            assert answer.status_code == 200 and answer.headers["spillway-outcome"] == "local", answer.text
        # max_in_flight: two acme requests held running; the third is refused at once; globex is not held up.
        gated.gate.clear()
        gated.entered.clear()
        held = [asyncio.ensure_future(infer(c, ACME, priority=3)) for _ in range(2)]
        await asyncio.to_thread(gated.entered.wait, 10)
        over = await infer(c, ACME, priority=3)
        assert over.status_code == 429, over.text
        assert over.headers["retry-after"] == "1" and over.headers["spillway-reason"] == "tenant_quota"
        assert over.headers["spillway-outcome"] == "rejected"
        assert over.json()["tenant"] == "acme" and over.json()["quota"] == "max_in_flight"
        assert "acme" in over.json()["error"]
        gated.gate.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        assert (await infer(c, ACME, priority=3)).status_code == 200  # the leases were given back
        # rate_rps 0.001: a bucket of one request, taken above; the next one within 1000 s is refused.
        fast = await infer(c, GLOBEX)
        assert fast.status_code == 429 and fast.json()["quota"] == "rate_rps"
        assert 1 <= int(fast.headers["retry-after"]) <= 1000
        # The operator's routes (loading/unloading models, the status with every tenant's traffic, /metrics) are
        # refused to a tenant's token.
        acme = {"authorization": f"Bearer {ACME}"}
        for method, route in (("POST", "/v2/repository/models/mlp/unload"), ("POST", "/v2/repository/index"),
                              ("GET", "/v2/spillway/status"), ("GET", "/metrics")):  # fmt: skip
            denied = await c.request(method, route, headers=acme)
            assert denied.status_code == 403 and "operator" in denied.json()["error"], (route, denied.text)
        status = (await c.get("/v2/spillway/status", headers={"authorization": f"Bearer {OPERATOR}"})).json()
        metrics = (await c.get("/metrics", headers={"authorization": f"Bearer {OPERATOR}"})).text
        return {"status": status, "metrics": metrics}

    seen = run(agent, scenario)
    tenants = seen["status"]["tenants"]["tenants"]
    assert (tenants["acme"]["in_flight"], tenants["acme"]["admitted"], tenants["acme"]["refused"]) == (0, 4, 1)
    assert (tenants["globex"]["admitted"], tenants["globex"]["refused_by_quota"]) == (1, {"rate_rps": 1})
    assert tenants["default"]["admitted"] == 1 and seen["status"]["tenants"]["auth_required"] is True
    assert tenants["acme"]["tokens"] == 1 and "token_sha256" not in tenants["acme"]  # never the digests
    assert hash_token(ACME) not in json.dumps(seen["status"])
    counted = requests_counted(seen["metrics"])
    # acme asked for level 1 and was served at its ceiling, 2; each refusal counted once, rejected, with its tenant
    # (at level 0: refused before its body was read).
    assert counted == {("1", "local", "default", "2"): 1, ("2", "local", "acme", "2"): 1,
                       ("3", "local", "acme", "2"): 3, ("0", "rejected", "acme", "2"): 1,
                       ("1", "local", "globex", "2"): 1, ("0", "rejected", "globex", "2"): 1}  # fmt: skip
    model = agent.registry.of("mlp")[0]
    assert sum(model.worker.stats.outcomes.values()) == 8  # one outcome per request that got past authentication


def test_every_way_a_request_ends_gives_its_lease_back(lite_repo: Path, tmp_path: Path) -> None:
    """Served, refused at decoding, failed in its batch, overflowed, answered by a policy fallback, shed: acme's
    in-flight count is 0 after each, and its quota of 2 never runs out."""
    agent, _ = make_agent(lite_repo, tmp_path)
    poisoned = X.copy()
    poisoned.flat[0] = POISON

    async def scenario(c: httpx.AsyncClient) -> list[tuple[int, str]]:
        seen = []
        for _ in range(3):
            for answer in [await infer(c, ACME), await infer(c, ACME, poisoned),
                           await c.post("/v2/models/mlp/infer", content=b"{not json",
                                        headers={"authorization": f"Bearer {ACME}"})]:  # fmt: skip
                seen.append((answer.status_code, answer.headers["spillway-outcome"]))
        fallback = [{"name": "output", "datatype": "FP32", "shape": [1000], "data": [0.5] * 1000}]
        doc = document(1, mlp={"fallback": {"at_or_below": 3, "mode": "default", "default_outputs": fallback}})
        assert await agent.applier.apply(PolicyDocument.model_validate(doc), "control_plane")
        for _ in range(3):
            answer = await infer(c, ACME, priority=3)
            seen.append((answer.status_code, answer.headers["spillway-outcome"]))
        assert await agent.applier.apply(PolicyDocument.model_validate(document(2, mlp={"shed": {"at_or_below": 2}})),
                                         "control_plane")  # fmt: skip
        for _ in range(3):
            answer = await infer(c, ACME, priority=3)
            seen.append((answer.status_code, answer.headers["spillway-outcome"]))
        assert agent.tenants is not None and agent.tenants.json()["tenants"]["acme"]["in_flight"] == 0
        return seen

    seen = run(agent, scenario)
    assert (
        seen
        == [(200, "local"), (500, "error"), (400, "rejected")] * 3
        + [(200, "fallback_default")] * 3
        + [(503, "rejected")] * 3
    )
    assert agent.tenants is not None and agent.tenants.json()["tenants"]["acme"]["refused"] == 0


def test_overflow_carries_the_tenant_and_its_clamped_priority_to_the_gateway(lite_repo: Path, tmp_path: Path) -> None:
    from aiohttp import web

    heard: list[str | None] = []
    priorities: list[Any] = []
    port = free_port()
    overflow = {"enabled": True, "gateway": f"http://127.0.0.1:{port}", "fraction": 1.0}
    agent, _ = make_agent(lite_repo, tmp_path, agent_token="agent-to-gateway", overflow=overflow)

    async def gateway(request: web.Request) -> web.Response:
        heard.append(request.headers.get(names.H_TENANT))
        priorities.append((await request.json()).get("parameters", {}).get("priority"))
        body = {"model_name": "mlp", "model_version": "2", "outputs": [
            {"name": "output", "datatype": "FP32", "shape": [1, 1000], "data": [0.25] * 1000}]}  # fmt: skip
        return web.json_response(body)

    async def scenario(c: httpx.AsyncClient) -> list[str]:
        app = web.Application()
        app.router.add_post("/v2/models/mlp/infer", gateway)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            answers = [await infer(c, token, priority=1) for token in (ACME, OPERATOR)]
        finally:
            await runner.cleanup()
        assert agent.tenants is not None and agent.tenants.json()["tenants"]["acme"]["in_flight"] == 0
        return [a.headers["spillway-outcome"] for a in answers]

    assert run(agent, scenario) == ["overflow", "overflow"]
    assert heard == ["acme", "default"]
    assert priorities == [2, 1]  # acme asked for level 1 above its ceiling 2: the cloud is told 2; the operator's 1


def test_a_policys_tenants_apply_live_and_a_bad_one_is_refused(lite_repo: Path, tmp_path: Path) -> None:
    agent, _ = make_agent(lite_repo, tmp_path)
    initech = "initech-token-0123456789"

    async def scenario(c: httpx.AsyncClient) -> None:
        assert (await infer(c, initech)).status_code == 401
        policy_tenants = [{"name": "initech", "token_sha256": [hash_token(initech)], "weight": 3, "max_in_flight": 5},
                          {"name": "acme", "weight": 2, "max_priority": 3}]  # fmt: skip
        doc = {**document(1), "tenants": policy_tenants}
        assert await agent.applier.apply(PolicyDocument.model_validate(doc), "control_plane")
        assert (await infer(c, initech)).status_code == 200
        assert (await infer(c, ACME, priority=1)).status_code == 200  # acme's token kept, its ceiling now 3
        bad = {**document(2), "tenants": [{"name": "mallory", "token_sha256": [hash_token(OPERATOR)]}]}
        assert not await agent.applier.apply(PolicyDocument.model_validate(bad), "control_plane")
        assert agent.applier.last_refusal is not None and "tenants" in agent.applier.last_refusal.message
        assert (await infer(c, initech)).status_code == 200  # the refused document changed nothing
        assert await agent.applier.apply(PolicyDocument.model_validate(document(3)), "control_plane")
        assert (await infer(c, initech)).status_code == 401  # no tenants in the document: the config's alone

    run(agent, scenario)
    model = agent.registry.of("mlp")[0]
    assert model.worker.stats.outcomes[(3, "local")] == 1  # acme's level 1 was served at its ceiling, 3


def test_weights_reach_the_schedulers_at_start_and_on_every_change(lite_repo: Path, tmp_path: Path) -> None:
    heard: list[dict[str, float]] = []
    agent, _ = make_agent(lite_repo, tmp_path, heard)

    async def scenario(c: httpx.AsyncClient) -> None:
        doc = {**document(1), "tenants": [{"name": "acme", "weight": 4}]}
        assert await agent.applier.apply(PolicyDocument.model_validate(doc), "control_plane")

    run(agent, scenario)
    assert heard == [{"default": 1.0, "acme": 1.0, "globex": 1.0}, {"default": 1.0, "acme": 4.0, "globex": 1.0}]


def test_an_agent_whose_tenant_has_the_operators_token_does_not_start(lite_repo: Path, tmp_path: Path) -> None:
    from edge_agent.runtime.config import ModelConfigError

    config = AgentConfig(model_repository=lite_repo, state_dir=tmp_path, token=OPERATOR,
                         tenants=[{"name": "acme", "token": OPERATOR}])  # fmt: skip
    with pytest.raises(ModelConfigError, match="agent's own token"):
        build_agent(config, ModelRegistry([]))
