"""The policy poller against a real policy endpoint on loopback (the control plane's contract: bearer token,
strong ETag, If-None-Match -> 304), and the on-disk cache of the last good document."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from edge_agent.config import AgentConfig
from edge_agent.policy.cache import PolicyCache
from edge_agent.policy.client import RETRY_REFUSED_AFTER_S, PolicyPoller
from edge_agent.serving.server import Agent, build_agent, build_registry
from spillway.contract.policy import PolicyDocument
from tests.agent.policy_support import AGENT_ID, TOKEN, PolicyServer, document, make_repository
from tests.utils.fullfs import small_disk
from tests.utils.server import free_port, serving

T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def lite_repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repository(demo_repo, tmp_path_factory.mktemp("lite"), versions=(2,))


@pytest.fixture
def policy_server() -> Iterator[tuple[PolicyServer, str]]:
    server = PolicyServer()
    with serving(server.app) as url:
        yield server, url


def make_agent(repo: Path, tmp_path: Path, control_plane: str, **settings: Any) -> Agent:
    config = AgentConfig(model_repository=repo, intra_op_threads=1, state_dir=tmp_path / "state",
                         control_plane=control_plane, agent_token=TOKEN, agent_id=AGENT_ID, **settings)  # fmt: skip
    return build_agent(config, build_registry(config))


def poller_of(agent: Agent, clock: Clock | None = None) -> PolicyPoller:
    """The agent's poller, with an injected clock where a test moves time."""
    assert agent.poller is not None
    if clock is not None:
        agent.poller._clock = clock
    return agent.poller


