"""OpenSLO v1 import and export: an exported SLO imports back identical, every export validates against the OpenSLO
schema (tests/controlplane/openslo/SOURCE.md), and what Spillway cannot store is refused naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from jsonschema import Draft7Validator
from referencing import Registry, Resource

from controlplane.errors import Conflict
from controlplane.schemas.slos import SloCreate
from controlplane.slo import openslo
from tests.conftest import Api, open_api
from tests.utils.builders import make_slo

SCHEMAS = Path(__file__).parent / "openslo" / "schemas" / "v1"
YAML = {"Content-Type": "application/yaml"}
SLO_FIELDS = set(SloCreate.model_fields)


def _validator() -> Draft7Validator:
    parts = [Resource.from_contents(json.loads(p.read_text())) for p in SCHEMAS.rglob("*.schema.json")]
    registry: Registry[Any] = Registry().with_resources((part.id(), part) for part in parts)  # type: ignore[misc]
    return Draft7Validator(json.loads((SCHEMAS / "openslo.schema.json").read_text()), registry=registry)


VALIDATOR = _validator()


def assert_valid_openslo(text: str) -> list[dict[str, Any]]:
    docs = list(yaml.safe_load_all(text))
    for doc in docs:
        problems = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(doc)]
        assert not problems, problems
    return docs


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """One app for the module's SQLite tests (each uses its own SLO names): a fresh app per test costs seconds."""
    yield from open_api(f"sqlite:///{tmp_path_factory.mktemp('openslo') / 'spillway.db'}")


def _post_yaml(api: Api, text: str, role: str = "editor", **params: str) -> httpx.Response:
    return api.call("POST", "/api/v1/slos/import", role=role, content=text.encode(), headers=YAML, params=params)


def _fields(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k in SLO_FIELDS}


ROUND_TRIPS = {
    "latency": make_slo(name="Edge_Latency.p99", description="fast enough", threshold_ms=50, objective=99.9,
                        selector={"labels": {"tier": "edge", "topology.kubernetes.io/zone": "eu-1"}, "model": "mlp",
                                  "tenant": "default"},
                        alert_windows=[{"long": "2h", "short": "10m", "burn_rate": 10},
                                       {"long": "1d", "short": "2h", "burn_rate": 2.5, "severity": "ticket"}]),
    "availability": make_slo(name="up", sli_kind="availability", threshold_ms=None, objective=99.95, window="7d",
                             selector={"tenant": "acme", "labels": {"site": "berlin"}}),
    "ttft": make_slo(name="first-token", sli_kind="ttft", threshold_ms=250, objective=95, window="1d",
                     selector={"model": "tiny-lm"}, alert_windows=[]),
    "tpot": make_slo(name="per_token", sli_kind="tpot", threshold_ms=25, objective=99.123, window="30d",
                     selector={"labels": {}}, description="x" * 1500),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(ROUND_TRIPS))
def test_an_exported_slo_imports_back_identical(shared: Api, kind: str) -> None:
    created = shared.call("POST", "/api/v1/slos", json=ROUND_TRIPS[kind])
    assert created.status_code == 201, created.text
    original = _fields(created.json())
    exported = shared.call("GET", f"/api/v1/slos/{created.json()['id']}/openslo", role="viewer")
    assert exported.status_code == 200 and exported.headers["content-type"].startswith("application/yaml")
    (doc,) = assert_valid_openslo(exported.text)
    assert doc["metadata"]["name"] == openslo.dns_label(original["name"])
    again = _post_yaml(shared, exported.text)
    assert again.status_code == 200 and again.json()["slos"][0]["result"] == "unchanged", again.text
    assert shared.call("DELETE", f"/api/v1/slos/{created.json()['id']}").status_code == 204
    imported = _post_yaml(shared, exported.text)
    assert imported.status_code == 201, imported.text
    (result,) = imported.json()["slos"]
    assert result["result"] == "created" and result["name"] == original["name"]
    assert _fields(shared.call("GET", f"/api/v1/slos/{result['id']}").json()) == original


