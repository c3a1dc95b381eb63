"""The SLOs as a Prometheus rule file: `promtool check rules` accepts the rules of every SLI kind and selector, and
`promtool test rules`, fed synthetic counters under the agent's `/metrics` names, finds the recorded burn rates and
the alerts the control plane's own arithmetic (`controlplane.slo.maths`) gives for the same counts. And the routes
that serve the file (`GET /api/v1/slos/prometheus-rules`, `GET /api/v1/slos/{id}/prometheus-rules`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.schemas.slos import SloRead
from controlplane.slo import maths
from controlplane.slo.prometheus_rules import ALERT, RAW_LIMIT_S, rule_file, rule_groups
from controlplane.slo.promql import le_value, window
from tests.conftest import Api
from tests.utils.builders import make_agent, make_slo

PROMTOOL = "/usr/bin/promtool"


def promtool() -> str:
    if Path(PROMTOOL).exists():
        return PROMTOOL
    if shutil.which("promtool") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing: CI installs Debian's `prometheus` package (.ci/run)")
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return str(shutil.which("promtool"))


def slo(ident: str, **fields: Any) -> SloRead:
    now = datetime.now(UTC)
    return SloRead.model_validate({"id": ident, "version": 1, "created_at": now, "updated_at": now, **fields})


def pairs(*specs: tuple[str, str, float, str]) -> list[dict[str, Any]]:
    return [{"long": long, "short": short, "burn_rate": rate, "severity": severity}
            for long, short, rate, severity in specs]  # fmt: skip


EVERY_KIND = [
    slo("s1", name="edge.availability", sli_kind="availability", objective=99.5,
        selector={"model": "mlp", "tenant": "default", "labels": {"site": "lyon", "k8s.zone": "eu-1"}}),
    slo("s2", name="mlp-latency", sli_kind="latency", threshold_ms=50, objective=99, window="7d",
        selector={"tenant": "acme"}),
    slo("s3", name="chat_ttft", sli_kind="ttft", threshold_ms=500, objective=95, window="1d",
        selector={"model": "tiny-lm"}, alert_windows=pairs(("1h", "5m", 10, "page"), ("6h", "30m", 2, "ticket"))),
    slo("s4", name="chat-tpot", sli_kind="tpot", threshold_ms=100, objective=99.9, window="90d",
        selector={"labels": {"tier": "edge"}}),
    slo("s5", name="short", sli_kind="availability", objective=90, window="1m"),  # no pairs: no alerts
]  # fmt: skip


def test_rules_of_every_kind_pass_promtool_check(tmp_path: Path) -> None:
    path = tmp_path / "spillway-slos.rules.yml"
    path.write_text(rule_file(EVERY_KIND))
    checked = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    groups = {group["name"]: group for group in yaml.safe_load(path.read_text())["groups"]}
    assert list(groups) == ["spillway-slo-edge-availability", "spillway-slo-mlp-latency", "spillway-slo-chat_ttft",
                            "spillway-slo-chat-tpot", "spillway-slo-short"]  # fmt: skip
    ttft = groups["spillway-slo-chat_ttft"]["rules"]
    recorded = {rule["labels"]["spillway_window"] for rule in ttft if rule.get("record") == "slo:burn_rate:ratio"}
    assert recorded == {"5m", "30m", "1h", "6h", "1d"}  # every pair's windows, the base window and the SLO window
    ratio = next(rule for rule in ttft if rule.get("record") == "slo:sli_error:ratio_rate1h")
    assert 'gen_ai_server_time_to_first_token_seconds_bucket{gen_ai_request_model="tiny-lm", le="0.5"}[1h]' in ratio[
        "expr"]  # fmt: skip
    assert ratio["labels"] == {"spillway_slo_id": "s3", "spillway_slo": "chat_ttft", "spillway_sli": "ttft",
                               "spillway_window": "1h"}  # fmt: skip
    # One alert per severity, OR-ing that severity's pairs; none for an SLO without pairs.
    alerts = [rule for rule in ttft if "alert" in rule]
    assert [(a["alert"], a["labels"]["severity"]) for a in alerts] == [(ALERT, "page"), (ALERT, "ticket")]
    assert "chat_ttft" in alerts[0]["annotations"]["summary"]
    assert not [rule for rule in groups["spillway-slo-short"]["rules"] if "alert" in rule]
    # The agent labels are matchers under their Prometheus names; the default tenant also matches unlabelled series.
    availability = next(r for r in groups["spillway-slo-edge-availability"]["rules"]
                        if r.get("record") == "slo:sli_error:ratio_rate5m")  # fmt: skip
    assert 'k8s_zone="eu-1", site="lyon", spillway_model="mlp", spillway_tenant=~"default|"' in availability["expr"]


def test_long_windows_sum_the_recorded_base_rates() -> None:
    """A window over RAW_LIMIT_S (the 28d SLO window) is summed from the 5-minute recordings, weighted by traffic;
    shorter ones are raw rates over the agents' series."""
    (group,) = rule_groups([slo("s1", name="a", sli_kind="availability", objective=99.5)])["groups"]
    exprs = {rule["record"]: rule["expr"] for rule in group["rules"] if "record" in rule and "rate" in rule["record"]}
    assert "slo:sli_good:rate5m" in exprs and "slo:sli_total:rate5m" in exprs
    assert exprs["slo:sli_error:ratio_rate28d"].startswith("1 - (sum_over_time(slo:sli_good:rate5m{")
    assert 28 * 86400 > RAW_LIMIT_S >= 4032 * 60  # the default pairs' longest window (2.8 days) stays raw
    assert exprs["slo:sli_error:ratio_rate4032m"].startswith("1 - ((sum(rate(spillway_requests_total{")
    (short,) = rule_groups([slo("s2", name="b", sli_kind="availability", objective=99.5, window="1d")])["groups"]
    assert not any(rule.get("record", "").startswith("slo:sli_good") for rule in short["rules"])