def run(agent: Agent, scenario: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        try:
            return await asyncio.wait_for(scenario(), 120)
        finally:
            assert agent.poller is not None
            await agent.poller.stop()
            await agent.applier.close()

    try:
        return asyncio.run(main())
    finally:
        agent.close()


def test_a_new_document_is_applied_then_its_etag_is_sent_and_304_changes_nothing(
    lite_repo: Path, tmp_path: Path, policy_server: tuple[PolicyServer, str]
) -> None:
    server, url = policy_server
    agent = make_agent(lite_repo, tmp_path, url)
    poller = poller_of(agent)

    async def scenario() -> list[str]:
        server.publish(document(3, mlp={"shed": {"at_or_below": 3}}))
        results = [await poller.poll_once(), await poller.poll_once()]
        assert agent.applier.plan.version == 3 and agent.applier.plan.source == "control_plane"
        server.publish(document(4, mlp={"shed": {"at_or_below": 2}}))
        results.append(await poller.poll_once())
        return results

    assert run(agent, scenario) == ["applied", "unchanged", "applied"]
    first = json.dumps(document(3, mlp={"shed": {"at_or_below": 3}})).encode()
    assert server.seen == [None, f'"{hashlib.sha256(first).hexdigest()}"', f'"{hashlib.sha256(first).hexdigest()}"']
    plan = agent.applier.plan.models["mlp"]
    assert plan.shed is not None and plan.shed.at_or_below == 2
    status = agent.status()
    assert status["policy"]["version"] == 4 and status["policy"]["etag"] == server.etag
    assert status["poll"]["polls"] == 3 and status["poll"]["last_error"] is None and status["poll"]["last_poll_at"]
    # The last good document is on disk, whole, and no temporary file is left in the state directory (beside it, when
    # a load was measured: the memory the models took, memory-needs.json).
    cached = PolicyCache(tmp_path / "state", AGENT_ID).load()
    assert cached is not None and cached.document.version == 4 and cached.etag == server.etag
    assert _state_files(tmp_path / "state") == [f"policy-{AGENT_ID}.json"]


def test_an_invalid_document_is_refused_reported_and_the_last_good_one_stays(
    lite_repo: Path, tmp_path: Path, policy_server: tuple[PolicyServer, str]
) -> None:
    server, url = policy_server
    agent = make_agent(lite_repo, tmp_path, url)
    clock = Clock()
    poller = poller_of(agent, clock)

    async def scenario() -> list[str]:
        server.publish(document(1, mlp={"shed": {"at_or_below": 3}}))
        results = [await poller.poll_once()]
        server.publish(document(2, mlp={"shed": {"at_or_below": 0}}))  # schema: levels start at 1
        results.append(await poller.poll_once())
        results.append(await poller.poll_once())  # the refused document is not fetched (and counted) again ...
        clock.now += RETRY_REFUSED_AFTER_S + 1
        results.append(await poller.poll_once())  # ... until a minute has passed
        server.publish(document(3, mlp={"variant": 9}))  # valid schema, but the repository has no version 9
        results.append(await poller.poll_once())
        server.publish(b"<html>not a policy</html>")
        results.append(await poller.poll_once())
        return results

    assert run(agent, scenario) == ["applied", "refused", "unchanged", "refused", "refused", "refused"]
    status = agent.status()
    assert status["policy"]["version"] == 1 and status["models"]["mlp"]["shed"]["at_or_below"] == 3
    assert status["refusals"] == 4
    assert status["last_refusal"]["source"] == "control_plane" and status["last_refusal"]["version"] is None
    assert "invalid policy document" in status["last_refusal"]["message"]
    assert agent.applier.last_refusal is not None
    cached = PolicyCache(tmp_path / "state", AGENT_ID).load()
    assert cached is not None and cached.document.version == 1  # refused documents never reach the cache


def test_refusal_reports_name_the_field_and_the_documents_version(
    lite_repo: Path, tmp_path: Path, policy_server: tuple[PolicyServer, str]
) -> None:
    server, url = policy_server
    agent = make_agent(lite_repo, tmp_path, url)
    poller = poller_of(agent)
    messages = []

    async def scenario() -> None:
        for body in (document(7, mlp={"shed": {"at_or_below": 0}}), document(8, mlp={"variant": 9})):
            server.publish(body)
            assert await poller.poll_once() == "refused"
            assert agent.applier.last_refusal is not None
            messages.append((agent.applier.last_refusal.version, agent.applier.last_refusal.message))

    run(agent, scenario)
    assert messages[0][0] == 7 and "models.mlp.shed.at_or_below" in messages[0][1]
    assert messages[1][0] == 8 and "models['mlp'].variant" in messages[1][1] and "no version 9" in messages[1][1]


def test_a_control_plane_that_fails_or_is_gone_keeps_the_policy_backs_off_and_logs_once_per_streak(
    lite_repo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = PolicyServer()
    running = contextlib.ExitStack()
    url = running.enter_context(serving(server.app))
    agent = make_agent(lite_repo, tmp_path, url, policy_poll_interval_s=2)
    poller = poller_of(agent)
    poller._rng = random.Random(5)
    caplog.set_level(logging.INFO, logger="spillway.agent.policy")

    async def scenario() -> list[Any]:
        server.publish(document(1, mlp={"shed": {"at_or_below": 3}}))
        seen: list[Any] = [await poller.poll_once()]
        server.failing = 503
        for _ in range(3):
            seen.append(await poller.poll_once())
            seen.append(poller.next_delay())
        seen.append(poller.last_error)
        server.failing = None
        seen.append(await poller.poll_once())
        seen.append(poller.next_delay())
        running.close()  # the control plane is gone: connection refused
        seen.append(await poller.poll_once())
        seen.append(poller.last_error)
        return seen

    with running:
        seen = run(agent, scenario)
    assert seen[0] == "applied"
    assert seen[1:7:2] == ["failed"] * 3
    for failures, delay in enumerate(seen[2:7:2], 1):  # 2 s doubled per failure, jittered by +-20 %
        assert 0.8 * 2 * 2**failures <= delay <= 1.2 * 2 * 2**failures
    assert "HTTP 503" in seen[7]
    assert seen[8] == "unchanged" and 1.6 <= seen[9] <= 2.4
    assert seen[10] == "failed" and "cannot reach" in seen[11]
    assert agent.applier.plan.version == 1  # still the policy it had
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "policy poll failed" in r.message]
    assert len(warnings) == 2  # one line for the streak of three 503s, one for the new streak
    assert any("work again after 3 failed" in r.message for r in caplog.records)


def test_a_token_the_control_plane_refuses_is_a_failed_poll_with_the_reason(
    lite_repo: Path, tmp_path: Path, policy_server: tuple[PolicyServer, str]
) -> None:
    server, url = policy_server
    server.token = "spa_someone_else"
    server.publish(document(1))
    agent = make_agent(lite_repo, tmp_path, url)
    poller = poller_of(agent)

    assert run(agent, poller.poll_once) == "failed"
    assert poller.last_error is not None and "HTTP 401" in poller.last_error and "token" in poller.last_error
    assert agent.applier.plan.source == "local"


def test_the_documents_poll_interval_wins_and_the_backoff_is_capped() -> None:
    class Plan:
        poll_interval_s: float | None = None

    class Applier:
        plan = Plan()
        etag = None

    poller = PolicyPoller("http://127.0.0.1:9", "a", "t", Applier(), interval_s=5, max_backoff_s=60,  # type: ignore[arg-type]
                          rng=random.Random(1))  # fmt: skip
    delays = [poller.next_delay() for _ in range(50)]
    assert all(4.0 <= d <= 6.0 for d in delays) and len(set(delays)) > 40  # jittered, so a fleet spreads out
    Applier.plan.poll_interval_s = 1.0
    assert all(0.8 <= poller.next_delay() <= 1.2 for _ in range(50))
    poller.failures = 30
    assert all(48 <= poller.next_delay() <= 72 for _ in range(50))  # capped at 60 s, jittered


def test_the_cache_is_applied_at_start_and_a_bad_cache_is_refused_and_reported(lite_repo: Path, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens: the control plane is down
    cache = PolicyCache(tmp_path / "state", AGENT_ID)
    cache.store(PolicyDocument.model_validate(document(6, mlp={"shed": {"at_or_below": 2}})), '"abc"')
    agent = make_agent(lite_repo, tmp_path, url)

    async def start() -> tuple[Any, str]:
        await agent.start()  # what the app's lifespan runs before the first request
        return agent.status()["policy"], await poller_of(agent).poll_once()

    policy, polled = run(agent, start)
    assert policy["version"] == 6 and policy["source"] == "cache" and policy["etag"] == '"abc"'
    assert polled == "failed"

    corrupt_caches = [
        (b"{not json", "not JSON"),
        (json.dumps({"agent_id": "other", "document": {}}).encode(), "cached for agent 'other'"),
        (json.dumps({"agent_id": AGENT_ID, "document": {"version": -1}}).encode(), "invalid policy document"),
    ]
    for corrupt, message in corrupt_caches:
        cache.path.write_bytes(corrupt)
        agent = make_agent(lite_repo, tmp_path, url)
        run(agent, agent.applier.apply_cached)
        status = agent.status()
        assert status["policy"]["source"] == "local" and status["refusals"] == 1
        assert status["last_refusal"]["source"] == "cache" and message in status["last_refusal"]["message"]


def test_a_cached_policy_the_control_plane_still_serves_becomes_its_policy_on_304(
    lite_repo: Path, tmp_path: Path, policy_server: tuple[PolicyServer, str]
) -> None:
    server, url = policy_server
    body = document(5, mlp={"shed": {"at_or_below": 3}})
    etag = server.publish(body)
    PolicyCache(tmp_path / "state", AGENT_ID).store(PolicyDocument.model_validate(body), etag)
    agent = make_agent(lite_repo, tmp_path, url)
    poller = poller_of(agent)

    async def scenario() -> list[Any]:
        await agent.applier.apply_cached()
        seen: list[Any] = [agent.applier.plan.source]
        seen += [await poller.poll_once(), agent.applier.plan.source, agent.applier.plan.version]
        return seen

    assert run(agent, scenario) == ["cache", "unchanged", "control_plane", 5]
    assert server.seen == [etag]


def test_without_etags_the_documents_digest_tells_unchanged_from_new(
    lite_repo: Path, tmp_path: Path, policy_server: tuple[PolicyServer, str]
) -> None:
    server, url = policy_server
    server.etags = False
    agent = make_agent(lite_repo, tmp_path, url)
    poller = poller_of(agent)

    async def scenario() -> list[str]:
        server.publish(document(1))
        results = [await poller.poll_once(), await poller.poll_once()]
        server.publish(document(2))
        return [*results, await poller.poll_once()]

    assert run(agent, scenario) == ["applied", "unchanged", "applied"]


def test_a_policy_applied_while_the_disk_is_full_is_cached_once_space_returns_even_without_the_control_plane(
    lite_repo: Path, tmp_path: Path, policy_server: tuple[PolicyServer, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, url = policy_server
    state = tmp_path / "state"
    caplog.set_level(logging.INFO, logger="spillway.agent.policy")
    with small_disk(state) as disk:
        agent = make_agent(lite_repo, tmp_path, url)
        poller = poller_of(agent)

        async def scenario() -> list[Any]:
            server.publish(document(1, mlp={"shed": {"at_or_below": 3}}))
            seen: list[Any] = [await poller.poll_once()]
            disk.fill()
            server.publish(document(2, mlp={"shed": {"at_or_below": 2}}))
            seen.append(await poller.poll_once())  # applied; the cache write refused
            seen.append(agent.status().get("policy_cache"))
            seen.append(await poller.poll_once())  # 304; the write refused again, not logged again
            seen.append(PolicyCache(state, AGENT_ID).load())  # the old document, whole
            disk.free()
            server.failing = 503  # space returns while the control plane is down: the poll tick writes anyway
            seen.append(await poller.poll_once())
            seen.append(agent.status().get("policy_cache"))
            return seen

        seen = run(agent, scenario)
        cached = PolicyCache(state, AGENT_ID).load()
        assert cached is not None and cached.document.version == 2 and cached.etag == server.etag
        assert _state_files(state) == [f"policy-{AGENT_ID}.json"]  # no temporary file left
        # A restart without the control plane runs the policy that was active, not the older one.
        restarted = make_agent(lite_repo, tmp_path, f"http://127.0.0.1:{free_port()}")
        assert run(restarted, restarted.applier.apply_cached) is True
        assert restarted.applier.plan.version == 2 and restarted.status()["policy_cache"]["version"] == 2
    assert seen[0] == "applied" and seen[1] == "applied" and seen[3] == "unchanged" and seen[5] == "failed"
    assert agent.applier.plan.version == 2
    held_while_full = seen[4]
    assert held_while_full is not None and held_while_full.document.version == 1
    behind, caught_up = seen[2], seen[6]
    assert behind["behind"] is True and behind["version"] == 1 and behind["pending_version"] == 2
    assert behind["consecutive_failures"] == 1 and "No space left on device" in behind["last_error"]
    assert caught_up["behind"] is False and caught_up["version"] == 2 and caught_up["pending_version"] is None
    assert caught_up["consecutive_failures"] == 0
    refused = [r for r in caplog.records if "could not cache policy version 2" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING  # one line for the streak of two
    assert sum("cached policy version 2 after 2 failed write(s)" in r.getMessage() for r in caplog.records) == 1


def _state_files(state: Path) -> list[str]:
    """The files of a state directory but the memory measurements kept beside the policy (memory-needs.json)."""
    return sorted(p.name for p in state.iterdir() if p.name != "memory-needs.json")
