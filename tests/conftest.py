"""Fixtures: a real database (SQLite file, or PostgreSQL when reachable), the real app, and keys of each role."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import make_url

from controlplane.access import issue_api_key
from controlplane.app import create_app
from controlplane.db import MetricRollup, make_engine, make_sessionmaker, migrate_to, normalise_url, transaction
from controlplane.db.repository import Actor
from controlplane.settings import Settings
from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
from tests.utils.builders import make_agent
from tests.utils.server import serving

PG_ENV = "SPILLWAY_TEST_POSTGRES_URL"


def _postgres_admin_url() -> str | None:
    url = os.environ.get(PG_ENV)
    if not url:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {PG_ENV} is not set: .ci/run must start PostgreSQL")
        return None
    return normalise_url(url)


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    url = _postgres_admin_url()
    if url is None:
        pytest.skip(f"no PostgreSQL: set {PG_ENV} (e.g. from .ci/postgres.sh) to run the PostgreSQL tests")
    try:
        engine = create_engine(url)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but PostgreSQL at {PG_ENV} is unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {PG_ENV} is unreachable: {exc}")
    return url


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh, empty database for one test, dropped afterwards."""
    name = f"spillway_t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(postgres_admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'spillway.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """Both backends: tests that take this run on SQLite and on PostgreSQL."""
    return str(request.getfixturevalue(f"{request.param}_url"))


@dataclass
class Api:
    """A test client plus one key per role, and helpers to call as each."""

    client: TestClient
    url: str
    keys: dict[str, str]

    def headers(self, role: str = "admin", **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}", **extra}

    def call(self, method: str, path: str, role: str = "admin", **kw: object) -> httpx.Response:
        headers = {**self.headers(role), **kw.pop("headers", {})}  # type: ignore[dict-item]
        return self.client.request(method, path, headers=headers, **kw)  # type: ignore[arg-type]


def make_keys(url: str) -> dict[str, str]:
    migrate_to(url)
    engine = make_engine(url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            return {
                role: issue_api_key(session, f"test-{role}", role, Actor("test"))[1]
                for role in ("viewer", "editor", "admin")
            }
    finally:
        engine.dispose()


@pytest.fixture(autouse=True)
def _ingest_log_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's control planes keep their ingest log under its tmp_path (never in ~/.local/state), also those
    started as processes (they inherit the variable)."""
    if "SPILLWAY_INGEST_LOG_DIR" not in os.environ:
        monkeypatch.setenv("SPILLWAY_INGEST_LOG_DIR", str(tmp_path / "ingest-log"))


def open_api(url: str, **settings: object) -> Iterator[Api]:
    """The real app on `url`; its control loop runs only when a test drives it (or sets an interval)."""
    keys = make_keys(url)
    settings.setdefault("control_loop_interval_s", 0)
    app = create_app(Settings(database_url=url, **settings))  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        yield Api(client, url, keys)


@pytest.fixture
def api(db_url: str) -> Iterator[Api]:
    """The real app on SQLite and on PostgreSQL."""
    yield from open_api(db_url)


@pytest.fixture
def sqlite_api(sqlite_url: str) -> Iterator[Api]:
    """The real app on SQLite only, for tests whose subject is not the database."""
    yield from open_api(sqlite_url)


@dataclass
class Plane:
    url: str
    db: str
    admin: str
    agent_id: str
    token: str
    app: Any = None

    def rollups(self, metric: str) -> list[MetricRollup]:
        if self.app is not None:  # what this plane acknowledged (ingest log) is applied before the read
            self.app.state.ingestor.wait_applied(timeout=10)
        engine = make_engine(self.db)
        try:
            with make_sessionmaker(engine)() as session:
                return list(session.scalars(select(MetricRollup).where(MetricRollup.metric == metric)))
        finally:
            engine.dispose()


@pytest.fixture
def plane(db_url: str) -> Iterator[Plane]:
    admin = make_keys(db_url)["admin"]
    app = create_app(Settings(database_url=db_url, max_series_per_agent=40, control_loop_interval_s=0))
    with serving(app) as url:
        created = httpx.post(f"{url}/api/v1/agents", json=make_agent(), headers={"Authorization": f"Bearer {admin}"})
        body = created.json()
        yield Plane(url, db_url, admin, body["agent"]["id"], body["token"], app)


def telemetry_for(plane: Plane, agent_id: str | None = None) -> AgentTelemetry:
    settings = TelemetrySettings(
        agent_id=agent_id or plane.agent_id, control_plane=plane.url, agent_token=plane.token,
        export_interval_s=3600, latency_buckets_ms=(10.0, 100.0),
        export_timeout_s=30,  # a busy CI machine: the one export these tests count must not time out
    )  # fmt: skip
    return AgentTelemetry(settings, probes=False)


@pytest.fixture
def factory(db_url: str) -> Iterator[Any]:
    """A session factory on a migrated database (SQLite and PostgreSQL, through `db_url`)."""
    migrate_to(db_url)
    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()