@pytest.mark.parametrize("objective", [99.9, 99.95, 99.999, 12.3456, 50, 99.5, 0.1, 99.99999])
def test_objectives_travel_without_float_noise(objective: float) -> None:
    slo = SloCreate.model_validate(make_slo(objective=objective))
    (doc,) = yaml.safe_load_all(openslo.dump(slo))
    decimal_shift = str(Decimal(repr(float(objective))).scaleb(-2)).rstrip("0")  # 99.9 -> 0.999, never 0.99900..1
    assert repr(doc["spec"]["objectives"][0]["target"]) == decimal_shift
    assert openslo.parse(openslo.dump(slo))[0].slo == slo


def test_export_of_every_slo_validates_against_the_schema(shared: Api) -> None:
    for i in range(2):
        assert shared.call("POST", "/api/v1/slos", json=make_slo(name=f"all-{i}")).status_code == 201
    exported = shared.call("GET", "/api/v1/slos/openslo", role="viewer")
    assert exported.status_code == 200
    docs = assert_valid_openslo(exported.text)
    names = [openslo.parse(yaml.safe_dump(d))[0].slo.name for d in docs]
    assert {"all-0", "all-1"} <= set(names) and names == sorted(names)


SEPARATE_DOCUMENTS = """
apiVersion: openslo/v1
kind: Service
metadata: {name: inference}
spec: {description: the edge fleet}
---
apiVersion: openslo/v1
kind: SLO
metadata:
  name: fleet-availability
  displayName: Fleet availability
spec:
  service: inference
  indicatorRef: fleet-good-requests
  timeWindow: [{duration: 4w, isRolling: true}]
  budgetingMethod: Occurrences
  objectives: [{displayName: three nines, targetPercent: 99.9}]
  alertPolicies:
    - alertPolicyRef: fast-burn
---
apiVersion: openslo/v1
kind: SLI
metadata: {name: fleet-good-requests}
spec:
  ratioMetric:
    counter: true
    good:
      metricSource:
        type: Prometheus
        spec:
          query: 'spillway_requests_total{region="eu", spillway_outcome=~"GOOD"}'
    total:
      metricSource: {type: Prometheus, spec: {query: 'spillway_requests_total{region="eu"}'}}
---
apiVersion: openslo/v1
kind: AlertPolicy
metadata: {name: fast-burn}
spec:
  alertWhenNoData: false
  alertWhenResolved: false
  alertWhenBreaching: true
  conditions: [{conditionRef: burn-14}]
  notificationTargets: [{targetRef: on-call}]
---
apiVersion: openslo/v1
kind: AlertCondition
metadata: {name: burn-14}
spec:
  severity: page
  condition: {kind: burnrate, op: gte, threshold: 14.4, lookbackWindow: 1h}
"""


def test_separate_sli_and_alert_documents_in_one_file(shared: Api) -> None:
    from controlplane.slo.promql import GOOD_OUTCOMES_REGEX

    text = SEPARATE_DOCUMENTS.replace("GOOD", GOOD_OUTCOMES_REGEX)  # targetPercent: spec text, not in the POC schema
    imported = _post_yaml(shared, text)
    assert imported.status_code == 201, imported.text
    stored = shared.call("GET", f"/api/v1/slos/{imported.json()['slos'][0]['id']}").json()
    assert _fields(stored) == {
        "name": "fleet-availability", "description": "Fleet availability", "sli_kind": "availability",
        "selector": {"labels": {"region": "eu"}, "model": None, "tenant": None}, "threshold_ms": None,
        "objective": 99.9, "window": "28d",
        "alert_windows": [{"long": "1h", "short": "5m", "burn_rate": 14.4, "severity": "page"}],  # short: long / 12
    }  # fmt: skip


def _exported(name: str, **over: Any) -> str:
    return openslo.dump(SloCreate.model_validate(make_slo(name=name, **over)))


