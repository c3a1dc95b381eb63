"""Property-based API testing: schemathesis drives every operation of the OpenAPI schema with an admin key
against a real server on loopback, and finds no 5xx and no response that breaks the schema."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
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
from tests.utils.builders import make_agent, make_backend, make_rule, make_slo
from tests.utils.server import serving

EXAMPLES = 20
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@dataclass
class Live:
    base: str
    headers: dict[str, str]
    raw_schema: dict


@pytest.fixture
def live(db_url: str) -> Iterator[Live]:
    """A real server on SQLite and on PostgreSQL (which refuses more: NUL in text, NaN in JSON)."""
    url = db_url
    admin = make_keys(url)["admin"]
    headers = {"Authorization": f"Bearer {admin}"}
    with serving(create_app(Settings(database_url=url))) as base:
        with httpx.Client(base_url=base, headers=headers) as client:
            # Some existing data, so that GET/PUT/PATCH/DELETE of real ids are reachable too.
            for path, body in (
                ("slos", make_slo()),
                ("rules", make_rule()),
                ("backends", make_backend()),
                ("agents", make_agent()),
            ):
                assert client.post(f"/api/v1/{path}", json=body).status_code == 201
            raw = client.get("/api/v1/openapi.json").json()
        yield Live(base, headers, raw)


def _operations(raw: dict) -> list:
    return [result.ok() for result in schemathesis.openapi.from_dict(raw).get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_api_has_no_server_errors_and_keeps_its_schema(live: Live, mode: GenerationMode) -> None:
    """Drives each operation directly (schemathesis' pytest plugin does not run on pytest 9.2)."""
    operations = _operations(live.raw_schema)
    assert len(operations) >= 30
    failures: list[str] = []
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def run(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=live.base, headers=live.headers, checks=CHECKS)

        try:
            run()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE, operation.label  # nothing to make invalid, e.g. /healthz
        except Exception as exc:  # collect every operation's failure, then report them together
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
