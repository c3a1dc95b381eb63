"""Authentication and authorisation: every route but the probes needs credentials, and roles are enforced."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy import select

from controlplane.db import ApiKey, make_engine, make_sessionmaker
from controlplane.secrets import hash_secret
from tests.conftest import Api
from tests.utils.builders import BUILDERS, make_agent

PROBES = {"/healthz", "/readyz"}
RANK = {"viewer": 0, "editor": 1, "admin": 2, "agent": 99}  # no operator role reaches agent endpoints
AGENT_ONLY = {
    "/v1/metrics",
    "/v2/models/{model}/infer",
    "/v2/models/{model}/versions/{version}/infer",
    "/v1/completions",
    "/v1/chat/completions",
}  # the telemetry receiver and the gateway (V2 and OpenAI)
READ_ONLY = {"/metrics", "/api/v1/agents/{item_id}/metrics"}  # Prometheus scrape, an agent's telemetry
AGENT_OWN = {"/api/v1/agents/{item_id}/policy"}  # viewers, and the agent itself (tests/controlplane/test_policy_api.py)
ANY_CALLER = {"/api/v1/whoami"}  # every authenticated caller, agents included: who it is


def error_code(body: dict[str, Any]) -> str:
    """The control plane's `{"error": code, ...}`, or OpenAI's `{"error": {"code": ...}}` (the gateway's relay)."""
    error = body["error"]
    return str(error if isinstance(error, str) else error["code"])


def error_message(body: dict[str, Any]) -> str:
    return str(body["message"] if "message" in body else body["error"]["message"])


def walk_routes(app: FastAPI) -> Iterator[tuple[str, str]]:
    """(method, path) of every route the app serves, including routers nested by include_router."""

    def walk(routes: Any) -> Iterator[tuple[str, str]]:
        for route in routes:
            if hasattr(route, "effective_candidates"):  # FastAPI >= 0.160 keeps included routers as branches
                yield from walk(route.effective_candidates())
                continue
            if hasattr(route, "routes"):
                yield from walk(route.routes)
                continue
            original = getattr(route, "original_route", route)
            for method in sorted(getattr(original, "methods", None) or []):
                if method != "HEAD":
                    yield method, route.path

    yield from walk(app.routes)


def required_role(method: str, path: str) -> str:
    """The role matrix: who may do what. A route this does not know fails the tests below."""
    if path in AGENT_ONLY:
        return "agent"
    if path in READ_ONLY:
        assert method == "GET", (method, path)
        return "viewer"
    if path.startswith("/api/v1/keys"):
        return "admin"
    if method == "GET" and path.startswith("/api/v1/"):
        return "viewer"
    if path.startswith(("/api/v1/agents", "/api/v1/tenants")):  # tenants hold tokens: admin, as keys and agents
        return "admin"
    if re.match(r"^/api/v1/(slos|rules|backends)(/\{item_id\})?$", path) or path == "/api/v1/slos/import":
        return "editor"
    raise AssertionError(f"{method} {path} is not in the role matrix: decide who may call it")


def _concrete(path: str) -> str:
    return re.sub(r"\{event_id\}", "1", re.sub(r"\{[^}]+\}", "0000000000000000", path))


def _body(path: str) -> dict[str, Any]:
    for plural, builder in BUILDERS.items():
        if f"/{plural}" in path:
            return builder()
    return {"name": "k", "role": "viewer"}


def test_the_walker_sees_every_documented_route(sqlite_api: Api) -> None:
    walked = {(m, p) for m, p in walk_routes(sqlite_api.client.app)}  # type: ignore[arg-type]
    schema = sqlite_api.call("GET", "/api/v1/openapi.json", role="viewer").json()
    documented = {(m.upper(), p) for p, ops in schema["paths"].items() for m in ops}
    assert documented <= walked
    assert len(walked) >= 30


def test_every_route_but_the_probes_refuses_missing_and_bad_credentials(sqlite_api: Api) -> None:
    routes = list(walk_routes(sqlite_api.client.app))  # type: ignore[arg-type]
    for method, path in routes:
        url = _concrete(path)
        for headers in ({}, {"Authorization": "Bearer spk_0000000000000000_wrong"}, {"Authorization": "Basic eDp5"}):
            response = sqlite_api.client.request(method, url, headers=headers, json=_body(path))
            if path in PROBES:
                assert response.status_code == 200, (method, path)
                assert set(response.json()) == {"status"}  # probes reveal nothing else
            else:
                assert response.status_code == 401, (method, path, headers, response.text)
                assert error_code(response.json()) == "unauthenticated"
                assert response.headers["www-authenticate"] == "Bearer"


def test_role_matrix(sqlite_api: Api) -> None:
    for method, path in walk_routes(sqlite_api.client.app):  # type: ignore[arg-type]
        if path in PROBES:
            continue
        needed = required_role(method, path)
        for role in ("viewer", "editor", "admin"):
            response = sqlite_api.call(method, _concrete(path), role=role, json=_body(path))
            if RANK[role] < RANK[needed]:
                assert response.status_code == 403, (role, method, path, response.text)
                assert needed in error_message(response.json())  # e.g. "this needs the 'editor' role", "for agents"
            else:  # allowed: the call reaches the route (404 for the made-up ids, 422 for a clashing body, 415 for
                # JSON where YAML is wanted, ...)
                assert response.status_code in (200, 201, 204, 404, 409, 415, 422), (role, method, path, response.text)


def test_agent_tokens_reach_no_operator_endpoint(sqlite_api: Api) -> None:
    token = sqlite_api.call("POST", "/api/v1/agents", json=make_agent()).json()["token"]
    for method, path in walk_routes(sqlite_api.client.app):  # type: ignore[arg-type]
        if path in PROBES or path in AGENT_ONLY:
            continue
        response = sqlite_api.client.request(
            method, _concrete(path), headers={"Authorization": f"Bearer {token}"}, json=_body(path)
        )
        if path in ANY_CALLER:
            assert response.status_code == 200 and response.json()["kind"] == "agent", (method, path)
            continue
        assert response.status_code == 403, (method, path)
        if path in AGENT_OWN:  # another agent's: refused for that reason
            assert "only its own" in response.json()["message"]


def test_keys_are_random_hashed_shown_once_and_revocable(sqlite_api: Api) -> None:
    created = sqlite_api.call("POST", "/api/v1/keys", json={"name": "ops-anna", "role": "editor"})
    assert created.status_code == 201
    key, ident = created.json()["key"], created.json()["api_key"]["id"]
    secret = key.split("_", 2)[2]
    assert len(secret) >= 43  # 256 bits, URL-safe base64
    # Stored as a hash only; never in any later response.
    engine = make_engine(sqlite_api.url)
    with make_sessionmaker(engine)() as session:
        row = session.scalars(select(ApiKey).where(ApiKey.id == ident)).one()
        assert row.key_hash == hash_secret(secret)
    engine.dispose()
    listing = sqlite_api.call("GET", "/api/v1/keys").text + sqlite_api.call("GET", f"/api/v1/keys/{ident}").text
    assert secret not in listing and row.key_hash not in listing

    as_anna = {"Authorization": f"Bearer {key}"}
    assert sqlite_api.client.get("/api/v1/slos", headers=as_anna).status_code == 200
    assert sqlite_api.call("DELETE", f"/api/v1/keys/{ident}").status_code == 204
    refused = sqlite_api.client.get("/api/v1/slos", headers=as_anna)
    assert refused.status_code == 401
    assert "revoked" in refused.json()["message"]
    revoked = sqlite_api.call("GET", "/api/v1/keys", params={"include_revoked": True}).json()["items"]
    assert any(k["id"] == ident and k["revoked_at"] for k in revoked)


def test_role_changes_take_effect_at_once(sqlite_api: Api) -> None:
    created = sqlite_api.call("POST", "/api/v1/keys", json={"name": "ops-ben", "role": "viewer"}).json()
    headers = {"Authorization": f"Bearer {created['key']}"}
    assert sqlite_api.client.post("/api/v1/slos", headers=headers, json=BUILDERS["slos"]()).status_code == 403
    sqlite_api.call("PATCH", f"/api/v1/keys/{created['api_key']['id']}", json={"role": "editor"})
    assert sqlite_api.client.post("/api/v1/slos", headers=headers, json=BUILDERS["slos"]()).status_code == 201


def test_the_last_admin_key_cannot_be_revoked_or_demoted(sqlite_api: Api) -> None:
    admins = [k for k in sqlite_api.call("GET", "/api/v1/keys").json()["items"] if k["role"] == "admin"]
    assert len(admins) == 1
    ident = admins[0]["id"]
    assert sqlite_api.call("DELETE", f"/api/v1/keys/{ident}").status_code == 409
    assert sqlite_api.call("PATCH", f"/api/v1/keys/{ident}", json={"role": "viewer"}).status_code == 409
    second = sqlite_api.call("POST", "/api/v1/keys", json={"name": "admin-2", "role": "admin"}).json()["key"]
    assert sqlite_api.call("DELETE", f"/api/v1/keys/{ident}").status_code == 204
    assert sqlite_api.client.get("/api/v1/keys", headers={"Authorization": f"Bearer {second}"}).status_code == 200


def test_agent_token_is_shown_once_and_rotation_invalidates_the_old_one(sqlite_api: Api) -> None:
    created = sqlite_api.call("POST", "/api/v1/agents", json=make_agent()).json()
    old, ident = created["token"], created["agent"]["id"]
    assert old.startswith(f"spa_{ident}_")
    assert old not in sqlite_api.call("GET", f"/api/v1/agents/{ident}").text
    rotated = sqlite_api.call("POST", f"/api/v1/agents/{ident}/token").json()["token"]
    assert rotated != old
    stale = sqlite_api.client.get("/api/v1/status", headers={"Authorization": f"Bearer {old}"})
    assert stale.status_code == 401
    fresh = sqlite_api.client.get("/api/v1/status", headers={"Authorization": f"Bearer {rotated}"})
    assert fresh.status_code == 403  # a valid agent, but not for operator endpoints


@pytest.mark.parametrize("role", ["admin", "viewer"])
def test_create_key_cli_prints_the_key_alone(sqlite_url: str, role: str) -> None:
    env = {"SPILLWAY_DATABASE_URL": sqlite_url, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "spillway.cli", "controlplane", "create-key", "--role", role, "--name", "first"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )
    assert re.fullmatch(r"spk_[0-9a-f]{16}_[A-Za-z0-9_-]{43}\n", out.stdout)
    dup = subprocess.run(
        [sys.executable, "-m", "spillway.cli", "controlplane", "create-key", "--role", role, "--name", "first"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert dup.returncode == 1
    assert dup.stdout == ""
    assert "already exists" in dup.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "spillway.cli", "controlplane", "create-key", "--role", "root", "--name", "x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "--role" in bad.stderr


def test_key_listing_pages_and_hides_revoked_by_default(sqlite_api: Api) -> None:
    made = [sqlite_api.call("POST", "/api/v1/keys", json={"name": f"k-{i}", "role": "viewer"}).json() for i in range(3)]
    sqlite_api.call("DELETE", f"/api/v1/keys/{made[0]['api_key']['id']}")
    names: list[str] = []
    cursor = None
    for _ in range(10):
        page = sqlite_api.call("GET", "/api/v1/keys", params={"limit": 2, **({"cursor": cursor} if cursor else {})})
        names += [k["name"] for k in page.json()["items"]]
        cursor = page.json()["next_cursor"]
        if cursor is None:
            break
    assert names == ["k-1", "k-2", "test-admin", "test-editor", "test-viewer"]


def test_credentials_are_checked_before_the_body_is_parsed(sqlite_api: Api) -> None:
    for path in ("/api/v1/slos", "/api/v1/keys", "/api/v1/no-such-route"):
        response = sqlite_api.client.post(path, content=b"{bad", headers={"Content-Type": "application/json"})
        assert response.status_code == 401, (path, response.text)


def test_rotating_a_token_is_an_edit_with_a_new_etag(sqlite_api: Api) -> None:
    created = sqlite_api.client.post("/api/v1/agents", json=make_agent(), headers=sqlite_api.headers())
    etag, ident = created.headers["etag"], created.json()["agent"]["id"]
    first = sqlite_api.call("POST", f"/api/v1/agents/{ident}/token", headers={"If-Match": etag})
    assert first.status_code == 200 and first.headers["etag"] != etag
    # A second admin acting on the same read must not silently replace the token the first one just got.
    second = sqlite_api.call("POST", f"/api/v1/agents/{ident}/token", headers={"If-Match": etag})
    assert second.status_code == 412
