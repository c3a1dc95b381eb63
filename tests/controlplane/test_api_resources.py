"""CRUD of SLOs, rules, backends and agents through the REST API, on SQLite and PostgreSQL."""

from __future__ import annotations

import json

import pytest

from controlplane.db import Slo, make_engine, make_sessionmaker
from controlplane.db import repository as repo
from controlplane.db.repository import ResourceKind
from controlplane.errors import PreconditionFailed
from controlplane.schemas.slos import SloCreate, SloPatch, SloRead
from tests.conftest import Api, open_api
from tests.utils.builders import BUILDERS, make_backend, make_rule, make_slo

RESOURCES = ["slos", "rules", "backends", "agents"]


def _create(api: Api, plural: str, **over: object) -> dict:
    response = api.call("POST", f"/api/v1/{plural}", json=BUILDERS[plural](**over))
    assert response.status_code == 201, response.text
    body = response.json()
    return body["agent"] if plural == "agents" else body


@pytest.mark.parametrize("plural", RESOURCES)
def test_lifecycle_with_etags_and_audit(api: Api, plural: str) -> None:
    created = _create(api, plural)
    ident = created["id"]
    got = api.call("GET", f"/api/v1/{plural}/{ident}")
    assert got.status_code == 200
    assert got.json() == created
    etag = got.headers["etag"]

    renamed = api.call(
        "PATCH", f"/api/v1/{plural}/{ident}", json={"name": f"renamed-{ident}"}, headers={"If-Match": etag}
    )
    assert renamed.status_code == 200, renamed.text
    assert renamed.json()["name"] == f"renamed-{ident}"
    assert renamed.json()["version"] == created["version"] + 1
    assert renamed.headers["etag"] != etag

    # The old ETag is stale now: neither PUT, PATCH nor DELETE may overwrite the newer version.
    full = BUILDERS[plural](name="overwrite")
    assert api.call("PUT", f"/api/v1/{plural}/{ident}", json=full, headers={"If-Match": etag}).status_code == 412
    stale_patch = api.call("PATCH", f"/api/v1/{plural}/{ident}", json={"name": "x"}, headers={"If-Match": etag})
    assert stale_patch.status_code == 412
    assert stale_patch.json()["error"] == "precondition_failed"
    assert api.call("DELETE", f"/api/v1/{plural}/{ident}", headers={"If-Match": etag}).status_code == 412

    put = api.call("PUT", f"/api/v1/{plural}/{ident}", json=full, headers={"If-Match": renamed.headers["etag"]})
    assert put.status_code == 200, put.text
    assert put.json()["name"] == "overwrite"

    listed = api.call("GET", f"/api/v1/{plural}", role="viewer").json()
    assert [item["id"] for item in listed["items"]] == [ident]

    assert api.call("DELETE", f"/api/v1/{plural}/{ident}", headers={"If-Match": put.headers["etag"]}).status_code == 204
    missing = api.call("GET", f"/api/v1/{plural}/{ident}")
    assert missing.status_code == 404
    assert missing.json()["error"] == "not_found"

    singular = plural.removesuffix("s")
    kinds = [e["kind"] for e in api.call("GET", "/api/v1/events", params={"kind": f"{singular}.*"}).json()["items"]]
    assert kinds == [f"{singular}.deleted", f"{singular}.updated", f"{singular}.updated", f"{singular}.created"]


@pytest.mark.parametrize("plural", RESOURCES)
def test_unknown_ids_are_404_for_every_verb(sqlite_api: Api, plural: str) -> None:
    body = BUILDERS[plural]()
    for method, kw in (("GET", {}), ("PUT", {"json": body}), ("PATCH", {"json": {"name": "n"}}), ("DELETE", {})):
        response = sqlite_api.call(method, f"/api/v1/{plural}/nope", **kw)
        assert response.status_code == 404, (method, response.text)
        label = "SLO" if plural == "slos" else plural.removesuffix("s")
        assert response.json()["message"] == f"no {label} with id 'nope'"


