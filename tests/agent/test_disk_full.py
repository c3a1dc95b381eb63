"""The agent's state directory on a full disk (a real 2 MiB tmpfs filled to the last byte): every request still gets
exactly one answer with its outcome, the agent counts what the client saw, each streak of refused writes is logged
once, and everything works again when space returns, without a restart. (The policy cache on a full disk is in
tests/agent/test_policy_client.py; the store's own errors in tests/agent/test_jobs.py.)"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from edge_agent.config import AgentConfig
from edge_agent.overflow.jobs import JobStore
from edge_agent.overflow.queue import AsyncQueue
from edge_agent.serving.server import build_registry
from tests.agent.conftest import RunningAgent, start_agent, stop_agent
from tests.agent.policy_support import infer_body, make_repository
from tests.utils.fullfs import SmallDisk, small_disk
from tests.utils.server import free_port

X = np.random.default_rng(3).standard_normal((2, 512)).astype(np.float32)
REFUSED_LINE = "the async queue cannot store new jobs"
RECOVERED_LINE = "the async queue stores new jobs again"


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path / "state") as mounted:
        yield mounted


@pytest.fixture(scope="module")
def lite_repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repository(demo_repo, tmp_path_factory.mktemp("lite"), versions=(2,))


def _outcomes(agent: RunningAgent) -> Counter[tuple[int, str]]:
    """The agent's outcome counts per (priority, outcome), over every version of mlp."""
    counted: Counter[tuple[int, str]] = Counter()
    for item in httpx.get(f"{agent.url}/v2/spillway/status", timeout=10).json()["outcomes"]:
        counted[(item["priority"], item["outcome"])] += item["count"]
    return counted


def test_a_full_disk_under_the_async_queue_refuses_with_503_async_storage_full_and_recovers_when_space_returns(
    demo_repo: Path, tmp_path: Path, disk: SmallDisk
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens: every overflow falls through to the async queue
    agent = start_agent(
        demo_repo, tmp_path, agent_id="edge-full", state_dir=str(disk.root), fallback_cache_bytes=0,
        intra_op_threads=1, agent_token="t", async_jobs={"models": ["mlp"]},
        overflow={"enabled": True, "gateway": nowhere, "at_or_below": 2},
    )  # fmt: skip
    seen: Counter[tuple[int, str]] = Counter()  # what the client was told, per (priority, outcome header)

    def ask(priority: int) -> httpx.Response:
        answer = httpx.post(f"{agent.url}/v2/models/mlp/infer", json=infer_body(X, priority=priority), timeout=30)
        seen[(priority, answer.headers.get("spillway-outcome", "<none>"))] += 1
        return answer

    try:
        accepted = [ask(2) for _ in range(5)]
        assert [a.status_code for a in accepted] == [202] * 5, accepted[0].text
        jobs = [a.json()["id"] for a in accepted]
        assert [agent.ended_job(j)["status"] for j in jobs] == ["done"] * 5

        disk.fill()
        with ThreadPoolExecutor(8) as pool:  # concurrent, as in the report: 60 requests that fall through
            refused = list(pool.map(lambda _: ask(2), range(60)))
        for answer in refused:
            assert answer.status_code == 503, answer.text
            assert answer.headers["content-type"] == "application/json"
            assert answer.headers["spillway-outcome"] == "rejected"
            assert answer.headers["spillway-reason"] == "async_storage_full"
            assert int(answer.headers["retry-after"]) >= 1
            body = answer.json()
            assert body["outcome"] == "rejected" and body["reason"] == "async_storage_full"
            assert "cannot store it now" in body["error"] and "database or disk is full" in body["error"]
        served = ask(1)  # what the device serves itself is untouched by the disk
        assert served.status_code == 200 and served.headers["spillway-outcome"] == "local"
        kept = httpx.get(f"{agent.url}/spillway/v1/jobs/{jobs[0]}", timeout=10)  # reads work on a full disk
        assert kept.status_code == 200 and kept.json()["status"] == "done"
        full = httpx.get(f"{agent.url}/v2/spillway/status", timeout=10).json()["async_jobs"]

        disk.free()
        again = ask(2)  # the very next submit after space returns is stored: no restart
        assert again.status_code == 202, again.text
        assert agent.ended_job(again.json()["id"])["status"] == "done"

        # Exactly one answer per request, and the agent counted exactly what the client saw.
        assert sum(seen.values()) == 5 + 60 + 1 + 1
        assert seen == {(2, "queued_async"): 6, (2, "rejected"): 60, (1, "local"): 1}
        assert _outcomes(agent) == seen
        recovered = httpx.get(f"{agent.url}/v2/spillway/status", timeout=10).json()["async_jobs"]
    finally:
        stop_agent(agent)
    log = agent.log.read_text()
    assert log.count(REFUSED_LINE) == 1, log  # one line for the streak of 60, not one per request
    assert log.count(RECOVERED_LINE) == 1 and "after 60 failed write(s)" in log, log
    assert "Traceback" not in log and "Internal Server Error" not in log, log
    assert full["store"]["accepting"]["ok"] is False and full["store"]["accepting"]["consecutive_failures"] == 60
    assert recovered["store"]["accepting"]["ok"] is True and recovered["counts"]["done"] == 6


def test_a_job_whose_answer_cannot_be_stored_is_not_left_running_and_runs_again_once_space_returns(
    lite_repo: Path, tmp_path: Path, disk: SmallDisk, caplog: pytest.LogCaptureFixture
) -> None:
    """The drain loop's run of one claimed job, driven directly so that the disk fills between the claim and the
    answer: the answer and then the failure cannot be written; the loop keeps going (claiming nothing new) and, once
    space returns, records the failure (queued again, the attempt counted) and runs the job to `done`."""
    caplog.set_level(logging.INFO, logger="spillway.agent.jobs")
    registry = build_registry(AgentConfig(model_repository=lite_repo, intra_op_threads=1, state_dir=disk.root))
    store = JobStore(disk.root / "jobs.sqlite")
    queue = AsyncQueue(store, registry, ["mlp"], poll_s=0.01)
    request = httpx.Request("POST", "/", json=infer_body(X)).read()

    async def until(condition: Any, what: str) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, f"not {what} after 30 s"
            await asyncio.sleep(0.02)

    def status_of(job_id: str) -> str:
        job = store.get(job_id)
        assert job is not None
        return job.status

    async def scenario() -> dict[str, Any]:
        job = store.submit("mlp", None, request, None)
        claimed = store.claim()
        assert claimed is not None
        disk.fill()
        await queue._run(claimed)  # computed; the disk refuses the answer, then the failure: remembered, not raised
        seen: dict[str, Any] = {"while_full": status_of(job.id), "unrecorded": queue.json()["unrecorded_ends"]}
        queue.start()
        await until(lambda: queue.updating.failures >= 3, "retried by the drain loop")
        assert queue._task is not None and not queue._task.done()  # the loop outlives the disk
        seen["still_running_on_disk"] = status_of(job.id)
        disk.free()
        # Done on disk first (the store's thread), then counted by the queue's coroutine: wait for both.
        await until(lambda: status_of(job.id) == "done" and queue.ran == 1, "done")
        seen["job"] = store.get(job.id)
        seen["queue"] = queue.json()
        await queue.stop()
        return seen

    try:
        seen = asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        for worker in registry.workers():
            worker.close()
    assert seen["while_full"] == "running" and seen["still_running_on_disk"] == "running"
    assert seen["unrecorded"] == 1
    done = seen["job"]
    assert done.attempts == 2 and done.error is None and done.response is not None  # one lost answer, one stored
    assert done.json()["response"]["parameters"]["spillway_outcome"] == "queued_async"
    assert seen["queue"]["ran"] == 1 and seen["queue"]["failed"] == 1 and seen["queue"]["unrecorded_ends"] == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "spillway.agent.jobs"]
    assert sum("cannot update its jobs" in line for line in lines) == 1, lines
    assert sum("updates its jobs again" in line for line in lines) == 1, lines
    assert not any(r.exc_info for r in caplog.records), "no traceback: the disk is not a bug"


