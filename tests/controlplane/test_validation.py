"""Bad input gets a 422 that names the field and says what is wrong; errors are always JSON."""

from __future__ import annotations

import pytest

from tests.conftest import Api
from tests.utils.builders import BUILDERS, make_agent, make_backend, make_rule, make_slo

CASES = [
    ("slos", make_slo(objective=100), "body.objective", "less than 100"),
    ("slos", make_slo(objective=0), "body.objective", "greater than 0"),
    ("slos", make_slo(window="0s"), "body.window", "greater than 0"),
    ("slos", make_slo(window="forever"), "body.window", "is not a duration"),
    ("slos", make_slo(threshold_ms=-5), "body.threshold_ms", "greater than 0"),
    ("slos", make_slo(threshold_ms=None), "body", "threshold_ms is required"),
    ("slos", make_slo(sli_kind="throughput"), "body.sli_kind", "'ttft' or 'tpot'"),
    ("slos", make_slo(selector={"labels": "site"}), "body.selector.labels", "not a key=value label"),
    ("slos", make_slo(selector={"labels": {"bad key!": "x"}}), "body.selector.labels", "label key"),
    (
        "slos",
        make_slo(alert_windows=[{"long": "5m", "short": "1h", "burn_rate": 2}]),
        "body.alert_windows.0",
        "short window must be shorter",
    ),
    ("rules", make_rule(condition={"kind": "vibes"}), "body.condition", "does not match any of the expected tags"),
    ("rules", make_rule(action={"kind": "reboot"}), "body.action", "does not match any of the expected tags"),
    (
        "rules",
        make_rule(action={"kind": "shed", "priority_at_or_below": 2, "version": 2}),
        "body.action.shed.version",
        "Extra inputs are not permitted",
    ),
    ("rules", make_rule(action={"kind": "switch_variant"}), "body.action.switch_variant.version", "Field required"),
    (
        "rules",
        make_rule(action={"kind": "fallback", "priority_at_or_below": 3, "mode": "default"}),
        "body.action.fallback",
        "needs default_output",
    ),
    ("rules", make_rule(action={"kind": "tune_batching"}), "body.action.tune_batching", "needs max_queue_delay_us"),
    (
        "rules",
        make_rule(condition={"kind": "burn_rate", "slo": "x", "threshold": 0}),
        "body.condition.burn_rate.threshold",
        "greater than 0",
    ),
    ("rules", make_rule(hysteresis={"for": "-1s"}), "body.hysteresis.for", "is not a duration"),
    ("rules", make_rule(selector={"labels": "a=b,,c"}), "body.selector.labels", "'c' is not a key=value label"),
    ("backends", make_backend(url="ftp://x"), "body.url", "http:// or https://"),
    ("backends", make_backend(url="http://user:pw@host"), "body.url", "must not carry credentials"),
    ("backends", make_backend(models=[]), "body.models", "at least 1 item"),
    ("backends", make_backend(weight=0), "body.weight", "greater than 0"),
    ("agents", make_agent(name="has space"), "body.name", "should match pattern"),
    ("agents", make_agent(device_class="toaster"), "body.device_class", "'jetson', 'gpu', 'cpu' or 'cloud'"),
    ("slos", {**make_slo(), "colour": "red"}, "body.colour", "Extra inputs are not permitted"),
]


@pytest.mark.parametrize(("plural", "body", "field", "words"), CASES, ids=[f"{c[0]}:{c[2]}:{c[3][:24]}" for c in CASES])
def test_invalid_bodies_are_422_naming_the_field(
    sqlite_api: Api, plural: str, body: dict, field: str, words: str
) -> None:
    response = sqlite_api.call("POST", f"/api/v1/{plural}", json=body)
    assert response.status_code == 422, response.text
    payload = response.json()
    assert payload["error"] == "validation_error"
    matching = [d for d in payload["details"] if d["field"] == field]
    assert matching, payload
    assert words in matching[0]["message"], matching[0]["message"]
    assert words in payload["message"] or len(payload["details"]) > 1