# ---- promtool test rules: the rules compute what the control plane computes ----------------------------------------

MINUTES = 180  # every input series has a sample a minute from 0 to 180m; the checks run at the end
SCENARIO = [
    # burning: 1/6 of the requests fail all along, a burn rate of 16.7 everywhere: both page and ticket fire.
    slo("a", name="burning", sli_kind="availability", objective=99, window="4d", selector={"model": "mlp"},
        alert_windows=pairs(("1h", "5m", 14.4, "page"), ("6h", "30m", 6, "ticket"))),
    # blip: failures only in the last 5 minutes: the short windows burn fast, the long ones do not: nothing fires.
    slo("b", name="blip", sli_kind="availability", objective=99, window="4d", selector={"model": "blip"},
        alert_windows=pairs(("1h", "5m", 14.4, "page"), ("6h", "30m", 6, "ticket"))),
    # slow: 10 % of the local requests over 50 ms (the overflowed ones do not count), a burn rate of 2: a ticket.
    slo("c", name="slow", sli_kind="latency", threshold_ms=50, objective=95, window="1d", selector={"model": "mlp"}),
    # outage: every request refused, so no good series exists at all: a burn rate of 100, both alerts fire.
    slo("d", name="outage", sli_kind="availability", objective=99, window="4d", selector={"model": "down"},
        alert_windows=pairs(("1h", "5m", 14.4, "page"), ("6h", "30m", 6, "ticket"))),
]  # fmt: skip


def steady(per_minute: int) -> list[float]:
    return [float(per_minute * minute) for minute in range(MINUTES + 1)]


def last_minutes(count: int, per_minute: int) -> list[float]:
    start = MINUTES - count
    return [float(per_minute * max(0, minute - start)) for minute in range(MINUTES + 1)]


def requests(model: str, outcome: str) -> str:
    return f'spillway_requests_total{{instance="a1", spillway_model="{model}", spillway_outcome="{outcome}"}}'


def durations(suffix: str, outcome: str, le: str | None = None) -> str:
    bound = f', le="{le}"' if le else ""
    return f'spillway_request_duration_seconds_{suffix}{{spillway_model="mlp", spillway_outcome="{outcome}"{bound}}}'


# Counter values, a sample a minute, under the names the agent's /metrics gives them.
SERIES: dict[str, list[float]] = {
    requests("mlp", "local"): steady(90),
    requests("mlp", "overflow"): steady(10),  # answered by the cloud: good for availability
    requests("mlp", "error"): steady(20),
    requests("blip", "local"): steady(100),
    requests("blip", "rejected"): last_minutes(5, 100),
    requests("down", "rejected"): steady(50),
    durations("bucket", "local", le_value(0.05)): steady(90),
    durations("count", "local"): steady(100),
    durations("count", "overflow"): steady(50),  # not served locally: not in a latency SLI
}
# (good series, total series) of each SCENARIO SLO, as the control plane would count them from the same requests.
COUNTED = {
    "a": ([requests("mlp", "local"), requests("mlp", "overflow")],
          [requests("mlp", outcome) for outcome in ("local", "overflow", "error")]),
    "b": ([requests("blip", "local")], [requests("blip", "local"), requests("blip", "rejected")]),
    "c": ([durations("bucket", "local", le_value(0.05))], [durations("count", "local")]),
    "d": ([], [requests("down", "rejected")]),
}  # fmt: skip