def test_cursor_pagination_walks_every_item_once(api: Api) -> None:
    names = sorted(f"slo-page-{i:02d}" for i in range(7))
    for name in reversed(names):
        _create(api, "slos", name=name)
    seen: list[str] = []
    cursor = None
    for _ in range(10):
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = api.call("GET", "/api/v1/slos", params=params).json()
        seen += [item["name"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == names


def test_bad_cursor_is_a_clear_422(sqlite_api: Api) -> None:
    response = sqlite_api.call("GET", "/api/v1/slos", params={"cursor": "!!!"})
    assert response.status_code == 422
    assert response.json()["details"][0]["field"] == "cursor"


def test_patch_keeps_unset_fields_and_validates_the_result(sqlite_api: Api) -> None:
    slo = _create(sqlite_api, "slos", threshold_ms=100, objective=99.0, window="7d")
    patched = sqlite_api.call("PATCH", f"/api/v1/slos/{slo['id']}", json={"objective": 99.9}).json()
    assert (patched["threshold_ms"], patched["objective"], patched["window"]) == (100, 99.9, "7d")
    # Switching to availability while a latency threshold is still set makes the whole SLO invalid.
    broken = sqlite_api.call("PATCH", f"/api/v1/slos/{slo['id']}", json={"sli_kind": "availability"})
    assert broken.status_code == 422
    assert "threshold_ms" in broken.text
    fixed = sqlite_api.call(
        "PATCH", f"/api/v1/slos/{slo['id']}", json={"sli_kind": "availability", "threshold_ms": None}
    )
    assert fixed.status_code == 200, fixed.text
    assert fixed.json()["threshold_ms"] is None


def test_backend_auth_header_is_write_only(api: Api) -> None:
    created = api.call("POST", "/api/v1/backends", json=make_backend(auth_header="Bearer top-secret-1"))
    assert created.status_code == 201
    assert "top-secret-1" not in created.text
    assert created.json()["auth_header_set"] is True
    ident = created.json()["id"]
    # A PUT that leaves the secret out keeps it (clients cannot read it back to resend it).
    body = make_backend(name="renamed")
    body.pop("auth_header")
    kept = api.call("PUT", f"/api/v1/backends/{ident}", json=body)
    assert kept.json()["auth_header_set"] is True
    cleared = api.call("PATCH", f"/api/v1/backends/{ident}", json={"auth_header": None})
    assert cleared.json()["auth_header_set"] is False
    api.call("PATCH", f"/api/v1/backends/{ident}", json={"auth_header": "Bearer top-secret-2"})
    everything = " ".join(
        api.call("GET", path).text
        for path in ("/api/v1/backends", f"/api/v1/backends/{ident}", "/api/v1/events?limit=500")
    )
    assert "top-secret" not in everything
    assert "(secret)" in everything  # the audit says that it changed, not what to


def test_rule_and_slo_round_trip_durations_and_selectors(sqlite_api: Api) -> None:
    rule = sqlite_api.call(
        "POST",
        "/api/v1/rules",
        json=make_rule(
            selector={"labels": "site=berlin, tier=edge"},
            hysteresis={"for": 90, "recover_after": "10m"},
            action={"kind": "tune_batching", "max_queue_delay_us": 500, "preferred_batch_sizes": [8, 16]},
        ),
    )
    assert rule.status_code == 201, rule.text
    body = rule.json()
    assert body["selector"]["labels"] == {"site": "berlin", "tier": "edge"}
    assert body["hysteresis"] == {"for": "90s", "recover_after": "10m", "recovery_steps": 1, "max_flaps_per_hour": 4}
    slo = sqlite_api.call("POST", "/api/v1/slos", json=make_slo(window=86400 * 30)).json()
    assert slo["window"] == "30d"  # the SRE workbook's pairs as they are for a 30-day window
    assert [(a["long"], a["short"], a["burn_rate"], a["severity"]) for a in slo["alert_windows"]] == [
        ("1h", "5m", 14.4, "page"), ("6h", "30m", 6, "page"), ("3d", "6h", 1, "ticket")]  # fmt: skip
    weekly = sqlite_api.call("POST", "/api/v1/slos", json=make_slo(name="weekly", window="7d")).json()
    assert [(a["long"], a["short"], a["burn_rate"]) for a in weekly["alert_windows"]] == [
        ("14m", "1m", 14.4), ("84m", "7m", 6), ("1008m", "84m", 1)]  # scaled by 7/30, rates kept  # fmt: skip
    chosen = [{"long": "2h", "short": "10m", "burn_rate": 3, "severity": "ticket"}]
    custom = sqlite_api.call("POST", "/api/v1/slos", json=make_slo(name="custom", window="7d", alert_windows=chosen))
    assert custom.json()["alert_windows"] == chosen


def test_a_latency_threshold_must_be_a_bucket_boundary(sqlite_api: Api) -> None:
    refused = sqlite_api.call("POST", "/api/v1/slos", json=make_slo(threshold_ms=75))
    assert refused.status_code == 422
    body = refused.json()
    assert body["details"][0]["field"] == "body.threshold_ms"
    assert "75 is not a latency bucket boundary" in body["message"] and "50, 100" in body["message"]
    made = sqlite_api.call("POST", "/api/v1/slos", json=make_slo(threshold_ms=100))
    assert made.status_code == 201
    patched = sqlite_api.call("PATCH", f"/api/v1/slos/{made.json()['id']}", json={"threshold_ms": 60})
    assert patched.status_code == 422 and "60 is not a latency bucket boundary" in patched.json()["message"]


def test_the_bucket_boundaries_are_a_setting(sqlite_url: str) -> None:
    for api in open_api(sqlite_url, latency_buckets_ms=[75.0, 250.0]):
        assert api.call("POST", "/api/v1/slos", json=make_slo(threshold_ms=75)).status_code == 201
        assert api.call("POST", "/api/v1/slos", json=make_slo(name="b", threshold_ms=50)).status_code == 422


def test_reason_header_and_actor_reach_the_audit_event(sqlite_api: Api) -> None:
    sqlite_api.call(
        "POST",
        "/api/v1/slos",
        role="editor",
        json=make_slo(name="audited"),
        headers={"X-Spillway-Reason": "ticket OPS-42"},
    )
    event = sqlite_api.call("GET", "/api/v1/events", params={"kind": "slo.created"}).json()["items"][0]
    assert (event["actor"], event["reason"], event["data"]["name"]) == ("key:test-editor", "ticket OPS-42", "audited")


def test_concurrent_writers_with_the_same_etag_cannot_both_win(db_url: str) -> None:
    """Two operators read version 1; both write with If-Match of version 1: exactly one succeeds."""
    list(open_api(db_url))  # migrate
    kind = ResourceKind("slo", Slo, SloCreate, SloRead.model_validate)
    engine = make_engine(db_url)
    factory = make_sessionmaker(engine)
    try:
        with factory() as s:
            row = repo.create_row(s, kind, SloCreate.model_validate(make_slo(name="shared")), repo.Actor("t"))
            s.commit()
            ident, tag = row.id, repo.etag(row)
        first, second = factory(), factory()
        for session in (first, second):  # both have read version 1 and checked If-Match against it
            repo.get_row(session, kind, ident)
        repo.patch_row(first, kind, ident, SloPatch(objective=95.0), tag, repo.Actor("anna"))
        first.commit()
        with pytest.raises(PreconditionFailed):
            repo.patch_row(second, kind, ident, SloPatch(objective=99.9), tag, repo.Actor("ben"))
        first.close()
        second.close()
        with factory() as s:
            stored = repo.get_row(s, kind, ident)
            assert (stored.objective, stored.version) == (95.0, 2)
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "body",
    [
        make_slo(description="a\x00b"),
        make_slo(selector={"model": "m\x00"}),
        make_rule(
            action={
                "kind": "fallback",
                "priority_at_or_below": 3,
                "mode": "default",
                "default_outputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [float("nan")]}],
            }
        ),
        make_backend(url="http://h/\x00", auth_header="Bearer TOPSECRET"),
    ],
    ids=["nul-description", "nul-selector", "nan-in-free-json", "nul-url"],
)
def test_values_no_database_can_store_are_422_on_both_backends(api: Api, body: dict) -> None:
    plural = "rules" if "condition" in body else "backends" if "url" in body else "slos"
    response = api.call(
        "POST", f"/api/v1/{plural}", content=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422, response.text
    assert "TOPSECRET" not in response.text


def test_nul_in_urls_is_400(api: Api) -> None:
    for path in ("/api/v1/slos/%00abc", "/api/v1/events?kind=%00", "/api/v1/slos?cursor=%00"):
        response = api.call("GET", path)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"] == "bad_request"


def test_openai_backends_carry_a_protocol_and_a_model_map(api: Api) -> None:
    body = make_backend(protocol="openai", models=["tiny-lm", "coder"], model_map={"tiny-lm": "Qwen2.5-7B-Instruct"})
    created = api.call("POST", "/api/v1/backends", json=body)
    assert created.status_code == 201, created.text
    assert (created.json()["protocol"], created.json()["model_map"]) == ("openai", {"tiny-lm": "Qwen2.5-7B-Instruct"})
    assert "backend-secret-value" not in created.text and created.json()["auth_header_set"] is True
    ident = created.json()["id"]
    listed = api.call("GET", "/api/v1/backends").json()["items"]
    assert [(b["protocol"], b["model_map"]) for b in listed] == [("openai", {"tiny-lm": "Qwen2.5-7B-Instruct"})]
    patched = api.call("PATCH", f"/api/v1/backends/{ident}", json={"model_map": {"coder": "Qwen2.5-Coder-7B"}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["model_map"] == {"coder": "Qwen2.5-Coder-7B"} and patched.json()["auth_header_set"] is True
    # A V2 backend has no map: switching back to v2 must drop it in the same change.
    assert api.call("PATCH", f"/api/v1/backends/{ident}", json={"protocol": "v2"}).status_code == 422
    back = api.call("PATCH", f"/api/v1/backends/{ident}", json={"protocol": "v2", "model_map": {}})
    assert back.status_code == 200 and back.json()["protocol"] == "v2"
    plain = api.call("POST", "/api/v1/backends", json=make_backend()).json()
    assert (plain["protocol"], plain["model_map"]) == ("v2", {})  # the defaults


@pytest.mark.parametrize(
    ("over", "field", "named"),
    [
        ({"protocol": "grpc"}, "body.protocol", "'v2', 'v2_grpc' or 'openai'"),
        ({"protocol": "openai", "model_map": {"bert": "x"}}, "body", "model_map: 'bert' is not one of"),
        ({"model_map": {"mlp": "cloud-mlp"}}, "body", "model_map: applies only to backends with protocol 'openai'"),
        ({"protocol": "openai", "model_map": {"mlp": "has space"}}, "body.model_map.mlp", "pattern"),
        ({"protocol": "openai", "model_map": {"mlp": ""}}, "body.model_map.mlp", "at least 1"),
        ({"protocol": "openai", "url": "http://cloud.example/v1"}, "body", "without '/v1'"),
    ],
)
def test_a_bad_protocol_or_model_map_is_422_naming_it(sqlite_api: Api, over: dict, field: str, named: str) -> None:
    response = sqlite_api.call("POST", "/api/v1/backends", json=make_backend(**over))
    assert response.status_code == 422, response.text
    assert response.json()["details"][0]["field"] == field, response.text
    assert named in response.json()["message"], response.text
