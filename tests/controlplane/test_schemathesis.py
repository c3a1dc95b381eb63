"""Property-based API testing: schemathesis drives every operation of the OpenAPI schema, under several seeds, with
an admin key against a real server on loopback, and finds no 5xx and no response that breaks the schema.

Path ids are real about half the time (a stored SLO, rule, backend, agent, API key or event), so that reads and
writes get past the lookup and into the resource's own validation and storage; what an operation deletes is
stored again before the next one. Each seed's run is deterministic: the same seed draws the same requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from controlplane.app import create_app
from controlplane.settings import Settings
from tests.conftest import make_keys
from tests.utils.builders import BUILDERS
from tests.utils.server import serving

# 20261130: the run of issue 11 that found a 500 in PATCH /api/v1/slos/{id}. Each store draws from its own seed (both
# seeds on both stores cost about 50 s more of CI's 15-minute budget), so the two runs still explore different requests.
SEEDS = {"sqlite": 20261130, "postgresql": 1}
EXAMPLES = 10  # per operation, store and mode: 10 x 2 modes x 2 stores per operation, in bounded time
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@dataclass
class Live:
    """A served app, the admin's headers, the schema, and one real id per collection (kept stored)."""

    base: str
    store: str  # sqlite | postgresql
    headers: dict[str, str]
    raw_schema: dict[str, Any]
    client: httpx.Client
    ids: dict[str, str] = field(default_factory=dict)

    def restore(self) -> None:
        """Store again what the previous operation deleted (or revoked), so that every operation sees real ids."""
        for plural, builder in BUILDERS.items():
            ident = self.ids.get(plural)
            if ident is None or self.client.get(f"/api/v1/{plural}/{ident}").status_code == 404:
                created = self.client.post(f"/api/v1/{plural}", json=builder())
                assert created.status_code == 201, created.text
                body = created.json()
                self.ids[plural] = body["agent"]["id"] if plural == "agents" else body["id"]
        key = self.ids.get("keys")
        if key is None or self.client.get(f"/api/v1/keys/{key}").json()["revoked_at"] is not None:
            body = self.client.post("/api/v1/keys", json={"name": f"target-{time.monotonic_ns()}", "role": "viewer"})
            self.ids["keys"] = body.json()["api_key"]["id"]  # the admin's own key is never a target
        self.ids["events"] = str(self.client.get("/api/v1/events", params={"limit": 1}).json()["items"][0]["id"])


@pytest.fixture
def live(db_url: str) -> Iterator[Live]:
    """A real server on SQLite and on PostgreSQL (which refuses more: NUL in text, NaN in JSON)."""
    admin = make_keys(db_url)["admin"]
    headers = {"Authorization": f"Bearer {admin}"}
    with (
        serving(create_app(Settings(database_url=db_url))) as base,
        # 30 s, not httpx's 5 s: a fresh-clone CI run once timed out restore()'s GET after 5 s on SQLite (not
        # reproduced in isolation). What this test checks is 5xx and schema conformance, not latency.
        httpx.Client(base_url=base, headers=headers, timeout=30) as client,
    ):
        store = db_url.split(":", 1)[0].split("+", 1)[0]
        live = Live(base, store, headers, client.get("/api/v1/openapi.json").json(), client)
        live.restore()
        yield live


def _operations(raw: dict[str, Any]) -> list[Any]:
    return [result.ok() for result in schemathesis.openapi.from_dict(raw).get_all_operations()]


def _collection(path: str) -> str | None:
    """'slos' for /api/v1/slos/{item_id}[/...], 'keys' for /api/v1/keys/{key_id}, ...; None for other paths."""
    parts = path.strip("/").split("/")
    return parts[2] if len(parts) >= 4 and parts[:2] == ["api", "v1"] and parts[3].startswith("{") else None


def _drive(live: Live, session: requests.Session, operation: Any, mode: GenerationMode, each_seed: int) -> None:
    """EXAMPLES requests to one operation, drawn from `each_seed`; raises on the first failing check."""
    collection = _collection(operation.path)

    @seed(each_seed)
    @given(case=operation.as_strategy(generation_mode=mode), real=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case: schemathesis.Case, real: bool) -> None:
        if real and collection is not None and case.path_parameters:
            name = next(iter(case.path_parameters))
            case.path_parameters = {**case.path_parameters, name: live.ids[collection]}
        case.call_and_validate(base_url=live.base, session=session, headers=live.headers, checks=CHECKS)

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_api_has_no_server_errors_and_keeps_its_schema(live: Live, mode: GenerationMode) -> None:
    """Drives each operation directly (schemathesis' pytest plugin does not run on pytest 9.2)."""
    operations = _operations(live.raw_schema)
    documented = {(method.upper(), path) for path, ops in live.raw_schema["paths"].items() for method in ops}
    assert {(op.method.upper(), op.path) for op in operations} == documented  # every operation, none skipped
    failures: list[str] = []
    each_seed = SEEDS[live.store]
    with requests.Session() as session:  # one keep-alive connection for every request
        for operation in operations:
            live.restore()
            try:
                _drive(live, session, operation, mode, each_seed)
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE, operation.label  # nothing to make invalid, e.g. /healthz
            except Exception as exc:  # collect every operation's failure, then report them together
                failures.append(f"seed {each_seed}, {operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