def counts(ident: str, seconds: int, at: int = MINUTES) -> maths.Counts:
    """Good and total events of an SLO over the `seconds` before minute `at` (the whole history when longer)."""
    start = max(0, at - seconds // 60)
    good, total = [sum(SERIES[name][at] - SERIES[name][start] for name in names) for names in COUNTED[ident]]
    return maths.Counts(good, total)


def expanding(values: list[float]) -> str:
    return " ".join(f"{value:g}" for value in values)


def render(template: str, labels: dict[str, str], value: float) -> str:
    """What Prometheus' template makes of the two constructs the generated annotations use."""
    text = template.replace('{{ $value | printf "%.1f" }}', f"{value:.1f}")
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)


def bounds(ident: str, seconds: int, objective: float) -> tuple[float, float]:
    """The burn rate the control plane says over `seconds`: exactly for a raw window; between what it said 5 minutes
    ago and what it says now for a window summed from the 5-minute recordings (which trail by up to 5 minutes)."""
    now = maths.burn_rate(counts(ident, seconds), objective)
    assert now is not None
    if seconds <= RAW_LIMIT_S:
        return now, now
    before = maths.burn_rate(counts(ident, seconds, at=MINUTES - 5), objective)
    assert before is not None
    return min(before, now), max(before, now)


def within(expr: str, low: float, high: float) -> str:
    return f"({expr} >= bool {low - 1e-9!r}) * ({expr} <= bool {high + 1e-9!r})"


def unit_tests(rules: dict[str, Any]) -> dict[str, Any]:
    checks = []
    expected_alerts = []
    for item in SCENARIO:
        budget = maths.error_budget(item.objective)
        windows = {item.window} | {w for pair in item.alert_windows for w in (pair.long, pair.short)} | {300}
        for seconds in sorted(windows):
            low, high = bounds(item.id, seconds, item.objective)
            selector = f'{{spillway_slo_id="{item.id}", spillway_window="{window(seconds)}"}}'
            checks.append(within(f"slo:burn_rate:ratio{selector}", low, high))
            checks.append(within(f"slo:sli_error:ratio_rate{window(seconds)}{selector}", low * budget, high * budget))
        low, high = bounds(item.id, item.window, item.objective)  # budget remaining = 1 - the window's burn rate
        checks.append(within(f'slo:period_error_budget_remaining:ratio{{spillway_slo_id="{item.id}"}}', 1 - high,
                             1 - low))  # fmt: skip
        group = next(g for g in rules["groups"] if g["name"] == f"spillway-slo-{item.name}")
        alerts = {rule["labels"]["severity"]: rule for rule in group["rules"] if "alert" in rule}
        for pair in item.alert_windows:
            long = maths.burn_rate(counts(item.id, pair.long), item.objective)
            short = maths.burn_rate(counts(item.id, pair.short), item.objective)
            if not maths.firing(long, short, pair.burn_rate):
                continue
            assert long is not None
            labels = {"severity": pair.severity, "spillway_slo_id": item.id, "spillway_slo": item.name,
                      "spillway_sli": item.sli_kind, "spillway_long_window": window(pair.long),
                      "spillway_short_window": window(pair.short),
                      "spillway_burn_rate_threshold": f"{pair.burn_rate:g}"}  # fmt: skip
            annotations = {k: render(v, labels, long) for k, v in alerts[pair.severity]["annotations"].items()}
            expected_alerts.append({"exp_labels": labels, "exp_annotations": annotations})
    # The scenario is what it claims: both of burning's and outage's alerts fire, nothing of blip's (its short windows
    # do burn).
    assert sorted((a["exp_labels"]["spillway_slo"], a["exp_labels"]["severity"]) for a in expected_alerts) == [
        ("burning", "page"), ("burning", "ticket"), ("outage", "page"), ("outage", "ticket"),
        ("slow", "ticket")]  # fmt: skip
    blip_short = maths.burn_rate(counts("b", 300), 99)
    assert blip_short is not None and blip_short > 14.4
    exprs = [{"expr": expr, "eval_time": f"{MINUTES}m", "exp_samples": [{"labels": _result_labels(expr), "value": 1}]}
             for expr in checks]  # fmt: skip
    return {
        "rule_files": ["spillway-slos.rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": name, "values": expanding(values)} for name, values in SERIES.items()],
            "promql_expr_test": exprs,
            "alert_rule_test": [{"eval_time": f"{MINUTES}m", "alertname": ALERT, "exp_alerts": expected_alerts}],
        }],
    }  # fmt: skip


