"""`/api/v1/tenants`: CRUD with ETags and audit events, admin-only writes, tokens made on the server and shown once
(only their SHA-256 digests stored, never listed or logged), and each agent's policy document carrying exactly the
tenants whose selector picks it, at a new version whenever they change.

The lifecycle runs on SQLite and PostgreSQL; the rest share one SQLite control plane (each test its own tenant
names and agent labels, so that none sees another's)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from controlplane.db import make_engine, make_sessionmaker
from controlplane.db.models import Event, Policy, TenantToken, utcnow
from controlplane.rules.policy import document
from controlplane.rules.tenants import locked_policies
from spillway.contract.policy import PolicyDocument, parse
from spillway.contract.tenants import hash_token
from tests.conftest import Api, open_api
from tests.utils.builders import make_agent


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    yield from open_api(f"sqlite:///{tmp_path_factory.mktemp('tenants') / 'spillway.db'}")


def tenant(**over: Any) -> dict[str, Any]:
    body = {"name": "acme", "selector": {"labels": {"site": "berlin"}}, "weight": 3, "max_in_flight": 8,
            "rate_rps": 50.0, "tokens_per_s": 2000.0, "max_streams": 4, "max_priority": 2}  # fmt: skip
    return {**body, **over}


def create(api: Api, **over: Any) -> str:
    created = api.call("POST", "/api/v1/tenants", json=tenant(**over))
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def enrol(api: Api, name: str, **labels: str) -> str:
    created = api.call("POST", "/api/v1/agents", json=make_agent(name=name, labels=labels))
    assert created.status_code == 201, created.text
    return str(created.json()["agent"]["id"])


def policy(api: Api, agent_id: str) -> dict[str, Any]:
    got = api.call("GET", f"/api/v1/agents/{agent_id}/policy", role="viewer")
    assert got.status_code == 200, got.text
    parse(got.content)  # the agent's own parser takes it
    return dict(got.json())


def tenant_events(api: Api, ident: str | None = None) -> list[dict[str, Any]]:
    items = api.call("GET", "/api/v1/events", params={"kind": "tenant.*", "limit": 500}).json()["items"]
    return [e for e in items if ident is None or e["subject_id"] == ident]


def stored_tokens(api: Api, ident: str) -> list[TenantToken]:
    engine = make_engine(api.url)
    try:
        with make_sessionmaker(engine)() as session:
            return list(session.scalars(select(TenantToken).where(TenantToken.tenant_id == ident)))
    finally:
        engine.dispose()


def test_lifecycle_with_etags_events_and_the_policy_documents(api: Api) -> None:
    berlin, munich = enrol(api, "edge-berlin", site="berlin"), enrol(api, "edge-munich", site="munich")
    before = {a: policy(api, a)["version"] for a in (berlin, munich)}
    assert policy(api, berlin)["tenants"] is None  # no tenants: the document says what it said before them

    created = api.call("POST", "/api/v1/tenants", json=tenant(), headers={"X-Spillway-Reason": "acme onboarded"})
    assert created.status_code == 201, created.text
    body, etag = created.json(), created.headers["etag"]
    assert created.headers["location"] == f"/api/v1/tenants/{body['id']}"
    assert (body["name"], body["selector"], body["weight"], body["max_priority"]) == (
        "acme", {"labels": {"site": "berlin"}}, 3.0, 2)  # fmt: skip
    got = api.call("GET", f"/api/v1/tenants/{body['id']}", role="viewer")
    assert (got.json(), got.headers["etag"]) == (body, etag)

    # Only the agent the selector picks gets it, at a new version; the other's document is untouched.
    doc = policy(api, berlin)
    assert doc["version"] == before[berlin] + 1
    assert doc["tenants"] == [{"name": "acme", "token_sha256": [], "weight": 3.0, "max_in_flight": 8, "rate_rps": 50.0,
                               "tokens_per_s": 2000.0, "max_streams": 4, "max_priority": 2}]  # fmt: skip
    assert policy(api, munich) == {**policy(api, munich), "version": before[munich], "tenants": None}

    patched = api.call("PATCH", f"/api/v1/tenants/{body['id']}", json={"weight": 5, "rate_rps": None},
                       headers={"If-Match": etag})  # fmt: skip
    assert patched.status_code == 200, patched.text
    assert (patched.json()["weight"], patched.json()["rate_rps"], patched.json()["version"]) == (5.0, None, 2)
    doc = policy(api, berlin)
    assert (doc["version"], doc["tenants"][0]["weight"], doc["tenants"][0]["rate_rps"]) == (before[berlin] + 2, 5, None)
    stale = api.call("PUT", f"/api/v1/tenants/{body['id']}", json=tenant(weight=1), headers={"If-Match": etag})
    assert (stale.status_code, stale.json()["error"]) == (412, "precondition_failed")
    assert api.call("DELETE", f"/api/v1/tenants/{body['id']}", headers={"If-Match": etag}).status_code == 412

    # Moved to Munich: it leaves Berlin's document and joins Munich's, each at a new version.
    moved = api.call("PUT", f"/api/v1/tenants/{body['id']}", json=tenant(selector={"labels": "site=munich"}),
                     headers={"If-Match": patched.headers["etag"]})  # fmt: skip
    assert moved.status_code == 200, moved.text
    assert (policy(api, berlin)["tenants"], policy(api, berlin)["version"]) == (None, before[berlin] + 3)
    assert [t["name"] for t in policy(api, munich)["tenants"]] == ["acme"]
    assert policy(api, munich)["version"] == before[munich] + 1

    listed = api.call("GET", "/api/v1/tenants", role="viewer").json()
    assert [t["id"] for t in listed["items"]] == [body["id"]]
    deleted = api.call("DELETE", f"/api/v1/tenants/{body['id']}", headers={"If-Match": moved.headers["etag"]})
    assert deleted.status_code == 204
    assert api.call("GET", f"/api/v1/tenants/{body['id']}").status_code == 404
    assert policy(api, munich)["tenants"] is None

    events = tenant_events(api)
    assert [e["kind"] for e in events] == ["tenant.deleted", "tenant.updated", "tenant.updated", "tenant.created"]
    assert (events[-1]["actor"], events[-1]["reason"]) == ("key:test-admin", "acme onboarded")
    assert events[1]["data"]["changes"]["selector"] == {"from": {"labels": {"site": "berlin"}},
                                                        "to": {"labels": {"site": "munich"}}}  # fmt: skip
    published = api.call("GET", "/api/v1/events", params={"kind": "policy.published", "agent": berlin}).json()
    assert [e["data"]["tenants"] for e in published["items"]] == [[], ["acme"], ["acme"]]
    assert published["items"][0]["actor"] == "key:test-admin"  # who changed the tenant republished it


def test_tokens_are_shown_once_stored_as_digests_and_never_listed_or_logged(
    plane: Api, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    agent = enrol(plane, "edge-tokens", site="tokens")
    ident = create(plane, name="acme-tokens", selector={"labels": {"site": "tokens"}})
    version = policy(plane, agent)["version"]

    made = plane.call("POST", f"/api/v1/tenants/{ident}/tokens", json={"label": "billing service"},
                      headers={"X-Spillway-Reason": "billing goes live"})  # fmt: skip
    assert made.status_code == 201, made.text
    secret, token = made.json()["token"], made.json()["tenant_token"]
    assert secret.startswith("spt_") and len(secret) >= 4 + 43  # 256 random bits, URL-safe
    assert (token["label"], token["prefix"], token["tenant_id"]) == ("billing service", secret[:10], ident)
    second = plane.call("POST", f"/api/v1/tenants/{ident}/tokens").json()  # no body: no label
    assert second["token"] != secret and second["tenant_token"]["label"] == ""

    rows = stored_tokens(plane, ident)
    assert {r.token_sha256 for r in rows} == {hash_token(secret), hash_token(second["token"])}
    assert {r.prefix for r in rows} == {secret[:10], second["token"][:10]}  # the rest of the secret is nowhere
    listing = plane.call("GET", f"/api/v1/tenants/{ident}/tokens", role="viewer")
    assert [t["id"] for t in listing.json()["items"]] == [token["id"], second["tenant_token"]["id"]]
    seen = (listing.text + plane.call("GET", f"/api/v1/tenants/{ident}").text
            + plane.call("GET", "/api/v1/events", params={"limit": 500}).text)  # fmt: skip
    for hidden in (secret, second["token"], hash_token(secret)):
        assert hidden not in seen
        assert hidden not in caplog.text

    # The agents get the digests (an agent hashes a presented token and compares), at a new version each time.
    doc = policy(plane, agent)
    assert doc["tenants"][0]["token_sha256"] == [hash_token(secret), hash_token(second["token"])]
    assert doc["version"] == version + 2

    first = tenant_events(plane, ident)[1]
    assert (first["kind"], first["reason"]) == ("tenant.token_created", "billing goes live")
    assert first["data"] == {"name": "acme-tokens", "token_id": token["id"], "prefix": token["prefix"],
                             "label": "billing service"}  # fmt: skip

    revoked = plane.call("DELETE", f"/api/v1/tenants/{ident}/tokens/{token['id']}")
    assert revoked.status_code == 204
    assert policy(plane, agent)["tenants"][0]["token_sha256"] == [hash_token(second["token"])]
    assert [r.id for r in stored_tokens(plane, ident)] == [second["tenant_token"]["id"]]
    assert tenant_events(plane, ident)[0]["kind"] == "tenant.token_revoked"
    again = plane.call("DELETE", f"/api/v1/tenants/{ident}/tokens/{token['id']}")
    assert again.status_code == 404 and "no token with id" in again.json()["message"]

    # A tenant's tokens go with it.
    assert plane.call("DELETE", f"/api/v1/tenants/{ident}").status_code == 204
    assert stored_tokens(plane, ident) == []
    assert policy(plane, agent)["tenants"] is None


def test_a_tenant_holds_at_most_sixteen_tokens(plane: Api) -> None:
    ident = create(plane, name="acme-sixteen")
    for _ in range(16):
        assert plane.call("POST", f"/api/v1/tenants/{ident}/tokens").status_code == 201
    refused = plane.call("POST", f"/api/v1/tenants/{ident}/tokens")
    assert refused.status_code == 409 and "revoke one first" in refused.json()["message"]
    assert len(stored_tokens(plane, ident)) == 16
    assert plane.call("DELETE", f"/api/v1/tenants/{ident}").status_code == 204


def test_admins_write_viewers_and_editors_read(plane: Api) -> None:
    ident = create(plane, name="acme-roles")
    token_id = plane.call("POST", f"/api/v1/tenants/{ident}/tokens").json()["tenant_token"]["id"]
    writes = [("POST", "/api/v1/tenants", tenant(name="acme-roles-2")),
              ("PUT", f"/api/v1/tenants/{ident}", tenant(name="acme-roles")),
              ("PATCH", f"/api/v1/tenants/{ident}", {"weight": 2}), ("DELETE", f"/api/v1/tenants/{ident}", None),
              ("POST", f"/api/v1/tenants/{ident}/tokens", {}),
              ("DELETE", f"/api/v1/tenants/{ident}/tokens/{token_id}", None)]  # fmt: skip
    for role in ("viewer", "editor"):
        for path in ("/api/v1/tenants", f"/api/v1/tenants/{ident}", f"/api/v1/tenants/{ident}/tokens"):
            assert plane.call("GET", path, role=role).status_code == 200, (role, path)
        for method, path, body in writes:
            refused = plane.call(method, path, role=role, json=body)
            assert refused.status_code == 403, (role, method, path)
            assert "'admin'" in refused.json()["message"]
    assert plane.client.get("/api/v1/tenants").status_code == 401
    agent_token = plane.call("POST", "/api/v1/agents", json=make_agent()).json()["token"]
    as_agent = plane.client.get("/api/v1/tenants", headers={"Authorization": f"Bearer {agent_token}"})
    assert as_agent.status_code == 403
    # Nothing refused changed anything or reached the audit trail.
    assert [e["kind"] for e in tenant_events(plane, ident)] == ["tenant.token_created", "tenant.created"]
    assert "acme-roles-2" not in {t["name"] for t in plane.call("GET", "/api/v1/tenants").json()["items"]}


BAD_BODIES = [
    (tenant(name="Acme Corp"), "body.name", "should match pattern"),
    (tenant(name="other"), "body.name", "reserved"),
    (tenant(name="default"), "body.name", "reserved"),
    (tenant(name="a" * 64), "body.name", "at most 63"),
    (tenant(weight=0), "body.weight", "greater than 0"),
    (tenant(weight=1001), "body.weight", "less than or equal to 1000"),
    (tenant(max_in_flight=0), "body.max_in_flight", "greater than or equal to 1"),
    (tenant(rate_rps=-1), "body.rate_rps", "greater than 0"),
    (tenant(max_priority=65), "body.max_priority", "less than or equal to 64"),
    (tenant(max_streams="many"), "body.max_streams", "valid integer"),
    (tenant(selector={"labels": "site"}), "body.selector.labels", "key=value"),
    (tenant(selector={"labels": {}, "model": "mlp"}), "body.selector.model", "Extra inputs"),
    (tenant(quota=3), "body.quota", "Extra inputs"),
    (tenant(description="a\x00b"), "body", "NUL"),
]


def test_bad_input_is_a_422_naming_the_field(plane: Api) -> None:
    before = plane.call("GET", "/api/v1/tenants").json()["items"]
    for body, field, words in BAD_BODIES:
        response = plane.call("POST", "/api/v1/tenants", json=body)
        assert response.status_code == 422, (field, response.text)
        details = response.json()["details"]
        assert any(d["field"] == field and words in d["message"] for d in details), (field, details)
        assert response.json()["message"].startswith(field), response.json()["message"]
    assert plane.call("GET", "/api/v1/tenants").json()["items"] == before


def test_names_are_unique_unknown_ids_are_404_and_bad_bodies_never_500(plane: Api) -> None:
    ident = create(plane, name="acme-unique")
    clash = plane.call("POST", "/api/v1/tenants", json=tenant(name="acme-unique"))
    assert (clash.status_code, clash.json()["error"]) == (422, "duplicate_name")
    for method, path, body in (("GET", "/api/v1/tenants/nope", None), ("PUT", "/api/v1/tenants/nope", tenant()),
                               ("PATCH", "/api/v1/tenants/nope", {"weight": 2}),
                               ("DELETE", "/api/v1/tenants/nope", None), ("GET", "/api/v1/tenants/nope/tokens", None),
                               ("POST", "/api/v1/tenants/nope/tokens", None),
                               ("DELETE", f"/api/v1/tenants/{ident}/tokens/nope", None)):  # fmt: skip
        response = plane.call(method, path, json=body)
        assert response.status_code == 404, (method, path, response.text)
    long_label = plane.call("POST", f"/api/v1/tenants/{ident}/tokens", json={"label": "x" * 129})
    assert long_label.status_code == 422 and long_label.json()["details"][0]["field"] == "body.label"
    not_json = plane.call("POST", "/api/v1/tenants", content=b"\xff\xfe", headers={"Content-Type": "application/json"})
    assert not_json.status_code in (400, 422)
    # Every field of a PATCH set to null: applied, or a 422 that names the field.
    for field in ("name", "description", "selector", "weight", "max_in_flight", "rate_rps", "tokens_per_s",
                  "max_streams", "max_priority"):  # fmt: skip
        response = plane.call("PATCH", f"/api/v1/tenants/{ident}", json={field: None})
        assert response.status_code in (200, 422), (field, response.text)
        if response.status_code == 422:
            assert field in response.json()["message"], response.text
    assert plane.call("DELETE", f"/api/v1/tenants/{ident}").status_code == 204


def test_the_control_loop_keeps_the_tenants_and_follows_label_changes(plane: Api) -> None:
    agent = enrol(plane, "edge-loop", site="loop-a")
    policy(plane, agent)  # its first document
    ident = create(plane, name="acme-loop", selector={"labels": {"site": "loop-b"}})
    app: Any = plane.client.app
    report = app.state.control_loop.cycle(utcnow())
    assert policy(plane, agent)["tenants"] is None and agent not in report.published

    # The agent moves: the loop's next cycle publishes the tenant to it, and the cycle after changes nothing.
    agent_etag = plane.call("GET", f"/api/v1/agents/{agent}").headers["etag"]
    moved = plane.call("PATCH", f"/api/v1/agents/{agent}", json={"labels": {"site": "loop-b"}},
                       headers={"If-Match": agent_etag})  # fmt: skip
    assert moved.status_code == 200, moved.text
    version = policy(plane, agent)["version"]
    report = app.state.control_loop.cycle(utcnow() + timedelta(seconds=1))
    assert report.published.get(agent) == version + 1
    assert [t["name"] for t in policy(plane, agent)["tenants"]] == ["acme-loop"]
    assert agent not in app.state.control_loop.cycle(utcnow() + timedelta(seconds=2)).published

    # A token made meanwhile is in the document the loop keeps (same content: no new version from the loop).
    secret = plane.call("POST", f"/api/v1/tenants/{ident}/tokens").json()["token"]
    assert agent not in app.state.control_loop.cycle(utcnow() + timedelta(seconds=3)).published
    assert policy(plane, agent)["tenants"][0]["token_sha256"] == [hash_token(secret)]
    engine = make_engine(plane.url)
    with make_sessionmaker(engine)() as session:
        stored = session.get(Policy, agent)
        assert stored is not None and stored.version == version + 2
        kinds = [e.kind for e in session.scalars(select(Event).where(Event.agent_id == agent))]
        assert kinds.count("policy.published") == 2  # the loop's (the move) and the token's
    engine.dispose()


def test_a_first_document_already_carries_the_tenants(plane: Api) -> None:
    create(plane, name="acme-first", selector={"labels": {"site": "first"}})
    agent = enrol(plane, "late-comer", site="first")
    doc = policy(plane, agent)
    assert (doc["version"], [t["name"] for t in doc["tenants"]]) == (1, ["acme-first"])


def test_no_more_tenants_than_a_document_carries(plane: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    count = len(plane.call("GET", "/api/v1/tenants", params={"limit": 500}).json()["items"])
    monkeypatch.setattr("controlplane.api.tenants.MAX_TENANTS", count)
    refused = plane.call("POST", "/api/v1/tenants", json=tenant(name="one-too-many"))
    assert refused.status_code == 409 and "the most a policy document carries" in refused.json()["message"]


@pytest.mark.postgres
def test_a_tenant_change_waits_for_a_publishing_cycle_and_takes_the_next_version(postgres_url: str) -> None:
    """The control loop and a tenant change both lock the stored documents before reading the tenants: a change
    made while the loop is publishing waits for it, then publishes the version after the loop's (never the same
    version number for two different documents)."""
    with contextmanager(open_api)(postgres_url) as api:
        agent = enrol(api, "edge-race", site="race")
        ident = create(api, name="acme-race", selector={"labels": {"site": "race"}})
        version = policy(api, agent)["version"]
        app: Any = api.client.app
        done: list[int] = []
        with app.state.sessionmaker() as cycle:  # a publishing cycle, holding the documents
            row = locked_policies(cycle)[agent]
            full, etag = document(PolicyDocument.model_validate(row.document), version + 1)
            row.version, row.etag, row.document = version + 1, etag, full
            cycle.flush()
            change = threading.Thread(target=lambda: done.append(
                api.call("PATCH", f"/api/v1/tenants/{ident}", json={"weight": 7}).status_code))  # fmt: skip
            change.start()
            change.join(timeout=0.5)
            assert change.is_alive() and not done  # waiting on the cycle's lock
            cycle.commit()
        change.join(timeout=30)
        assert done == [200]
        doc = policy(api, agent)
        assert (doc["version"], doc["tenants"][0]["weight"]) == (version + 2, 7.0)