def test_upsert_answers_created_updated_unchanged_and_dry_run_writes_nothing(shared: Api) -> None:
    one, two = _exported("upsert-one"), _exported("upsert-two", objective=99)
    first = _post_yaml(shared, one + "---\n" + two)
    assert first.status_code == 201 and [s["result"] for s in first.json()["slos"]] == ["created", "created"]
    ids = [s["id"] for s in first.json()["slos"]]
    changed = two.replace("target: 0.99\n", "target: 0.98\n")
    second = _post_yaml(shared, one + "---\n" + changed)
    assert second.status_code == 200, second.text
    assert [(s["id"], s["result"]) for s in second.json()["slos"]] == [(ids[0], "unchanged"), (ids[1], "updated")]
    stored = shared.call("GET", f"/api/v1/slos/{ids[1]}").json()
    assert (stored["objective"], stored["version"]) == (98.0, 2)
    events = shared.call("GET", "/api/v1/events", params={"kind": "slo.updated"}).json()["items"]
    assert any(e["subject_id"] == ids[1] and e["reason"] == "OpenSLO import" for e in events)

    before = shared.call("GET", "/api/v1/events", params={"limit": 1}).json()["items"][0]["id"]
    dry = _post_yaml(shared, _exported("upsert-three") + "---\n" + two, dry_run="true")
    assert dry.status_code == 200, dry.text
    assert dry.json()["dry_run"] is True
    assert dry.json()["slos"] == [{"id": None, "name": "upsert-three", "result": "created"},
                                  {"id": ids[1], "name": "upsert-two", "result": "updated"}]  # fmt: skip
    assert shared.call("GET", f"/api/v1/slos/{ids[1]}").json()["objective"] == 98.0
    names = [s["name"] for s in shared.call("GET", "/api/v1/slos", params={"limit": 500}).json()["items"]]
    assert "upsert-three" not in names
    assert shared.call("GET", "/api/v1/events", params={"limit": 1}).json()["items"][0]["id"] == before


def test_one_bad_document_imports_nothing(shared: Api) -> None:
    bad = _exported("atomic-bad").replace("isRolling: true", "isRolling: false")
    answer = _post_yaml(shared, _exported("atomic-good") + "---\n" + bad)
    assert answer.status_code == 422
    assert answer.json()["details"] == [{"field": "documents[1].spec.timeWindow[0].isRolling",
                                         "message": "must be true: Spillway windows are rolling"}]  # fmt: skip
    names = [s["name"] for s in shared.call("GET", "/api/v1/slos", params={"limit": 500}).json()["items"]]
    assert "atomic-good" not in names


def _edit(change: Callable[[dict[str, Any]], None]) -> str:
    doc = yaml.safe_load(_exported("refused"))
    change(doc)
    return yaml.safe_dump(doc, sort_keys=False)


SLI = ["spec", "indicator", "spec", "ratioMetric"]


def _at(doc: dict[str, Any], *path: Any) -> Any:
    for key in path:
        doc = doc[key]
    return doc


