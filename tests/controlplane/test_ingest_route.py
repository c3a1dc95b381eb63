"""The ingest route's own duties: agent tokens trusted for SPILLWAY_AGENT_AUTH_CACHE_S and no longer, 503 (never
500) when the store fails, reads that wait for acknowledged exports (read-your-writes), and its OpenAPI entry."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Api, open_api
from tests.utils.builders import make_agent
from tests.utils.otlp import cumulative_export

PROTOBUF = {"Content-Type": "application/x-protobuf"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _agent(api: Api) -> tuple[str, str]:
    created = api.call("POST", "/api/v1/agents", json=make_agent()).json()
    return created["agent"]["id"], created["token"]


def _export(api: Api, agent_id: str, token: str, k: int, start_ns: int = 1) -> Any:
    body = cumulative_export(agent_id, start_ns, k)
    return api.client.post("/v1/metrics", content=body, headers={**PROTOBUF, "Authorization": f"Bearer {token}"})


@pytest.fixture
def logged(sqlite_url: str, tmp_path: Any) -> Iterator[Api]:
    yield from open_api(sqlite_url, ingest_ack="logged", ingest_log_dir=str(tmp_path / "log"), agent_auth_cache_s=5)


@pytest.fixture
def applied(sqlite_url: str) -> Iterator[Api]:
    yield from open_api(sqlite_url, ingest_ack="applied")


def test_a_rotated_agent_token_works_on_the_hot_paths_until_the_cache_time_then_stops(logged: Api) -> None:
    clock = Clock()
    logged.client.app.state.agent_tokens.clock = clock  # type: ignore[attr-defined]
    agent_id, old = _agent(logged)
    poll = f"/api/v1/agents/{agent_id}/policy"
    assert _export(logged, agent_id, old, 1).status_code == 200  # checked against the database, then trusted
    assert logged.client.get(poll, headers={"Authorization": f"Bearer {old}"}).status_code == 200
    new = logged.call("POST", f"/api/v1/agents/{agent_id}/token").json()["token"]
    clock.now += 4.9  # within the 5 s: the old token is still trusted on the export and the poll
    assert _export(logged, agent_id, old, 2).status_code == 200
    assert logged.client.get(poll, headers={"Authorization": f"Bearer {old}"}).status_code == 200
    clock.now += 0.2  # past it: asked again, and refused
    assert _export(logged, agent_id, old, 3).status_code == 401
    assert logged.client.get(poll, headers={"Authorization": f"Bearer {old}"}).status_code == 401
    assert _export(logged, agent_id, new, 3).status_code == 200
    # Everywhere else an agent token is checked on every request: the old one is refused at once.
    assert logged.client.get("/api/v1/whoami", headers={"Authorization": f"Bearer {old}"}).status_code == 401


def test_a_deleted_agent_stops_exporting_after_the_cache_time(logged: Api) -> None:
    clock = Clock()
    logged.client.app.state.agent_tokens.clock = clock  # type: ignore[attr-defined]
    agent_id, token = _agent(logged)
    assert _export(logged, agent_id, token, 1).status_code == 200
    assert logged.call("DELETE", f"/api/v1/agents/{agent_id}").status_code == 204
    clock.now += 5.0
    assert _export(logged, agent_id, token, 2).status_code == 401


def test_a_store_failure_answers_503_with_retry_after_never_500(applied: Api, sqlite_url: str) -> None:
    agent_id, token = _agent(applied)
    assert _export(applied, agent_id, token, 1).status_code == 200
    path = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:  # the rollups' table gone: every transaction of the applier fails
        db.execute("ALTER TABLE metric_rollups RENAME TO metric_rollups_away")
    failed = _export(applied, agent_id, token, 2)
    assert failed.status_code == 503, failed.text
    assert failed.headers["retry-after"] == "1" and failed.json()["error"] == "overloaded"
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE metric_rollups_away RENAME TO metric_rollups")
    assert _export(applied, agent_id, token, 2).status_code == 200  # the exporter's retry: stored, once
    metrics = applied.call("GET", f"/api/v1/agents/{agent_id}/metrics", params={"window": "1h"}).json()
    assert metrics["requests"] == 8.0


def test_rollup_reads_wait_for_the_exports_acknowledged_before_them(logged: Api, sqlite_url: str) -> None:
    agent_id, token = _agent(logged)
    assert _export(logged, agent_id, token, 1).status_code == 200  # its token checked (a write: last_seen) and cached
    blocker = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), timeout=30, isolation_level=None,
                              check_same_thread=False)  # fmt: skip
    blocker.execute("BEGIN IMMEDIATE")  # the applier cannot commit: acknowledged exports wait in the log
    released = threading.Event()

    def release() -> None:
        blocker.execute("ROLLBACK")
        released.set()

    try:
        for k in (2, 3):
            assert _export(logged, agent_id, token, k).status_code == 200
        timer = threading.Timer(0.3, release)
        timer.start()
        metrics = logged.call("GET", f"/api/v1/agents/{agent_id}/metrics", params={"window": "1h"}).json()
        assert released.is_set()
        assert metrics["requests"] == 12.0  # export 3's cumulative count: 3 x (3 served + 1 refused)
    finally:
        timer.join()
        blocker.close()


def test_the_openapi_document_describes_the_lean_route(logged: Api) -> None:
    operation = logged.call("GET", "/api/v1/openapi.json").json()["paths"]["/v1/metrics"]["post"]
    assert {"200", "400", "401", "403", "413", "415", "503"} <= set(operation["responses"])
    assert operation["security"] and "application/x-protobuf" in operation["responses"]["200"]["content"]


def test_ingest_statistics_are_in_the_scrape(logged: Api) -> None:
    agent_id, token = _agent(logged)
    assert _export(logged, agent_id, token, 1).status_code == 200
    logged.call("GET", f"/api/v1/agents/{agent_id}/metrics")  # read-your-writes: applied by now
    scrape = logged.call("GET", "/metrics", role="viewer").text
    assert "spillway_ingest_submitted_exports_total 1.0" in scrape
    assert "spillway_ingest_applied_total 1.0" in scrape
    assert "spillway_ingest_queued_exports 0.0" in scrape
    assert "spillway_ingest_log_bytes " in scrape
