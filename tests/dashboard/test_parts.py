"""The dashboard's plain parts: API errors to field messages, sentences for rules and events, the degradation
ladder, form parsing, sampled history, and how `spillway dashboard` starts Streamlit."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from controlplane.cli import app
from dashboards.api import ApiError, ApiUnreachable, SpillwayApi, field_errors, gather
from dashboards.describe import agent_state, event_numbers, ladder, rule_now, worst_p99
from dashboards.forms import parse_alert_windows, parse_sizes
from dashboards.history import SampleLog
from dashboards.launch import dashboard_env, start_dashboard, streamlit_command, wait_ready
from dashboards.session import LocalFieldErrors, field_matches
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


def test_role_is_probed_without_changing_anything() -> None:
    def handler_for(role: str) -> Any:
        def handler(request: httpx.Request) -> httpx.Response:
            assert request.method in ("GET", "POST")
            if request.url.path == "/api/v1/keys":
                return httpx.Response(200 if role == "admin" else 403, json={"error": "forbidden", "message": "no"})
            assert request.content == b"{}"  # an empty body: refused either way, never created
            return httpx.Response(403 if role == "viewer" else 422, json={"error": "e", "message": "m"})

        return handler

    for role in ("viewer", "editor", "admin"):
        assert SpillwayApi("http://cp.test", "k", transport=httpx.MockTransport(handler_for(role))).role() == role


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
    rules = [
        {"name": "lite", "action": {"kind": "switch_variant"}, "selector": {"labels": {"site": "b"}}},
        {"name": "other-site", "action": {"kind": "fallback"}, "selector": {"labels": {"site": "x"}}},
        {"name": "dry", "action": {"kind": "fallback"}, "selector": {}, "dry_run": True},
        {"name": "batch", "action": {"kind": "tune_batching"}, "selector": {"labels": {}}, "enabled": True},
    ]
    rows = {r["rung"]: r for r in ladder(policy, rules, {"labels": {"site": "b"}})}
    assert [r["step"] for r in rows.values()] == [1, 2, 3, 4]
    assert rows["lighter variant"] == {"step": 2, "rung": "lighter variant", "in force": "yes",
                                            "now": "mlp: variant 2", "by rules": "lite",
                                            "rules that can take it": "lite"}  # fmt: skip
    assert rows["shed low priorities"]["now"] == "mlp: priority ≥ 3 refused"
    assert rows["serve fallbacks"]["rules that can take it"] == "-"  # another site's, and a dry run's
    assert rows["tune batching"]["in force"] == "no" and rows["tune batching"]["rules that can take it"] == "batch"


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


def test_sample_log_keeps_a_bounded_history_in_long_form() -> None:
    log = SampleLog(maxlen=2)
    for minute in range(3):
        log.add({"p99": float(minute), "gone": None}, at=datetime(2026, 11, 30, 12, minute, tzinfo=timezone.utc))
    frame = log.long()
    assert len(log) == 2
    assert list(frame["value"]) == [1.0, 2.0] and set(frame["series"]) == {"p99"}


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