REFUSALS: dict[str, tuple[Callable[[dict[str, Any]], None], str, str]] = {
    "calendar window": (lambda d: d["spec"]["timeWindow"][0].update(
        calendar={"startTime": "2020-01-21 12:30:00", "timeZone": "America/New_York"}),
        "documents[0].spec.timeWindow[0].calendar", "calendar-aligned"),
    "calendar length": (lambda d: d["spec"]["timeWindow"][0].update(duration="1M"),
                        "documents[0].spec.timeWindow[0].duration", "calendar lengths"),
    "arbitrary query": (lambda d: _at(d, *SLI, "good", "metricSource", "spec").update(query="sum(rate(x[5m]))"),
                        "documents[0].spec.indicator.spec.ratioMetric.good.metricSource.spec.query",
                        "not a query Spillway generates"),
    "another label value in good only": (
        lambda d: _at(d, *SLI, "good", "metricSource", "spec").update(
            query=_at(d, *SLI, "good", "metricSource", "spec", "query").replace('"edge"', '"cloud"')),
        "documents[0].spec.indicator.spec.ratioMetric.good.metricSource.spec.query", "it would be"),
    "timeslices": (lambda d: d["spec"].update(budgetingMethod="Timeslices"),
                   "documents[0].spec.budgetingMethod", "Occurrences"),
    "unknown metric source": (lambda d: _at(d, *SLI, "total", "metricSource").update(type="Datadog"),
                              "documents[0].spec.indicator.spec.ratioMetric.total.metricSource.type", "Prometheus"),
    "threshold metric": (lambda d: d["spec"]["indicator"]["spec"].update(thresholdMetric={}),
                         "documents[0].spec.indicator.spec.thresholdMetric", "ratioMetric"),
    "two objectives": (lambda d: d["spec"]["objectives"].append({"target": 0.9}),
                       "documents[0].spec.objectives", "exactly one"),
    "not a burn rate": (lambda d: _at(d, "spec", "alertPolicies", 0, "spec", "conditions", 0, "spec", "condition")
                        .update(op="lte"),
                        "documents[0].spec.alertPolicies[0].spec.conditions[0].spec.condition.op", "gte"),
    "above, not at or above": (lambda d: _at(d, "spec", "alertPolicies", 0, "spec", "conditions", 0, "spec",
                                             "condition").update(op="gt"),
                               "documents[0].spec.alertPolicies[0].spec.conditions[0].spec.condition.op", "gte"),
    "kind as a list": (lambda d: d.update(kind=["SLO"]), "documents[0].kind", "not an OpenSLO v1 kind"),
    "kind as a mapping": (lambda d: d.update(kind={"SLO": 1}), "documents[0].kind", "not an OpenSLO v1 kind"),
    "NaN target": (lambda d: d["spec"]["objectives"][0].update(target=float("nan")),
                   "documents[0].spec.objectives[0].target", "finite"),
    "infinite target": (lambda d: d["spec"]["objectives"][0].update(target=float("inf")),
                        "documents[0].spec.objectives[0].target", "finite"),
    "huge target": (lambda d: d["spec"]["objectives"][0].update(target=10**400),
                    "documents[0].spec.objectives[0].target", "finite"),
    "huge targetPercent": (lambda d: d["spec"]["objectives"].__setitem__(0, {"targetPercent": -(10**400)}),
                           "documents[0].spec.objectives[0].targetPercent", "finite"),
    "huge burn rate": (lambda d: _at(d, "spec", "alertPolicies", 0, "spec", "conditions", 0, "spec", "condition")
                       .update(threshold=10**400),
                       "documents[0].spec.alertPolicies[0].spec.conditions[0].spec.condition.threshold", "finite"),
    "a delay": (lambda d: _at(d, "spec", "alertPolicies", 0, "spec", "conditions", 0, "spec", "condition")
                .update(alertAfter="5m"),
                "documents[0].spec.alertPolicies[0].spec.conditions[0].spec.condition.alertAfter", "delay"),
    "reference to nothing": (lambda d: d["spec"].update(alertPolicies=[{"alertPolicyRef": "elsewhere"}]),
                             "documents[0].spec.alertPolicies[0].alertPolicyRef", "no AlertPolicy"),
    "name spillway cannot store": (lambda d: d["metadata"].update(name="a/b|c"),
                                   "documents[0].metadata.name", "pattern"),
    "latency threshold not a bucket boundary": (
        lambda d: _at(d, *SLI, "good", "metricSource", "spec").update(
            query=_at(d, *SLI, "good", "metricSource", "spec", "query").replace('le="0.05"', 'le="0.051"')),
        "documents[0].spec.indicator.spec.ratioMetric.good.metricSource.spec.query", "not a latency bucket boundary"),
    "v1alpha": (lambda d: d.update(apiVersion="openslo/v1alpha"), "documents[0].apiVersion", "openslo/v1"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_field(shared: Api, case: str) -> None:
    change, field, words = REFUSALS[case]
    answer = _post_yaml(shared, _edit(change))
    assert answer.status_code == 422, answer.text
    body = answer.json()
    assert body["details"][0]["field"] == field and words in body["details"][0]["message"], body
    assert body["message"].startswith(field)


def test_bad_yaml_content_type_roles_and_missing(shared: Api) -> None:
    bad = _post_yaml(shared, "apiVersion: [openslo/v1\n")
    assert bad.status_code == 422 and bad.json()["details"][0]["field"] == "body"
    bomb = _post_yaml(shared, "a: &x [1, 2]\nb: [*x, *x]\n")
    assert bomb.status_code == 422 and "aliases" in bomb.json()["message"]
    empty = _post_yaml(shared, "apiVersion: openslo/v1\nkind: Service\nmetadata: {name: s}\nspec: {}\n")
    assert empty.status_code == 422 and "no SLO document" in empty.json()["message"]
    as_json = shared.call("POST", "/api/v1/slos/import", json={"apiVersion": "openslo/v1"})
    assert as_json.status_code == 415 and "application/yaml" in as_json.json()["message"]
    for media in ("application/x-yaml", "text/yaml; charset=utf-8"):
        ok = shared.call("POST", "/api/v1/slos/import", content=_exported("media").encode(),
                         headers={"Content-Type": media}, params={"dry_run": "true"})  # fmt: skip
        assert ok.status_code == 200, ok.text
    assert _post_yaml(shared, _exported("viewer"), role="viewer").status_code == 403
    assert shared.client.post("/api/v1/slos/import", content=b"x", headers=YAML).status_code == 401
    assert shared.call("GET", "/api/v1/slos/nope/openslo", role="viewer").status_code == 404


def test_a_window_openslo_cannot_say_is_a_409(shared: Api) -> None:
    created = shared.call("POST", "/api/v1/slos", json=make_slo(name="seconds", window=3601, alert_windows=[]))
    assert created.status_code == 201, created.text
    answer = shared.call("GET", f"/api/v1/slos/{created.json()['id']}/openslo")
    assert answer.status_code == 409 and "whole number of minutes" in answer.json()["message"]
    shared.call("DELETE", f"/api/v1/slos/{created.json()['id']}")


@pytest.mark.postgres
def test_import_and_export_on_postgresql(postgres_url: str) -> None:
    for api in open_api(postgres_url):
        text = openslo.dump(SloCreate.model_validate(ROUND_TRIPS["latency"]))
        assert _post_yaml(api, text).status_code == 201
        assert _post_yaml(api, text).json()["slos"][0]["result"] == "unchanged"
        exported = api.call("GET", "/api/v1/slos/openslo", role="viewer").text
        assert openslo.parse(exported)[0].slo == SloCreate.model_validate(ROUND_TRIPS["latency"])


def test_the_example_file_is_valid_openslo_and_imports(shared: Api) -> None:
    text = (Path(__file__).resolve().parents[2] / "examples" / "openslo.yaml").read_text()
    assert [d["kind"] for d in assert_valid_openslo(text)] == ["SLO", "SLO"]
    checked = _post_yaml(shared, text, dry_run="true")
    assert checked.status_code == 200, checked.text  # a dry run creates nothing
    assert [(s["name"], s["result"]) for s in checked.json()["slos"]] == [
        ("mlp-latency", "created"), ("tiny-lm-ttft", "created")]  # fmt: skip
    names = [s["name"] for s in shared.call("GET", "/api/v1/slos", params={"limit": 500}).json()["items"]]
    assert "mlp-latency" not in names and "tiny-lm-ttft" not in names


@pytest.mark.parametrize("body", ["[" * 5000, "{a: " * 5000, "- " * 5000 + "x"])
def test_deep_nesting_is_a_422_naming_the_body(shared: Api, body: str) -> None:
    answer = _post_yaml(shared, body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["details"][0]["field"] == "body" and "not YAML" in answer.json()["message"]


def test_a_deep_but_reasonable_document_still_loads() -> None:
    assert openslo.load_documents("a: " + "[" * 60 + "]" * 60) == [{"a": _nested(59)}]


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def _edited(name: str, change: Callable[[dict[str, Any]], None], **over: Any) -> str:
    doc = yaml.safe_load(_exported(name, **over))
    change(doc)
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def test_an_edited_name_or_description_wins_over_the_annotation() -> None:
    long = "y" * 1500
    (untouched,) = openslo.parse(_exported("My_Edit.SLO", description=long))
    assert (untouched.slo.name, untouched.slo.description) == ("My_Edit.SLO", long)
    renamed = _edited("My_Edit.SLO", lambda d: d["metadata"].update(name="renamed"), description=long)
    (edited,) = openslo.parse(renamed)
    assert (edited.slo.name, edited.slo.description) == ("renamed", long)
    assert edited.field("name") == "documents[0].metadata.name"
    described = _edited("My_Edit.SLO", lambda d: d["spec"].update(description="short now"), description=long)
    (edited,) = openslo.parse(described)
    assert (edited.slo.name, edited.slo.description) == ("My_Edit.SLO", "short now")


@pytest.mark.parametrize(("long", "short"), [("30m", 180), ("90m", 480), ("6m", 60), ("5m", 60), ("1h", 300),
                                             ("18m", 120), ("2h", 600), ("1d", 7200)])  # fmt: skip
def test_the_default_short_window_rounds_halves_up(long: str, short: int) -> None:
    def change(d: dict[str, Any]) -> None:
        condition = _at(d, "spec", "alertPolicies", 0, "spec", "conditions", 0)
        del condition["metadata"]["annotations"]
        condition["spec"]["condition"]["lookbackWindow"] = long

    (imported,) = openslo.parse(_edited("short-window", change))
    assert imported.slo.alert_windows[0].short == short


ODD_BUCKETS = [4.2, 4.9, 5.9, 6.9, 13.8, 33.6]


@pytest.mark.parametrize("threshold", ODD_BUCKETS)
def test_thresholds_whose_le_has_float_noise_read_back(threshold: float) -> None:
    slo = SloCreate.model_validate(make_slo(threshold_ms=threshold))
    assert openslo.parse(openslo.dump(slo))[0].slo == slo


def test_thresholds_whose_le_has_float_noise_import_back_unchanged(tmp_path: Path) -> None:
    for api in open_api(f"sqlite:///{tmp_path / 'buckets.db'}", latency_buckets_ms=[*ODD_BUCKETS, 100.0]):
        for threshold in ODD_BUCKETS:
            created = api.call("POST", "/api/v1/slos", json=make_slo(name=f"odd-{threshold}", threshold_ms=threshold))
            assert created.status_code == 201, created.text
        exported = api.call("GET", "/api/v1/slos/openslo", role="viewer")
        assert 'le=\\"0.004200000000000001\\"' in exported.text or 'le="0.004200000000000001"' in exported.text
        again = _post_yaml(api, exported.text)
        assert again.status_code == 200, again.text
        assert [s["result"] for s in again.json()["slos"]] == ["unchanged"] * len(ODD_BUCKETS)


def test_export_of_every_slo_has_distinct_names(shared: Api) -> None:
    ids = {}
    for name in ("Same_Label", "same-label", "SAME.label"):
        created = shared.call("POST", "/api/v1/slos", json=make_slo(name=name))
        assert created.status_code == 201, created.text
        ids[name] = created.json()["id"]
    exported = shared.call("GET", "/api/v1/slos/openslo", role="viewer")
    assert exported.status_code == 200
    docs = [d for d in assert_valid_openslo(exported.text) if d["metadata"]["name"].startswith("same-label")]
    names = [d["metadata"]["name"] for d in docs]
    assert len(names) == 3 and len(set(names)) == 3 and "same-label" in names, names
    assert {openslo.parse(yaml.safe_dump(d))[0].slo.name for d in docs} == set(ids)
    again = _post_yaml(shared, exported.text)
    assert again.status_code == 200, again.text
    assert {(s["name"], s["id"], s["result"]) for s in again.json()["slos"] if s["name"] in ids} == {
        (name, ident, "unchanged") for name, ident in ids.items()}  # fmt: skip
    for ident in ids.values():
        shared.call("DELETE", f"/api/v1/slos/{ident}")


def test_unique_names_suffix_later_ones_from_their_ids() -> None:
    slos = [SloCreate.model_validate(make_slo(name=n)) for n in ("My_SLO", "my-slo", "MY.SLO", "my-slo-0000abcd")]
    names = openslo.unique_names(slos, ["aaaa1111bbbb2222", "0000abcd9999ffff", "0000abcd9999eeee", "x"])
    assert names == ["my-slo", "my-slo-0000abcd", "my-slo-0000abcd9", "my-slo-0000abcd-0000000x"]


def test_agent_labels_promql_cannot_say_are_a_409() -> None:
    slo = SloCreate.model_validate(make_slo(name="clash", selector={"labels": {"le": "x"}}))
    with pytest.raises(Conflict) as raised:
        openslo.dump(slo)
    assert "'le'" in raised.value.message and raised.value.details[0]["field"] == "selector.labels"


def test_a_failing_write_stores_nothing(shared: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.db import repository

    calls: list[str] = []
    real = repository.create_row

    def create_row(*args: Any, **kwargs: Any) -> Any:
        calls.append("create")
        if len(calls) == 2:
            raise RuntimeError("the disk is full")
        return real(*args, **kwargs)

    monkeypatch.setattr(repository, "create_row", create_row)
    answer = _post_yaml(shared, _exported("atomic-write-1") + "---\n" + _exported("atomic-write-2"))
    assert answer.status_code == 500 and calls == ["create", "create"]
    monkeypatch.undo()
    names = [s["name"] for s in shared.call("GET", "/api/v1/slos", params={"limit": 500}).json()["items"]]
    assert "atomic-write-1" not in names and "atomic-write-2" not in names