def _result_labels(expr: str) -> str:
    """The labels of the recorded series `expr` selects (the comparison drops the name)."""
    ident = re.search(r'spillway_slo_id="(\w+)"', expr)
    assert ident is not None
    item = next(s for s in SCENARIO if s.id == ident.group(1))
    labels = {"spillway_slo_id": item.id, "spillway_slo": item.name, "spillway_sli": item.sli_kind}
    found = re.search(r'spillway_window="(\w+)"', expr)
    labels["spillway_window"] = found.group(1) if found else window(item.window)
    return "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def test_promtool_finds_the_control_planes_burn_rates_and_alerts(tmp_path: Path) -> None:
    rules = rule_groups(SCENARIO)
    (tmp_path / "spillway-slos.rules.yml").write_text(rule_file(SCENARIO))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(unit_tests(rules), sort_keys=False, width=1000))
    tested = subprocess.run([promtool(), "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr


# ---- the routes ----------------------------------------------------------------------------------------------------


def test_routes_serve_the_rule_file_to_viewers(sqlite_api: Api, tmp_path: Path) -> None:
    first = sqlite_api.call("POST", "/api/v1/slos", json=make_slo(name="b-latency")).json()
    second = sqlite_api.call("POST", "/api/v1/slos", json=make_slo(name="a-availability", sli_kind="availability",
                                                                    threshold_ms=None)).json()  # fmt: skip
    every = sqlite_api.call("GET", "/api/v1/slos/prometheus-rules", role="viewer")
    assert every.status_code == 200, every.text
    assert every.headers["content-type"].startswith("application/yaml")
    groups = yaml.safe_load(every.text)["groups"]
    assert [g["name"] for g in groups] == ["spillway-slo-a-availability", "spillway-slo-b-latency"]  # by name
    assert {r["labels"]["spillway_slo_id"] for g in groups for r in g["rules"] if "record" in r} == {
        first["id"], second["id"]}  # fmt: skip
    (tmp_path / "every.yml").write_text(every.text)
    checked = subprocess.run([promtool(), "check", "rules", str(tmp_path / "every.yml")], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    one = sqlite_api.call("GET", f"/api/v1/slos/{first['id']}/prometheus-rules", role="viewer")
    assert one.status_code == 200 and one.headers["content-type"].startswith("application/yaml")
    assert [g["name"] for g in yaml.safe_load(one.text)["groups"]] == ["spillway-slo-b-latency"]


def test_routes_refuse_strangers_and_name_a_missing_slo(sqlite_api: Api) -> None:
    client = sqlite_api.client
    for path in ("/api/v1/slos/prometheus-rules", "/api/v1/slos/0000000000000000/prometheus-rules"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer spk_0000000000000000_wrong"}).status_code == 401
    token = sqlite_api.call("POST", "/api/v1/agents", json=make_agent()).json()["token"]
    assert client.get("/api/v1/slos/prometheus-rules", headers={"Authorization": f"Bearer {token}"}).status_code == 403
    missing = sqlite_api.call("GET", "/api/v1/slos/0000000000000000/prometheus-rules", role="viewer")
    assert missing.status_code == 404 and missing.headers["content-type"] == "application/json"
    assert missing.json()["error"] == "not_found" and "0000000000000000" in missing.json()["message"]
    empty = sqlite_api.call("GET", "/api/v1/slos/prometheus-rules", role="viewer")
    assert empty.status_code == 200 and yaml.safe_load(empty.text) == {"groups": []}


def test_agent_labels_that_would_clash_with_the_metrics_labels_are_refused_not_written_ambiguously(
    sqlite_api: Api, tmp_path: Path
) -> None:
    clashes = {
        "spillway_model": {"spillway_model": "mlp"},  # would read as the model, not an agent label
        "le": {"le": "0.5"},  # would pick a bucket
        "a_b": {"a.b": "1", "a_b": "2"},  # two keys, one Prometheus label
    }
    ids = {}
    for name, labels in clashes.items():
        created = sqlite_api.call(
            "POST", "/api/v1/slos", json=make_slo(name=f"clash-{name}", selector={"labels": labels})
        )
        assert created.status_code == 201, created.text
        ids[name] = created.json()["id"]
        one = sqlite_api.call("GET", f"/api/v1/slos/{ids[name]}/prometheus-rules", role="viewer")
        assert one.status_code == 409 and f"'{name}'" in one.json()["message"], one.text
    fine = sqlite_api.call("POST", "/api/v1/slos", json=make_slo(name="fine", selector={"labels": {"k8s.zone": "a"}}))
    every = sqlite_api.call("GET", "/api/v1/slos/prometheus-rules", role="viewer")
    assert every.status_code == 200
    assert [g["name"] for g in yaml.safe_load(every.text)["groups"]] == ["spillway-slo-fine"]
    assert all(f"# left out: clash-{name} ({ident})" in every.text for name, ident in ids.items()), every.text
    assert fine.status_code == 201
    (tmp_path / "every.yml").write_text(every.text)
    checked = subprocess.run([promtool(), "check", "rules", str(tmp_path / "every.yml")], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
