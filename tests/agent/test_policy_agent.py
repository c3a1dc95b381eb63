"""Policies applied by real agent processes polling a real policy endpoint on loopback: the disk cache across a
restart with the control plane down, and a variant switch (there and back) under concurrent load."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.agent.conftest import RunningAgent, start_agent, stop_agent
from tests.agent.policy_support import AGENT_ID, TOKEN, PolicyServer, document, infer_body, make_repository
from tests.utils.server import serving

X = np.random.default_rng(3).standard_normal((1, 512), dtype=np.float32)


def status(agent: RunningAgent) -> dict[str, Any]:
    response = httpx.get(f"{agent.url}/v2/spillway/status", timeout=10)
    assert response.status_code == 200, response.text
    return dict(response.json())


def wait_for(agent: RunningAgent, condition: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    """Poll the agent's status until `condition` holds (a real process catching up), failing after a minute."""
    deadline = time.monotonic() + 60
    while True:
        current = status(agent)
        if condition(current):
            return current
        assert agent.proc.poll() is None, agent.log.read_text()
        assert time.monotonic() < deadline, f"{what}: {current}\n{agent.log.read_text()[-3000:]}"
        time.sleep(0.05)


def settled(version: int, loaded: list[int]) -> Callable[[dict[str, Any]], bool]:
    """Policy `version` is active, exactly `loaded` versions of mlp are loaded, and none is still draining."""

    def check(s: dict[str, Any]) -> bool:
        model = s["models"]["mlp"]
        return bool(s["policy"]["version"] == version and model["loaded_versions"] == loaded
                    and not model["retiring_versions"])  # fmt: skip

    return check


def settings(url: str, state_dir: Path) -> dict[str, Any]:
    return {"control_plane": url, "agent_token": TOKEN, "agent_id": AGENT_ID, "state_dir": str(state_dir),
            "policy_poll_interval_s": 0.1, "export_interval_s": 60, "intra_op_threads": 1}  # fmt: skip


def test_restarted_with_the_control_plane_down_the_agent_comes_up_with_its_cached_policy(
    demo_repo: Path, tmp_path: Path
) -> None:
    repo = make_repository(demo_repo, tmp_path / "models", versions=(2,))
    server = PolicyServer()
    server.publish(document(3, mlp={"shed": {"at_or_below": 3, "retry_after_s": 9}}))
    with serving(server.app) as url:
        agent = start_agent(repo, tmp_path, **settings(url, tmp_path / "state"))
        try:
            wait_for(agent, lambda s: s["policy"]["version"] == 3, "the policy was not applied")
            shed = httpx.post(f"{agent.url}/v2/models/mlp/infer", json=infer_body(X, priority=3), timeout=30)
            assert shed.status_code == 503 and shed.headers["spillway-reason"] == "shed"
        finally:
            stop_agent(agent)
    # The control plane is gone now. The same agent, started again, serves with the policy it had.
    agent = start_agent(repo, tmp_path, **settings(url, tmp_path / "state"))
    try:
        first = status(agent)  # ready means the cached policy was applied: it is the first thing the agent does
        assert first["policy"]["version"] == 3 and first["policy"]["source"] == "cache"
        assert first["policy"]["etag"] == server.etag
        assert first["models"]["mlp"]["shed"] == {"at_or_below": 3, "retry_after_s": 9}
        shed = httpx.post(f"{agent.url}/v2/models/mlp/infer", json=infer_body(X, priority=3), timeout=30)
        assert shed.status_code == 503 and shed.headers["retry-after"] == "9"
        served = httpx.post(f"{agent.url}/v2/models/mlp/infer", json=infer_body(X, priority=1), timeout=30)
        assert served.status_code == 200 and served.headers["spillway-outcome"] == "local"
        failing = wait_for(agent, lambda s: s["poll"]["last_error"] is not None, "no failed poll was reported")
        assert "cannot reach" in failing["poll"]["last_error"] and failing["policy"]["version"] == 3
    finally:
        stop_agent(agent)


@pytest.mark.parametrize("variant_configured", [False, True], ids=["variant-loaded-on-demand", "both-configured"])
def test_a_variant_switch_there_and_back_under_concurrent_load_answers_every_request_once(
    demo_repo: Path, tmp_path: Path, variant_configured: bool
) -> None:
    versions = (1, 2) if variant_configured else (1,)
    repo = make_repository(demo_repo, tmp_path / "models", versions=versions, deadlines=False)
    server = PolicyServer()
    server.publish(document(1))
    with serving(server.app) as url:
        agent = start_agent(repo, tmp_path, default_versions={"mlp": 1}, **settings(url, tmp_path / "state"))
        sent = [0] * 8
        results: list[tuple[int, str | None, str | None, str | None]] = []
        errors: list[str] = []
        stop = threading.Event()
        lock = threading.Lock()

        def client(i: int) -> None:
            paths = ("/v2/models/mlp/infer", "/v2/models/mlp/versions/1/infer")
            with httpx.Client(base_url=agent.url, timeout=60) as c:
                while not stop.is_set():
                    sent[i] += 1
                    try:
                        r = c.post(paths[sent[i] % 2], json=infer_body(X, priority=1 + sent[i] % 3))
                    except httpx.TransportError as exc:
                        with lock:
                            errors.append(repr(exc))
                        continue
                    version = r.json().get("model_version") if r.status_code == 200 else None
                    with lock:
                        results.append((r.status_code, r.headers.get("spillway-outcome"), version,
                                        r.headers.get("spillway-variant")))  # fmt: skip

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        try:
            wait_for(agent, lambda s: s["policy"]["version"] == 1, "the first policy was not applied")
            for thread in threads:
                thread.start()
            server.publish(document(2, mlp={"variant": 2}))
            loaded = [2] if not variant_configured else [1, 2]
            switched = wait_for(agent, settled(2, loaded), "the variant did not take over")
            assert switched["models"]["mlp"]["served_version"] == 2
            count = len(results)
            while len(results) < count + 20:  # served by the variant for a while
                time.sleep(0.02)
            server.publish(document(3))
            wait_for(agent, settled(3, [*versions]), "the default did not come back")
            count = len(results)
            while len(results) < count + 20:
                time.sleep(0.02)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=120)
            stop_agent(agent)
    assert errors == []
    assert len(results) == sum(sent)  # every request sent got exactly one answer
    assert {(status, outcome) for status, outcome, _, _ in results} == {(200, "local")}
    pairs = {(version, header) for _, _, version, header in results}
    assert pairs == {("1", None), ("2", "2")}  # served by the variant only with the header that says so
    assert results[-1][2:] == ("1", None)