def test_an_agent_whose_job_store_cannot_be_created_on_a_full_disk_starts_and_serves_and_queues_once_space_returns(
    demo_repo: Path, tmp_path: Path, disk: SmallDisk
) -> None:
    disk.fill()  # before the agent starts: its job store cannot even be created
    nowhere = f"http://127.0.0.1:{free_port()}"
    agent = start_agent(
        demo_repo, tmp_path, agent_id="edge-born-full", state_dir=str(disk.root / "state"), fallback_cache_bytes=0,
        intra_op_threads=1, agent_token="t", async_jobs={"models": ["mlp"]},
        overflow={"enabled": True, "gateway": nowhere, "at_or_below": 2},
    )  # fmt: skip
    try:
        served = httpx.post(f"{agent.url}/v2/models/mlp/infer", json=infer_body(X, priority=1), timeout=30)
        assert served.status_code == 200 and served.headers["spillway-outcome"] == "local"
        refused = httpx.post(f"{agent.url}/v2/models/mlp/infer", json=infer_body(X, priority=2), timeout=30)
        assert refused.status_code == 503, refused.text
        assert refused.headers["spillway-reason"] == "async_storage_full" and "retry-after" in refused.headers
        status = httpx.get(f"{agent.url}/v2/spillway/status", timeout=10)
        assert status.status_code == 200 and status.json()["async_jobs"]["opened"] is False
        assert status.json()["async_jobs"]["counts"] is None

        disk.free()
        queued = httpx.post(f"{agent.url}/v2/models/mlp/infer", json=infer_body(X, priority=2), timeout=30)
        assert queued.status_code == 202, queued.text
        assert agent.ended_job(queued.json()["id"])["status"] == "done"
        assert httpx.get(f"{agent.url}/v2/spillway/status", timeout=10).json()["async_jobs"]["opened"] is True
        assert _outcomes(agent) == {(1, "local"): 1, (2, "rejected"): 1, (2, "queued_async"): 1}
    finally:
        stop_agent(agent)
    log = agent.log.read_text()
    assert "cannot be opened now" in log and "Traceback" not in log, log