@pytest.mark.parametrize("plural", ["slos", "rules", "backends", "agents"])
def test_duplicate_names_are_422_naming_the_field(api: Api, plural: str) -> None:
    body = {"slos": make_slo, "rules": make_rule, "backends": make_backend, "agents": make_agent}[plural](name="dup")
    assert api.call("POST", f"/api/v1/{plural}", json=body).status_code == 201
    again = api.call("POST", f"/api/v1/{plural}", json=body)
    assert again.status_code == 422
    assert again.json()["error"] == "duplicate_name"
    assert again.json()["details"][0]["field"] == "name"
    # Renaming another one onto a taken name is refused the same way.
    other = api.call("POST", f"/api/v1/{plural}", json={**body, "name": "other"}).json()
    other_id = other["agent"]["id"] if plural == "agents" else other["id"]
    rename = api.call("PATCH", f"/api/v1/{plural}/{other_id}", json={"name": "dup"})
    assert rename.status_code == 422
    assert rename.json()["error"] == "duplicate_name"


def test_malformed_json_and_wrong_types_are_clear_errors(sqlite_api: Api) -> None:
    response = sqlite_api.call(
        "POST", "/api/v1/slos", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"] == "validation_error"
    assert sqlite_api.call("POST", "/api/v1/slos", json=[1, 2]).status_code == 422
    assert sqlite_api.call("GET", "/api/v1/slos", params={"limit": 0}).json()["details"][0]["field"] == "query.limit"


def test_unknown_route_and_method_are_json(sqlite_api: Api) -> None:
    nowhere = sqlite_api.call("GET", "/api/v1/nowhere")
    assert nowhere.status_code == 404
    assert nowhere.json()["error"] == "not_found"
    wrong = sqlite_api.call("DELETE", "/api/v1/status")
    assert wrong.status_code == 405
    assert wrong.json()["error"] == "method_not_allowed"


PATCH_SCHEMAS = {"slos": "SloPatch", "rules": "RulePatch", "backends": "BackendPatch", "agents": "AgentPatch"}


@pytest.mark.parametrize("plural", sorted(PATCH_SCHEMAS))
def test_a_patch_of_any_field_to_null_is_applied_or_a_422_naming_it(sqlite_api: Api, plural: str) -> None:
    """Every field a PATCH schema documents, set to null: the merged resource is valid (200) or the answer is a
    422 that names the field; never a 500 (issue 11: `"window": null` broke the SLO's PATCH model itself)."""
    schemas = sqlite_api.call("GET", "/api/v1/openapi.json").json()["components"]["schemas"]
    created = sqlite_api.call("POST", f"/api/v1/{plural}", json=BUILDERS[plural]()).json()
    ident = created["agent"]["id"] if plural == "agents" else created["id"]
    problems = []
    for field in schemas[PATCH_SCHEMAS[plural]]["properties"]:
        response = sqlite_api.call("PATCH", f"/api/v1/{plural}/{ident}", json={field: None})
        payload = response.json()
        if response.status_code == 422:
            named = [d for d in payload["details"] if field in d["field"] or field in d["message"]]
            if payload["error"] != "validation_error" or field not in payload["message"] or not named:
                problems.append(f"{field}: 422 without naming it: {payload}")
        elif response.status_code != 200:
            problems.append(f"{field}: {response.status_code} {payload}")
    assert problems == []


def test_the_patch_schemathesis_found_is_a_422_naming_its_fields(sqlite_api: Api) -> None:
    """Issue 11's example, as it was sent: nulls, a tiny float and a long If-Match (a 500 before)."""
    slo = sqlite_api.call("POST", "/api/v1/slos", json=make_slo()).json()
    body = {"alert_windows": [], "description": "", "name": "0", "objective": 5e-324, "selector": None,
            "sli_kind": None, "threshold_ms": 5e-324, "window": None}  # fmt: skip
    for if_match in (f'"{slo["id"]}-1", ' + "W/" * 100, "x" * 600):
        response = sqlite_api.call("PATCH", f"/api/v1/slos/{slo['id']}", json=body, headers={"If-Match": if_match})
        assert response.status_code == 422, response.text
        fields = {d["field"] for d in response.json()["details"]}
        assert fields & {"body.window", "header.If-Match"}, fields
