"""The dashboard's plain parts: API errors to field messages, sentences for rules and events, the degradation
ladder, form parsing, numbers for people, history answers shaped for the charts (on recorded sample answers), and how
`spillway dashboard` starts Streamlit."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from typer.testing import CliRunner

from controlplane.schemas.rules import ACTION_LADDER, GaugeMetric
from controlplane.slo.maths import GOOD_OUTCOMES
from dashboards import fmt, history
from dashboards.api import ApiError, ApiUnreachable, SpillwayApi, field_errors, gather
from dashboards.charts import OUTCOME_COLOURS, OUTCOME_LABELS, budget_history, burn_rate_history, outcome_bars
from dashboards.describe import (
    LADDER,
    action_text,
    agent_state,
    burn_text,
    condition_text,
    coverage_note,
    coverage_text,
    event_numbers,
    event_subject,
    generation_rows,
    generative_settings,
    ladder,
    overflow_text,
    rule_now,
    sli_text,
    tokens_out_per_s,
    worst_p99,
    worst_ttft_p99,
)
from dashboards.forms import (
    ACTION_KINDS,
    GAUGE_METRICS,
    finish_action,
    model_map_text,
    parse_alert_windows,
    parse_model_map,
    parse_sizes,
)
from dashboards.gateway import NOT_LOADED, GatewayView, backend_state, gateway_rows, gateway_summary, gateway_view
from dashboards.launch import dashboard_env, start_dashboard, streamlit_command, wait_ready
from dashboards.session import LocalFieldErrors, field_matches
from spillway.cli import app
from tests.utils.server import free_port

SHED = {"kind": "shed", "priority_at_or_below": 3, "retry_after_s": 7}


def test_field_errors_drop_the_body_prefix_and_join_messages_per_field() -> None:
    details = [
        {"field": "body.objective", "message": "Input should be less than 100"},
        {"field": "body.window", "message": "Value error, 'x' is not a duration"},
        {"field": "body.window", "message": "too long"},
        {"field": "name", "message": "taken"},
    ]
    assert field_errors(details) == {
        "objective": "Input should be less than 100", "window": "'x' is not a duration; too long", "name": "taken"
    }  # fmt: skip
    assert field_errors({"current_etag": '"a-1"'}) == {}  # a 412's details are not per field
    # A check across the body's fields names its field first: it goes under that field.
    across = [{"field": "body", "message": "Value error, model_map: 'coder' is not one of this backend's models"},
              {"field": "body", "message": "Value error, threshold_ms is required for a ttft SLO"}]  # fmt: skip
    assert field_errors(across) == {"model_map": "'coder' is not one of this backend's models",
                                    "body": "threshold_ms is required for a ttft SLO"}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "path", "matches"),
    [
        ("condition.metric", "condition.gauge.metric", True),  # a union's tag sits in the API's path
        ("action.priority_at_or_below", "action.shed.priority_at_or_below", True),
        ("alert_windows", "alert_windows.0.long", True),
        ("selector.labels", "selector.model", False),
        ("name", "description", False),
    ],
)
def test_a_field_takes_the_api_messages_whose_path_runs_through_it(field: str, path: str, matches: bool) -> None:
    assert field_matches(field.split("."), path.split(".")) is matches


def test_api_errors_carry_status_code_and_fields_and_transport_errors_name_the_url() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/slos"):
            body = {"error": "validation_error", "message": "bad", "details": [{"field": "body.name", "message": "x"}]}
            return httpx.Response(422, json=body)
        raise httpx.ConnectError("refused", request=request)

    api = SpillwayApi("http://cp.test", "k", transport=httpx.MockTransport(handler))
    with pytest.raises(ApiError) as refused:
        api.create("slos", {})
    assert (refused.value.status, refused.value.code, refused.value.fields) == (422, "validation_error", {"name": "x"})
    with pytest.raises(ApiUnreachable, match=r"http://cp\.test: connection refused"):
        api.status()
    found = gather({"a": api.status, "b": lambda: 1})
    assert isinstance(found["a"], ApiUnreachable) and found["b"] == 1


def test_whoami_is_asked_once_with_a_get_and_nothing_is_probed() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        return httpx.Response(200, json={"kind": "key", "id": "k1", "name": "ops-viewer", "role": "viewer"})

    api = SpillwayApi("http://cp.test", "k", transport=httpx.MockTransport(handler))
    assert api.whoami() == {"kind": "key", "id": "k1", "name": "ops-viewer", "role": "viewer"}
    assert seen == [("GET", "/api/v1/whoami")]  # no write tried to find the role out


def test_rule_now_says_what_the_rule_does_on_each_agent() -> None:
    rule = {"name": "r", "enabled": True, "dry_run": False, "action": SHED}
    firing = {"agent_name": "jetson-1", "state": "firing", "since": "2026-11-30T12:00:00Z", "step": 0, "latched": True}
    latched = "jetson-1: shed priority 3 and lower (Retry-After 7 s) (latched by the flap limit)"
    assert rule_now(rule, [firing]) == latched
    assert rule_now({**rule, "dry_run": True}, [{**firing, "latched": False}]).startswith("jetson-1: would shed")
    pending = {**firing, "state": "pending"}
    assert rule_now(rule, [pending]) == "jetson-1: met, waiting out `for` (since 2026-11-30 12:00:00)"
    assert rule_now(rule, []) == "condition not met on any agent: nothing to do"
    assert rule_now({**rule, "enabled": False}, [firing]) == "disabled: not evaluated"


def test_ladder_shows_each_rung_in_force_who_put_it_there_and_who_could() -> None:
    policy = {
        "models": {"mlp": {"variant": 2, "shed": {"at_or_below": 3, "retry_after_s": 5}}},
        "causes": [{"name": "lite", "action": "switch_variant"}, {"name": "shed", "action": "shed"}],
    }
    rules: list[dict[str, Any]] = [
        {"name": "lite", "action": {"kind": "switch_variant"}, "selector": {"labels": {"site": "b"}}},
        {"name": "other-site", "action": {"kind": "fallback"}, "selector": {"labels": {"site": "x"}}},
        {"name": "dry", "action": {"kind": "fallback"}, "selector": {}, "dry_run": True},
        {"name": "batch", "action": {"kind": "tune_batching"}, "selector": {"labels": {}}, "enabled": True},
    ]
    rows = {r["rung"]: r for r in ladder(policy, rules, {"labels": {"site": "b"}})}
    assert [r["step"] for r in rows.values()] == [1, 2, 3, 4, 5, 6, 7]
    assert rows["lighter variant"] == {"step": 5, "rung": "lighter variant", "in force": "yes",
                                            "now": "mlp: variant 2", "by rules": "lite",
                                            "rules that can take it": "lite"}  # fmt: skip
    assert rows["shed low priorities"]["now"] == "mlp: priority ≥ 3 refused"
    assert rows["serve fallbacks"]["rules that can take it"] == fmt.DASH  # another site's, and a dry run's
    assert rows["tune batching"]["in force"] == "no" and rows["tune batching"]["rules that can take it"] == "batch"


def test_the_ladder_and_the_action_kinds_follow_the_control_planes_ladder() -> None:
    assert tuple(rung for rung, _ in LADDER) == ACTION_LADDER
    assert ACTION_KINDS == ACTION_LADDER
    assert set(GAUGE_METRICS) == set(get_args(GaugeMetric))  # the form offers every gauge the API takes


def test_generative_conditions_actions_and_policy_in_words() -> None:
    ttft = {"kind": "latency", "metric": "ttft", "quantile": 0.99, "threshold_ms": 500, "window": "5m"}
    assert condition_text(ttft) == "p99 time to first token > 500 ms over 5m"
    assert condition_text({**ttft, "metric": "tpot", "quantile": 0.9}) == "p90 time per output token > 500 ms over 5m"
    assert condition_text({k: v for k, v in ttft.items() if k != "metric"}) == "p99 latency > 500 ms over 5m"
    kv = {"kind": "gauge", "metric": "kv_cache_use_ratio", "op": ">", "threshold": 0.9}
    assert condition_text(kv) == "kv_cache_use_ratio above 0.9"
    assert action_text({"kind": "cap_max_tokens", "max_tokens": 128}) == "cap max_tokens at 128"
    limit = {"kind": "limit_generation", "max_num_seqs": 4, "max_num_batched_tokens": 512}
    assert action_text(limit) == "limit generation: max_num_seqs 4, token budget 512"
    fallback = {"kind": "fallback", "mode": "default", "default_text": "Busy.", "priority_at_or_below": 3}
    assert action_text(fallback) == "default fallback (default text) for priority 3 and lower"
    policy = {
        "models": {"*": {"max_num_seqs": 8}, "tiny-lm": {"max_tokens_cap": 64, "variant": 2}},
        "causes": [{"name": "cap", "action": "cap_max_tokens"}, {"name": "seqs", "action": "limit_generation"}],
    }
    rows = {r["rung"]: r for r in ladder(policy, [], {"labels": {}})}
    assert rows["cap max_tokens"]["now"] == "tiny-lm: max_tokens ≤ 64" and rows["cap max_tokens"]["by rules"] == "cap"
    assert rows["limit generation"]["now"] == "*: max_num_seqs 8"
    settings = generative_settings(policy, ["tiny-lm", "coder"])  # a model's entry over `*`, as the agent reads it
    assert settings == [
        {"model": "coder", "variant": "as configured", "max_tokens cap": "as configured", "max_num_seqs": "8",
         "token budget per step": "as configured"},
        {"model": "tiny-lm", "variant": "2", "max_tokens cap": "64", "max_num_seqs": "8",
         "token budget per step": "as configured"},
    ]  # fmt: skip
    assert generative_settings({"models": {"mlp": {"variant": 2}}}, []) == []  # a V2 model's variant is not listed


def test_generation_rows_and_the_fleets_generative_figures() -> None:
    entry = {
        "model": "tiny-lm", "requests": 40.0, "streams_per_s": 0.5, "tokens_in_per_s": 10.0, "tokens_out_per_s": 30.0,
        "ttft_ms": {"count": 40, "mean": 90.0, "p50": 80.0, "p90": 200.0, "p99": 450.0},
        "tpot_ms": {"count": 40, "mean": 20.0, "p50": 18.0, "p90": 30.0, "p99": 48.0},
        "kv_blocks_used": 48.0, "kv_blocks_total": 64.0, "kv_cache_use": 0.75, "preemptions": 3.0,
        "preemptions_per_min": 0.6, "active_streams": 5.0, "outcomes": {"local": 30.0, "overflow": 10.0},
    }  # fmt: skip
    quiet = {**entry, "model": "coder", "ttft_ms": {"p99": None}, "tokens_out_per_s": 2.0, "kv_cache_use": None}
    row = generation_rows([entry])[0]
    assert (row["TTFT p99 ms"], row["TPOT p50 ms"], row["KV-cache use"]) == (450.0, 18.0, "75% (48 / 64 blocks)")
    assert (row["preemptions/min"], row["active streams"], row["outcomes"]) == (0.6, 5.0, "local 75%, overflow 25%")
    assert generation_rows([quiet])[0]["KV-cache use"] == fmt.DASH
    metrics = {"generation": [entry, quiet]}
    assert (worst_ttft_p99(metrics), tokens_out_per_s(metrics)) == (450.0, 32.0)
    assert worst_ttft_p99({"traffic": []}) is None and tokens_out_per_s(None) is None  # no generative model


def test_slo_kinds_and_burn_rates_in_words() -> None:
    assert sli_text({"sli_kind": "ttft", "threshold_ms": 500.0}) == "ttft ≤ 500 ms"
    assert sli_text({"sli_kind": "latency", "threshold_ms": 50}) == "latency ≤ 50 ms"
    assert sli_text({"sli_kind": "availability", "threshold_ms": None}) == "availability"
    alerts = [
        {"long": "1h", "short": "5m", "threshold": 14.4, "long_burn_rate": 20.0, "short_burn_rate": 1.0},
        {"long": "6h", "short": "30m", "threshold": 6.0, "long_burn_rate": 7.5, "short_burn_rate": 9.0},
    ]
    assert burn_text(alerts) == "7.5x / 9x over 6h/30m (fires at 6x)"  # both windows over: the pair that fires
    assert burn_text([]) == fmt.DASH


def test_overflow_in_words_for_each_mode_and_in_a_policy() -> None:
    deadline = "overflow to the cloud: requests predicted to miss their deadline"
    assert action_text({"kind": "overflow", "mode": "deadline"}) == deadline
    assert action_text({"kind": "overflow", "mode": "fraction", "fraction": 0.05}) == f"{deadline} and 5 % of the rest"
    by_priority = {"kind": "overflow", "mode": "priority", "priority_at_or_below": 3}
    assert action_text(by_priority) == f"{deadline} and all of priority 3 and lower"
    assert overflow_text(None) is None
    assert overflow_text({"fraction": 0.0, "at_or_below": None}) == "deadline misses overflow"
    assert overflow_text({"fraction": 0.125, "at_or_below": 2}) == (
        "deadline misses, 12.5 % of the rest and priority ≥ 2 overflow"
    )
    policy = {"models": {"mlp": {"overflow": {"fraction": 0.5, "at_or_below": None}}},
              "causes": [{"name": "spill", "action": "overflow"}]}  # fmt: skip
    rules = [{"name": "spill", "action": {"kind": "overflow", "mode": "fraction", "fraction": 0.5}, "selector": {}}]
    rung = {r["rung"]: r for r in ladder(policy, rules, {"labels": {}})}["overflow to the cloud"]
    assert rung == {"step": 4, "rung": "overflow to the cloud", "in force": "yes",
                    "now": "mlp: deadline misses and 50 % of the rest overflow", "by rules": "spill",
                    "rules that can take it": "spill"}  # fmt: skip


def test_an_overflow_action_sends_only_its_modes_parameter_and_names_a_missing_one() -> None:
    drawn = {"kind": "overflow", "mode": "fraction", "fraction": 0.25, "priority_at_or_below": 2}
    assert finish_action(dict(drawn)) == {"kind": "overflow", "mode": "fraction", "fraction": 0.25}
    assert finish_action({**drawn, "mode": "deadline"}) == {"kind": "overflow", "mode": "deadline"}
    assert finish_action({**drawn, "mode": "priority"}) == {"kind": "overflow", "mode": "priority",
                                                            "priority_at_or_below": 2}  # fmt: skip
    with pytest.raises(LocalFieldErrors) as missing:
        finish_action({**drawn, "fraction": None})
    assert list(missing.value.fields) == ["action.fraction"]
    with pytest.raises(LocalFieldErrors) as missing:
        finish_action({**drawn, "mode": "priority", "priority_at_or_below": None})
    assert list(missing.value.fields) == ["action.priority_at_or_below"]


def test_every_outcome_an_agent_reports_has_a_colour_and_a_legend_label() -> None:
    outcomes = GOOD_OUTCOMES | {"rejected", "error"}  # the SLO maths' good ones, and the two bad ones
    assert outcomes == set(OUTCOME_COLOURS) == set(OUTCOME_LABELS)
    assert len(set(OUTCOME_COLOURS.values())) == len(OUTCOME_COLOURS)  # no two outcomes look alike
    ordered = list(OUTCOME_COLOURS)
    rows = [{"group": "mlp p1", "outcome": o, "requests": 1} for o in (*reversed(ordered), "later_kind")]
    scale = outcome_bars(rows).to_dict()["encoding"]["color"]["scale"]
    assert scale["domain"] == [OUTCOME_LABELS[o] for o in ordered] + ["later_kind"]  # unknown: its own name, last
    assert scale["range"] == [OUTCOME_COLOURS[o] for o in ordered] + ["#757575"]


NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)
GATEWAY_BACKEND = {
    "id": "b1", "name": "cloud-eu", "url": "http://eu:8000", "models": ["mlp", "resnet"], "healthy": False,
    "unhealthy_models": ["resnet"], "ejected": True, "ejected_until": "2026-11-30T12:00:25Z", "times_ejected": 2,
    "outstanding": 3, "max_concurrency": 64, "requests": 200, "errors": 9, "p50_ms": 12.5, "p99_ms": 80.0,
    "last_error": "503 from backend",
}  # fmt: skip


def test_gateway_state_per_backend_from_a_status_section() -> None:
    """The rendering of the status's `gateway` section, on a section shaped as the control plane's
    (controlplane/api/status.py GatewayState); the Backends page test shows the same from a live gateway."""
    section = {"active_requests": 4, "active_retries": 1, "retry_limit": 3.0,
               "loaded_at": "2026-11-30T11:59:58Z", "backends": [GATEWAY_BACKEND]}  # fmt: skip
    view = gateway_view({"gateway": section})
    assert view is not None
    configured = [{"id": "b1", "name": "cloud-eu"}, {"id": "b2", "name": "cloud-new", "protocol": "openai"}]
    rows = {r["backend"]: r for r in gateway_rows(view, configured, NOW)}
    assert rows["cloud-eu"] == {
        "backend": "cloud-eu", "protocol": "v2",
        "state": "ejected until 2026-11-30 12:00:25 (25 s left); unhealthy (resnet)",
        "in flight / cap": "3 / 64", "requests": 200, "errors": 9, "error rate": "4.5%", "p50 ms": 12.5,
        "p99 ms": 80.0, "ejection multiplier": 2, "last error": "503 from backend",
    }  # fmt: skip
    # Added since the gateway's last load: an openai backend (its readiness: GET /v1/models) not checked yet.
    assert rows["cloud-new"] == {"backend": "cloud-new", "protocol": "openai", "state": NOT_LOADED}
    assert gateway_summary(view).startswith(
        "Gateway: 4 requests in flight, 1 retries in flight of 3 allowed, backends loaded 2026-11-30 11:59:58 UTC."
    )
    deleted = gateway_rows(view, [], NOW)  # deleted since: still shown while the gateway holds it
    assert [r["backend"] for r in deleted] == ["cloud-eu"]


def test_gateway_state_as_a_bare_list_or_missing() -> None:
    view = gateway_view({"gateway": [GATEWAY_BACKEND]})
    assert view == GatewayView([GATEWAY_BACKEND], {})
    assert gateway_summary(view).startswith("As seen by the control-plane replica")
    assert gateway_view({"agents": {}}) is None  # a control plane from before the gateway: the page says so
    fine = {**GATEWAY_BACKEND, "healthy": True, "ejected": False, "ejected_until": None}
    assert backend_state(fine, NOW) == "healthy"
    assert backend_state({"ejected": True}, NOW) == "ejected"
    row = gateway_rows(GatewayView([{"id": "x", "name": "bare", "requests": 0}]), [], NOW)[0]
    shown = (row["state"], row["error rate"], row["in flight / cap"], row["last error"])
    assert shown == ("healthy", fmt.DASH, f"{fmt.DASH} / {fmt.DASH}", fmt.DASH)


def test_agent_state_and_slowest_p99() -> None:
    assert agent_state({"status": "healthy"}, {"causes": [{"name": "r"}]}) == "degraded"
    assert agent_state({"status": "healthy"}, {"causes": []}) == "healthy"
    assert agent_state({"status": "stale"}, {"causes": [{"name": "r"}]}) == "stale"
    traffic = [{"latency_ms": {"p99": 12.0}}, {"latency_ms": {"p99": None}}, {"latency_ms": {"p99": 80.5}}]
    assert worst_p99({"traffic": traffic}) == 80.5
    assert worst_p99({"traffic": []}) is None


def test_event_numbers_give_the_numbers_behind_each_event() -> None:
    fired = {"kind": "rule.fired", "data": {"state": "firing", "observed": {"value": 84.0, "threshold": 32.0}}}
    assert event_numbers(fired) == "state firing, threshold=32, value=84"
    changed = {"kind": "slo.updated", "data": {"name": "s", "changes": {"objective": {"from": 99.5, "to": 99.9}}}}
    assert event_numbers(changed) == "objective: 99.5 -> 99.9"
    published = {"kind": "policy.published", "data": {"version": 3, "causes": [{"name": "r", "action": "shed"}]}}
    assert event_numbers(published) == "version 3, causes: r (shed)"
    data = {"backend": "cloud-eu", "models": ["mlp", "resnet"], "failures": 2, "error": None}
    unhealthy = {"kind": "backend.unhealthy", "subject_id": "b1", "data": data}
    assert event_numbers(unhealthy) == "failures=2, models=mlp,resnet"
    assert event_subject(unhealthy) == "cloud-eu"
    assert event_subject({"kind": "backend.created", "data": {"name": "cloud-us"}}) == "cloud-us"


def test_a_fallbacks_default_text_and_a_backends_model_map_from_the_form() -> None:
    drawn = {"kind": "fallback", "mode": "default", "priority_at_or_below": 3, "default_outputs": ""}
    assert finish_action({**drawn, "default_text": "Busy, try later."})["default_text"] == "Busy, try later."
    assert finish_action({**drawn, "default_text": "  "})["default_text"] is None  # empty: not sent as text
    assert parse_model_map("tiny-lm=Qwen2.5-7B-Instruct, coder = qwen-coder") == {
        "tiny-lm": "Qwen2.5-7B-Instruct", "coder": "qwen-coder"}  # fmt: skip
    assert parse_model_map(" ") == {}
    assert model_map_text({"tiny-lm": "Qwen2.5-7B-Instruct"}) == "tiny-lm=Qwen2.5-7B-Instruct"
    for bad, words in (("tiny-lm", "is not edge_name=cloud_name"), ("a=b, a=c", "'a' is mapped twice")):
        with pytest.raises(LocalFieldErrors) as refused:
            parse_model_map(bad)
        assert list(refused.value.fields) == ["model_map"] and words in refused.value.fields["model_map"]


def test_form_parsing_reports_mistakes_per_field() -> None:
    assert parse_alert_windows("") is None
    assert parse_alert_windows("1h/5m@14.4:page, 6h/30m@6") == [
        {"long": "1h", "short": "5m", "burn_rate": 14.4, "severity": "page"},
        {"long": "6h", "short": "30m", "burn_rate": 6.0},
    ]
    with pytest.raises(LocalFieldErrors) as bad:
        parse_alert_windows("1h 5m")
    assert list(bad.value.fields) == ["alert_windows"]
    assert parse_sizes("4, 8") == [4, 8]
    with pytest.raises(LocalFieldErrors, match="whole numbers"):
        parse_sizes("4,eight")


def test_the_dashboard_process_gets_the_key_in_its_environment_never_its_command_line() -> None:
    command = streamlit_command(8599)
    assert "spk_secret" not in " ".join(command)
    assert command[command.index("--browser.gatherUsageStats") + 1] == "false"
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    env = dashboard_env("http://cp:8400/", "spk_secret", base={})
    assert env["SPILLWAY_API_URL"] == "http://cp:8400" and env["SPILLWAY_API_KEY"] == "spk_secret"


def test_start_dashboard_serves_in_the_background_and_logs_to_the_file(tmp_path: Path) -> None:
    """What the demo calls: the process answers its health check, logs where told, and stops when terminated."""
    log = tmp_path / "dashboard.log"
    port = free_port()
    proc = start_dashboard(f"http://127.0.0.1:{free_port()}", "spk_unused", port=port, log_path=log)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout_s=60)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) is not None
    assert f"127.0.0.1:{port}" in log.read_text()


def test_spillway_dashboard_refuses_to_start_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPILLWAY_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["dashboard", "--api", "http://127.0.0.1:8400"])
    assert result.exit_code == 2
    assert "SPILLWAY_API_KEY" in result.output


def test_numbers_percentages_and_shares_read_as_people_write_them() -> None:
    assert [fmt.number(v) for v in (78.1879, 136.96, 945.0, 945, 12345.6, 2.756, 1.5, 0.0123, 0.87, 0.0, -3.25)] == [
        "78.2", "137", "945", "945", "12,346", "2.76", "1.5", "0.012", "0.87", "0", "-3.25"]  # fmt: skip
    assert fmt.number(None) == fmt.number(float("nan")) == fmt.DASH == "\u2013"  # an en dash, never None or NaN
    assert fmt.number("text") == "text" and fmt.number(True) == "True"
    assert [fmt.number(v) for v in (-0.0, 0.99999, -0.99999)] == ["0", "1", "-1"]  # no "-0", no "1.00"
    assert fmt.percent(-0.0001) == "0 %"
    assert [fmt.percent(v) for v in (99.5, 99.0, 99.95, 99.9996, 100.0, None)] == [
        "99.5 %", "99 %", "99.95 %", "99.9996 %", "100 %", fmt.DASH]  # fmt: skip
    assert [fmt.ratio_percent(v, 1) for v in (-5.897, 0.4, 0.99512)] == ["-589.7 %", "40 %", "99.5 %"]
    assert fmt.ratio_percent(0.99512) == "99.51 %"
    assert [fmt.share(v) for v in (0.953, 0.001, 0.0, None)] == ["95%", "<1%", "0%", fmt.DASH]
    assert [fmt.duration(s) for s in (45, 720, 5400, 2 * 86400)] == ["45 s", "12 min", "1.5 h", "2 d"]
    assert (fmt.seconds("28d"), fmt.seconds("1h30m"), fmt.seconds("soon")) == (28 * 86400, 5400, 0)


def test_a_table_keeps_its_numbers_and_shows_them_formatted() -> None:
    styled = fmt.table([{"p99 ms": 78.1879, "requests": 945.0, "TTFT p99 ms": None, "model": "mlp"}])
    assert styled.data.loc[0, "p99 ms"] == 78.1879  # sorts as a number
    shown = styled.to_html()
    assert "78.2" in shown and ">945<" in shown and fmt.DASH in shown and "None" not in shown and "nan" not in shown


def test_event_kinds_in_words_old_and_new_dry_run_names_alike() -> None:
    assert fmt.event_kind("rule.fired") == "rule fired"
    assert fmt.event_kind("rule.refired") == "rule fired again"
    assert fmt.event_kind("rule.would_fire") == fmt.event_kind("rule.would_fired") == "rule would fire (dry run)"
    assert fmt.event_kind("rule.would_recover") == fmt.event_kind("rule.would_recovered") == (
        "rule would recover (dry run)")  # fmt: skip
    assert fmt.event_kind("rule.would_step_down") == "rule would step down (dry run)"
    assert fmt.event_kind("policy.published") == "policy published"
    assert fmt.event_kind("api_key.created") == "api key created"


def test_an_slo_younger_than_its_window_says_how_much_its_figures_cover() -> None:
    young = {"window": "28d", "observed": "12m", "observed_since": "2026-12-03T00:48:00Z"}
    assert coverage_note(young) == "figures cover only 12 min of the 28d window"
    assert coverage_text(young) == "12 min of 28d"
    assert coverage_note({**young, "observed": 720}) == "figures cover only 12 min of the 28d window"  # seconds too
    whole = {"window": "1h", "observed": "1h", "observed_since": "2026-12-02T23:00:00Z"}
    assert coverage_note(whole) is None and coverage_text(whole) == "whole window"
    none = {"window": "28d", "observed": None, "observed_since": None}
    assert coverage_note(none) is None and coverage_text(none) == fmt.DASH
    assert coverage_note({"window": "28d"}) is None  # a control plane from before `observed`


def step(minute: int, **fields: Any) -> dict[str, Any]:
    """A point of a recorded history answer (the design's shape), `minute` minutes past 12:00."""
    return {"ts": f"2026-12-03T12:{minute:02d}:00Z", "requests": 0.0, "rps": 0.0, "outcomes": {}, "p50_ms": None,
            "p95_ms": None, "p99_ms": None, "groups": [], "generation": [], "device": [], **fields}  # fmt: skip


GROUP = {"model": "mlp", "priority": 1, "requests": 60.0, "rps": 1.0, "p50_ms": 3.0, "p95_ms": 6.0, "p99_ms": 9.0,
         "queue_depth": 3.0}  # fmt: skip
GEN = {"model": "tiny-lm", "streams": 12.0, "ttft_p50_ms": 40.0, "ttft_p99_ms": 90.0, "tpot_p50_ms": 8.0,
       "tpot_p99_ms": 15.0, "tokens_out_per_s": 30.0}  # fmt: skip
MEMORY = {"metric": "hw.gpu.memory.usage", "attributes": {"hw.id": "0"}, "last": 2.0 * 2**30, "max": 3.0 * 2**30}
HOT = {"metric": "hw.temperature", "attributes": {"hw.id": "0"}, "last": 71.5, "max": 72.0}
AGENT_HISTORY = [
    step(0, requests=60.0, rps=1.0, p99_ms=9.0, groups=[GROUP], generation=[GEN], device=[MEMORY, HOT]),
    step(1, requests=60.0, rps=1.0, p99_ms=9.5, groups=[{**GROUP, "p99_ms": 9.5}], generation=[GEN], device=[MEMORY]),
    step(2),  # nothing reported: a gap, not zeros
    step(3, requests=30.0, rps=0.5, p99_ms=12.0, groups=[{**GROUP, "p99_ms": 12.0, "queue_depth": None}],
         device=[MEMORY, HOT]),
]  # fmt: skip


def test_an_agents_history_becomes_one_line_per_series_with_gaps_not_zeros() -> None:
    latency = history.latency(AGENT_HISTORY)
    p99 = latency[latency["series"] == "mlp p1 p99"]
    assert list(p99["value"]) == [9.0, 9.5, 12.0] and list(p99["segment"]) == [1, 1, 2]  # minute 2 breaks the line
    assert str(p99["time"].iloc[0]) == "2026-12-03 12:00:00+00:00"
    assert set(latency["series"]) == {"mlp p1 p50", "mlp p1 p95", "mlp p1 p99"}
    queue = history.queue_depth(AGENT_HISTORY)
    assert list(queue["value"]) == [3.0, 3.0] and set(queue["series"]) == {"mlp p1"}  # a null reading: no point
    memory = history.gpu_memory(AGENT_HISTORY)
    assert list(memory["value"]) == [2.0, 2.0, 2.0] and memory["series"].iloc[0] == "hw.gpu.memory.usage hw.id=0"
    assert list(history.temperature(AGENT_HISTORY)["segment"]) == [1, 2]  # minutes 0 and 3: two runs
    ttft = history.generation_latency(AGENT_HISTORY)
    assert set(ttft["series"]) == {"tiny-lm TTFT p99", "tiny-lm TPOT p99"} and len(ttft) == 4
    assert list(history.tokens_out(AGENT_HISTORY)["value"]) == [30.0, 30.0]
    fleet = history.fleet(AGENT_HISTORY)
    assert list(fleet[fleet["series"] == "requests/s"]["value"]) == [1.0, 1.0, 0.0, 0.5]  # no requests: 0 per second
    assert list(fleet[fleet["series"] == "p99 ms"]["segment"]) == [1, 1, 2]
    assert history.latency([]).empty and list(history.latency([]).columns) == ["time", "series", "value", "segment"]


SLO_HISTORY: dict[str, Any] = {
    "slo": "s1", "name": "mlp-latency", "window": "1h", "step": "5m", "slo_window": "28d", "objective": 99.5,
    "points": [
        {"ts": "2026-12-03T12:05:00Z", "good": None, "total": None, "sli": None, "window_sli": None,
         "budget_remaining": None, "alerts": [{"long": "1h", "short": "5m", "threshold": 14.4, "severity": "page",
                                               "long_burn_rate": None, "short_burn_rate": None, "firing": False}]},
        {"ts": "2026-12-03T12:10:00Z", "good": 10.0, "total": 12.0, "sli": 0.8333, "window_sli": 0.99,
         "budget_remaining": 0.4, "alerts": [{"long": "1h", "short": "5m", "threshold": 14.4, "severity": "page",
                                              "long_burn_rate": 2.0, "short_burn_rate": 3.1, "firing": False}]},
        {"ts": "2026-12-03T12:15:00Z", "good": 0.0, "total": 0.0, "sli": None, "window_sli": 0.98,
         "budget_remaining": -0.5, "alerts": [{"long": "1h", "short": "5m", "threshold": 14.4, "severity": "page",
                                               "long_burn_rate": 2.5, "short_burn_rate": None, "firing": False}]},
    ],
}  # fmt: skip


def test_an_slos_history_gives_burn_rates_with_thresholds_and_budget_over_time() -> None:
    points = SLO_HISTORY["points"]
    burns = history.burn_rates(points)
    assert list(burns[burns["series"] == "1h/5m long"]["value"]) == [2.0, 2.5]
    assert list(burns[burns["series"] == "1h/5m short"]["value"]) == [3.1]
    assert history.thresholds(points) == {"1h/5m": 14.4}
    budget = history.budget(points)
    assert list(budget[budget["series"] == "budget left"]["value"]) == [0.4, -0.5]
    assert list(budget[budget["series"] == "SLI"]["value"]) == [0.99, 0.98]
    chart = burn_rate_history(burns, history.thresholds(points)).to_dict()
    assert chart["layer"][0]["encoding"]["detail"]["field"] == "segment"  # a gap breaks each line
    assert chart["usermeta"]["embedOptions"]["renderer"] == "svg"  # each point a mark in the page
    datasets = budget_history(budget, 99.5).to_dict()["datasets"].values()
    assert [{"y": 0.995, "what": "objective"}] in datasets  # the objective's line, as a ratio like the SLI


def test_the_step_keeps_a_chart_within_360_points() -> None:
    assert [history.step_for(w) for w in ("5m", "1h", "6h", "1d", "7d")] == ["1m", "1m", "1m", "5m", "1h"]
    assert all(fmt.seconds(w) / fmt.seconds(history.step_for(w)) <= 360 for w in ("5m", "6h", "1d", "7d"))
    # an SLO's history beyond 6 h is counted from hours: the API refuses a finer step
    assert [history.slo_step_for(w) for w in ("1h", "6h", "1d", "7d")] == ["1m", "1m", "1h", "1h"]
