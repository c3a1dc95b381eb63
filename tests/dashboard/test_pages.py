"""Each page under Streamlit's AppTest against a real, seeded control plane: what it shows, and edits round-tripping
through the REST API (with the API's validation messages under their fields, and editing disabled for viewers)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pandas as pd
from streamlit.dataframe_util import convert_arrow_bytes_to_pandas_df
from streamlit.testing.v1 import AppTest

from dashboards.fmt import DASH
from tests.dashboard.conftest import OpenPage
from tests.dashboard.seeding import SeededPlane, wait_for
from tests.utils.builders import make_backend
from tests.utils.gateway import MLP_REQUEST, start_faulty
from tests.utils.server import free_port


def flat(node: Any) -> list[Any]:
    """Every element of a page, in the order it is drawn."""
    out = [node]
    for child in getattr(node, "children", {}).values():
        out += flat(child)
    return out


def right_after(at: AppTest, key: str) -> Any:
    """The element drawn right after the widget with this key (where a field's error message goes)."""
    nodes = flat(at.main)
    index = next(i for i, node in enumerate(nodes) if getattr(node, "key", None) == key)
    return nodes[index + 1]


def table(at: AppTest, having: str) -> pd.DataFrame:
    """The first dataframe with a column named `having`."""
    return next(df.value for df in at.dataframe if having in df.value.columns)


def shown(at: AppTest, having: str) -> pd.DataFrame:
    """The first dataframe with a column named `having`, as the page shows it (each cell's text, `fmt.table`'s)."""
    element = next(df for df in at.dataframe if having in df.value.columns)
    return convert_arrow_bytes_to_pandas_df(element.proto.arrow_data.styler.display_values)


def chart_points(at: AppTest, title: str) -> pd.DataFrame:
    """The points (time, series, value) of the line chart titled `title`: the data the page handed to Vega."""
    for element in at.get("vega_lite_chart"):
        spec = json.loads(element.proto.spec)
        titles = [spec.get("title"), *(layer.get("title") for layer in spec.get("layer", []))]
        if any(t == title or (isinstance(t, dict) and t.get("text") == title) for t in titles):
            frames = [convert_arrow_bytes_to_pandas_df(d.data.data) for d in element.proto.datasets]
            return next(f for f in frames if {"time", "value"} <= set(f.columns))
    raise AssertionError(f"no chart titled {title!r}")


def button(at: AppTest, label: str) -> Any:
    return next(b for b in at.button if b.label == label)


def no_errors(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_fleet_shows_every_agent_with_its_state_traffic_and_degradations(open_page: OpenPage) -> None:
    at = open_page("fleet")
    no_errors(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Agents healthy"] == "3 / 3"
    assert metrics["SLOs firing"] == "3 / 3"  # the seeded traffic overspends every SLO's budget
    agents = table(at, "agent").set_index("agent")
    assert agents.loc["jetson-berlin-01", "status"] == "degraded"  # healthy, with a rule in force
    assert agents.loc["desktop-gpu-lab", "status"] == "healthy"
    assert "shed-on-deep-queue -> shed" in agents.loc["jetson-berlin-01", "degradations"]
    assert agents.loc["jetson-berlin-01", "p99 ms (slowest group)"] == 185  # priority 3's p99, from the buckets
    assert agents.loc["jetson-berlin-01", "outcomes"] == "local 95%, rejected 5%"
    assert agents.loc["jetson-berlin-01", "policy v"] >= 1  # 2 when a cycle published an empty one before the rule
    # The generative agent: its TTFT p99 (rank 386.1 of 390: 61 % into the 0.75-1 s bucket) and 24960 tokens in
    # the window (5 minutes and the current one's seconds so far).
    assert round(agents.loc["orin-chat-01", "TTFT p99 ms"], 1) == 902.5
    assert 24960 / 360 < agents.loc["orin-chat-01", "tokens out/s"] <= 24960 / 300
    assert pd.isna(agents.loc["jetson-berlin-01", "TTFT p99 ms"])  # it serves no generative model
    slos = table(at, "SLO").set_index("SLO")
    assert set(slos.index) == {"mlp-latency", "mlp-availability", "tiny-lm-ttft"}
    assert slos.loc["tiny-lm-ttft", "SLI kind"] == "ttft ≤ 500 ms"  # the generative SLO beside the others
    assert slos.loc["mlp-latency", "SLI kind"] == "latency ≤ 50 ms"
    # 10 of 390 first tokens over 500 ms against a 1 % budget: 2.56x, which fires the slowest pair only.
    assert slos.loc["tiny-lm-ttft", "burn rate (closest pair)"] == "2.56x / 2.56x over 4032m/336m (fires at 1x)"
    assert slos.loc["tiny-lm-ttft", "firing"] != DASH
    assert any(c.value.startswith("Last updated ") for c in at.caption)
    assert any(c.value.startswith("Signed in as **") and c.value.endswith("(editor)") for c in at.sidebar.caption)
    people = shown(at, "agent").set_index("agent")  # numbers for people: no None, no NaN, no 4 decimals
    assert (
        people.loc["jetson-berlin-01", "TTFT p99 ms"] == DASH and people.loc["orin-chat-01", "TTFT p99 ms"] == "902.5"
    )
    assert people.loc["jetson-berlin-01", "p99 ms (slowest group)"] == "185"
    # The fleet's requests/s over the window from the history API: the current minute's, and the quiet minutes
    # before it (0 requests/s), already on the first load.
    rps = chart_points(at, "Fleet requests/s, last 5m")
    assert len(rps) > 1 and rps["value"].max() > 0  # (the seeded minute may be the last or the one before)

    at.multiselect(key="fleet_labels").select("site=lab").run()
    assert list(table(at, "agent")["agent"]) == ["desktop-gpu-lab"]


def test_device_page_shows_percentiles_queues_gauges_policy_and_ladder(open_page: OpenPage, fleet: SeededPlane) -> None:
    at = open_page("device", agent=fleet.agents["jetson-berlin-01"])
    no_errors(at)
    metrics = {m.label: m.value for m in at.metric}
    assert any("jetson-berlin-01** is :orange[**degraded**]" in m.value for m in at.markdown)
    assert metrics["Requests (5m)"] == "945"
    assert metrics["p99 ms (slowest group)"] == "185"
    traffic = table(at, "p99 ms").set_index("priority")
    assert traffic.loc[1, "requests"] == 600 and traffic.loc[3, "requests"] == 345
    assert traffic.loc[3, "queue depth (last/max)"] == "80 / 80"
    assert traffic.loc[3, "p99 ms"] == 185
    assert round(traffic.loc[1, "queue ms"], 2) == round(0.4 * traffic.loc[1, "compute ms"] / 0.5, 2)
    gauges = table(at, "gauge").set_index("gauge")
    assert gauges.loc["hw.gpu.memory.usage", "last"] == "5.25 GiB"
    assert gauges.loc["hw.temperature", "last"] == "71.5"
    ladder = table(at, "rung").set_index("rung")
    assert ladder.loc["shed low priorities", "in force"] == "yes"
    assert ladder.loc["shed low priorities", "by rules"] == "shed-on-deep-queue"
    assert "priority ≥ 3 refused" in ladder.loc["shed low priorities", "now"]
    events = table(at, "numbers")
    assert "rule fired" in set(events["kind"])  # kinds in words
    traffic_shown = shown(at, "p99 ms").set_index("priority")
    assert traffic_shown.loc["3", "p99 ms"] == "185" and "." in traffic_shown.loc["3", "p50 ms"]
    assert len(traffic_shown.loc["3", "p50 ms"].split(".")[1]) == 1  # 30.7143 reads 30.7
    # Charts from the history API, on the first load: the seeded gauges of the last five minutes and this one.
    memory = chart_points(at, "GPU memory (GiB)")
    used = memory[memory["series"].str.startswith("hw.gpu.memory.usage")]
    assert len(used) > 1 and set(used["value"]) == {5.25}
    assert len(chart_points(at, "Queue depth over time")) > 1
    assert len(chart_points(at, "Temperature (°C)")) > 1
    assert not any("sampled" in c.value for c in at.caption)


def test_device_page_shows_a_generative_models_streams_and_limits(open_page: OpenPage, fleet: SeededPlane) -> None:
    at = open_page("device", agent=fleet.agents["orin-chat-01"])
    no_errors(at)
    metrics = {m.label: m.value for m in at.metric}
    assert 24960 / 360 < float(metrics["Tokens out/s (5m)"]) <= 24960 / 300  # 390 streams x 64 tokens in 5-6 min
    assert (metrics["Active streams"], metrics["KV-cache use (fullest)"]) == ("6", "75%")
    assert abs(float(metrics["TTFT p99 ms (slowest model)"]) - 902.5) <= 1  # shown to 3 significant digits
    row = table(at, "TTFT p99 ms").set_index("model").loc["tiny-lm"]
    assert row["streams"] == 400 and round(row["tokens out/s"] / row["tokens in/s"], 9) == 64 / 40
    assert round(row["TTFT p99 ms"], 1) == 902.5 and row["TTFT p50 ms"] < row["TTFT p90 ms"] < row["TTFT p99 ms"]
    assert row["TPOT p50 ms"] < row["TPOT p99 ms"] <= 100  # every token within the 100 ms bucket
    assert row["KV-cache use"] == "75% (96 / 128 blocks)"
    assert (row["preemptions"], row["active streams"]) == (12, 6) and 12 / 6 < row["preemptions/min"] <= 12 / 5
    assert row["outcomes"] == "local 88%, overflow 10%, rejected 2%"
    settings = table(at, "max_tokens cap").set_index("model").loc["tiny-lm"]
    assert (settings["max_tokens cap"], settings["max_num_seqs"]) == ("128", "as configured")  # the KV rule's cap
    assert table(at, "overflow").set_index("model").loc["tiny-lm", "generation"] == "max_tokens ≤ 128"
    rung = table(at, "rung").set_index("rung").loc["cap max_tokens"]
    assert (rung["in force"], rung["by rules"]) == ("yes", "cap-tokens-on-full-kv")
    assert len(chart_points(at, "TTFT and TPOT p99 over time")) >= 1  # the current minute's streams
    assert len(chart_points(at, "GPU memory (GiB)")) > 1


def test_slos_sorted_worst_first_with_burn_rates_against_thresholds(open_page: OpenPage) -> None:
    at = open_page("slos")
    no_errors(at)
    slos = table(at, "budget left")
    budgets = [float(b.rstrip(" %")) for b in slos["budget left"]]
    assert budgets == sorted(budgets) and budgets[0] < 0  # least budget left first
    # Traffic 30 minutes ago is the oldest: the figures cover half an hour of the 28-day window, and say so.
    assert all(c.endswith(" of 28d") for c in slos["covers"])
    assert any("figures cover only" in w.value and "of the 28d window" in w.value for w in at.warning)
    # The burn rates and the budget over the last 6 hours from the SLO's history, on the first load.
    burns = chart_points(at, "Burn rate over time (dashed: each pair's threshold)")
    assert len(burns[burns["series"] == "4032m/336m long"]) > 1
    assert len(chart_points(at, "Budget left and SLI over time")) > 1
    alerts = table(at, "alert pair").set_index("alert pair")
    assert set(alerts.index) == {"56m/5m", "336m/28m", "4032m/336m"}
    assert alerts.loc["56m/5m", "threshold"] == 14.4
    assert alerts.loc["4032m/336m", "firing"] == "FIRING"
    per_agent = table(at, "agent")
    assert per_agent["agent"].iloc[0] == "jetson-berlin-01"  # the one burning


def test_slo_form_shows_the_api_validation_message_under_the_field(open_page: OpenPage, fleet: SeededPlane) -> None:
    at = open_page("slos")
    at.text_input(key="slo-create-0:name").set_value("too-ambitious")
    at.number_input(key="slo-create-0:objective").set_value(100.0)
    button(at, "Create SLO").click().run()
    assert not at.exception
    below = right_after(at, "slo-create-0:objective")
    assert below.value == "Input should be less than 100"  # the API's words, right under the field
    assert "too-ambitious" not in {s["name"] for s in fleet.get("/slos")["items"]}

    at.number_input(key="slo-create-0:objective").set_value(99.0)
    at.number_input(key="slo-create-0:threshold_ms").set_value(51.0)
    button(at, "Create SLO").click().run()
    assert "not a latency bucket boundary" in right_after(at, "slo-create-0:threshold_ms").value

    at.number_input(key="slo-create-0:threshold_ms").set_value(100.0)
    at.text_input(key="slo-create-0:selector.labels").set_value("site=lab")
    button(at, "Create SLO").click().run()
    no_errors(at)
    assert [s.value for s in at.success] == ["SLO created."]
    created = {s["name"]: s for s in fleet.get("/slos")["items"]}["too-ambitious"]
    assert (created["objective"], created["threshold_ms"]) == (99.0, 100.0)
    assert created["selector"]["labels"] == {"site": "lab"}
    assert at.text_input(key="slo-create-1:name").value == ""  # the create form starts afresh


def test_slo_form_creates_a_generative_slo_on_a_genai_bucket(open_page: OpenPage, fleet: SeededPlane) -> None:
    at = open_page("slos")
    at.text_input(key="slo-create-0:name").set_value("tiny-lm-tpot")
    at.selectbox(key="slo-create-0:sli_kind").select("tpot")
    at.number_input(key="slo-create-0:threshold_ms").set_value(30.0)
    at.text_input(key="slo-create-0:selector.model").set_value("tiny-lm")
    button(at, "Create SLO").click().run()
    assert "30 is not a tpot bucket boundary" in right_after(at, "slo-create-0:threshold_ms").value
    at.number_input(key="slo-create-0:threshold_ms").set_value(50.0)
    button(at, "Create SLO").click().run()
    no_errors(at)
    created = {s["name"]: s for s in fleet.get("/slos")["items"]}["tiny-lm-tpot"]
    assert (created["sli_kind"], created["threshold_ms"], created["selector"]["model"]) == ("tpot", 50.0, "tiny-lm")
    with fleet.client("editor") as editor:  # the other tests expect the seeded SLOs
        editor.delete(f"/api/v1/slos/{created['id']}").raise_for_status()


def test_slo_edit_round_trips_and_a_stale_edit_is_refused(open_page: OpenPage, fleet: SeededPlane) -> None:
    at = open_page("slos")
    at.selectbox(key="slo_edit_pick").select("mlp-latency").run()
    ident = fleet.slos["mlp-latency"]
    version = fleet.get(f"/slos/{ident}")["version"]
    form = f"slo-edit-{ident}-{version}"
    at.number_input(key=f"{form}:objective").set_value(98.5)
    at.text_input(key=f"{form}:alert_windows").set_value("1h/5m@14.4:page, 6h/30m@6:ticket")
    button(at, "Save SLO").click().run()
    no_errors(at)
    saved = fleet.get(f"/slos/{ident}")
    assert saved["objective"] == 98.5
    assert [(w["long"], w["short"], w["burn_rate"], w["severity"]) for w in saved["alert_windows"]] == [
        ("1h", "5m", 14.4, "page"), ("6h", "30m", 6.0, "ticket")]  # fmt: skip

    # Someone else changes it between this page's read and the submit: the If-Match ETag makes the API say 412.
    form = f"slo-edit-{ident}-{saved['version']}"
    with fleet.client("editor") as other:
        other.patch(f"/api/v1/slos/{ident}", json={"description": "changed meanwhile"}).raise_for_status()
    at.number_input(key=f"{form}:objective").set_value(97.0)
    button(at, "Save SLO").click().run()
    assert any("Someone changed this since you opened it" in e.value for e in at.error)
    assert fleet.get(f"/slos/{ident}")["objective"] == 98.5

    at.text_input(key=f"{form}:alert_windows").set_value("1h 5m")
    button(at, "Save SLO").click().run()
    assert "is not long/short@burn_rate" in right_after(at, f"{form}:alert_windows").value


def test_rules_say_what_each_does_now_and_switches_round_trip(open_page: OpenPage, fleet: SeededPlane) -> None:
    at = open_page("rules")
    no_errors(at)
    rules = table(at, "now").set_index("rule")
    assert rules.loc["shed-on-deep-queue", "now"] == "jetson-berlin-01: shed priority 3 and lower (Retry-After 7 s)"
    assert rules.loc["shed-batch-traffic-when-hot", "mode"] == "dry run"
    assert rules.loc["lite-on-fast-burn", "when"] == "SLO mlp-latency burns ≥ 14.4x over 1h and 5m"
    states = table(at, "observed").set_index("rule")
    assert states.loc["shed-on-deep-queue", "state"] == "firing"
    assert "threshold=32" in states.loc["shed-on-deep-queue", "observed"]
    ladder = table(at, "rung")
    assert list(ladder["rung"]) == ["tune batching", "cap max_tokens", "limit generation", "overflow to the cloud",
                                    "lighter variant", "shed low priorities", "serve fallbacks"]  # fmt: skip
    assert at.selectbox(key="rules_ladder_agent").value == fleet.agents["jetson-berlin-01"]  # the busy one first
    assert ladder.set_index("rung").loc["shed low priorities", "by rules"] == "shed-on-deep-queue"

    at.selectbox(key="rule_edit_pick").select("lite-on-fast-burn").run()
    ident = fleet.rules["lite-on-fast-burn"]
    version = fleet.get(f"/rules/{ident}")["version"]
    assert fleet.get(f"/rules/{ident}")["dry_run"] is True  # the example fleet seeds it in dry run
    at.toggle(key=f"rule-dry-{ident}-{version}").set_value(False).run()
    no_errors(at)
    assert fleet.get(f"/rules/{ident}")["dry_run"] is False
    assert [s.value for s in at.success] == ["Rule lite-on-fast-burn is now live (no longer dry run)."]
    version += 1
    at.toggle(key=f"rule-enabled-{ident}-{version}").set_value(False).run()
    assert fleet.get(f"/rules/{ident}")["enabled"] is False
    assert table(at, "now").set_index("rule").loc["lite-on-fast-burn", "now"] == "disabled: not evaluated"


def test_rule_form_creates_a_rule_and_maps_nested_errors_to_fields(open_page: OpenPage, fleet: SeededPlane) -> None:
    at = open_page("rules")
    at.selectbox(key="rule-create-0:condition.kind").select("latency").run()
    at.selectbox(key="rule-create-0:action.kind").select("fallback").run()
    at.text_input(key="rule-create-0:name").set_value("fallback-when-slow")
    at.number_input(key="rule-create-0:condition.quantile").set_value(1.5)
    at.selectbox(key="rule-create-0:action.mode").select("default")
    button(at, "Create rule").click().run()
    # The API names `condition.latency.quantile`; the form's field is `condition.quantile`.
    assert "less than 1" in right_after(at, "rule-create-0:condition.quantile").value
    # A check across the action's fields (`action.fallback`, no field in the path) shows under its heading.
    assert any(e.value.startswith("fallback mode 'default' needs default_outputs") for e in at.error)
    at.number_input(key="rule-create-0:condition.quantile").set_value(0.95)
    at.text_area(key="rule-create-0:action.default_outputs").set_value(
        '[{"name": "y", "shape": [1], "datatype": "FP32", "data": [0]}]'
    )
    button(at, "Create rule").click().run()
    no_errors(at)
    created = {r["name"]: r for r in fleet.get("/rules")["items"]}["fallback-when-slow"]
    assert created["condition"] == {"kind": "latency", "metric": "request", "quantile": 0.95, "threshold_ms": 100.0,
                                    "window": "5m", "min_requests": 20}  # fmt: skip
    assert created["action"]["mode"] == "default" and created["action"]["default_outputs"][0]["name"] == "y"


def test_rule_form_creates_and_edits_generative_conditions_and_actions(open_page: OpenPage, fleet: SeededPlane) -> None:
    at = open_page("rules")
    at.selectbox(key="rule-create-0:condition.kind").select("latency").run()
    at.selectbox(key="rule-create-0:action.kind").select("cap_max_tokens").run()
    at.text_input(key="rule-create-0:name").set_value("cap-on-slow-first-token")
    at.text_input(key="rule-create-0:selector.model").set_value("tiny-lm")
    at.selectbox(key="rule-create-0:condition.metric").select("ttft")
    at.number_input(key="rule-create-0:condition.threshold_ms").set_value(300.0)
    at.number_input(key="rule-create-0:action.max_tokens").set_value(0)
    at.checkbox(key="rule-create-0:dry_run").check()  # it would fire on orin-chat-01: keep the seeded policies
    button(at, "Create rule").click().run()
    assert not at.exception
    assert "300 is not a ttft bucket boundary" in right_after(at, "rule-create-0:condition.threshold_ms").value
    assert "greater than or equal to 1" in right_after(at, "rule-create-0:action.max_tokens").value
    at.number_input(key="rule-create-0:condition.threshold_ms").set_value(500.0)
    at.number_input(key="rule-create-0:action.max_tokens").set_value(64)
    button(at, "Create rule").click().run()
    no_errors(at)
    created = {r["name"]: r for r in fleet.get("/rules")["items"]}["cap-on-slow-first-token"]
    assert (created["condition"]["metric"], created["condition"]["threshold_ms"]) == ("ttft", 500.0)
    assert created["action"] == {"kind": "cap_max_tokens", "max_tokens": 64}
    rules = table(at, "now").set_index("rule")
    assert rules.loc["cap-on-slow-first-token", "when"] == "p99 time to first token > 500.0 ms over 5m"
    assert rules.loc["cap-on-slow-first-token", "then"] == "cap max_tokens at 64"

    ident = created["id"]
    at.selectbox(key="rule_edit_pick").select("cap-on-slow-first-token").run()
    form = f"rule-edit-{ident}-{created['version']}"
    assert at.selectbox(key=f"{form}:condition.metric").value == "ttft"
    at.selectbox(key=f"{form}:action.kind").select("limit_generation").run()
    button(at, "Save rule").click().run()  # neither limit: the API's check across the action's fields
    assert any("limit_generation needs max_num_seqs or max_num_batched_tokens" in e.value for e in at.error)
    at.number_input(key=f"{form}:action.max_num_seqs").set_value(2)
    button(at, "Save rule").click().run()
    no_errors(at)
    saved = fleet.get(f"/rules/{ident}")
    assert saved["action"] == {"kind": "limit_generation", "max_num_seqs": 2, "max_num_batched_tokens": None}
    assert table(at, "now").set_index("rule").loc["cap-on-slow-first-token", "then"] == (
        "limit generation: max_num_seqs 2"
    )
    with fleet.client("editor") as editor:
        editor.delete(f"/api/v1/rules/{ident}").raise_for_status()


def test_overflow_rule_form_creates_edits_and_the_policy_shows_it(open_page: OpenPage, fleet: SeededPlane) -> None:
    at = open_page("rules")
    at.selectbox(key="rule-create-0:condition.kind").select("gauge").run()
    at.selectbox(key="rule-create-0:action.kind").select("overflow").run()
    at.text_input(key="rule-create-0:name").set_value("overflow-on-deep-queue")
    at.text_input(key="rule-create-0:selector.labels").set_value("site=berlin")
    at.text_input(key="rule-create-0:selector.model").set_value("mlp")
    at.number_input(key="rule-create-0:condition.threshold").set_value(40.0)
    at.text_input(key="rule-create-0:hysteresis.for").set_value("0s")
    at.selectbox(key="rule-create-0:action.mode").select("fraction")
    button(at, "Create rule").click().run()
    assert not at.exception
    assert "mode fraction needs the share" in right_after(at, "rule-create-0:action.fraction").value
    assert "overflow-on-deep-queue" not in {r["name"] for r in fleet.get("/rules")["items"]}

    at.number_input(key="rule-create-0:action.fraction").set_value(1.5)
    button(at, "Create rule").click().run()
    assert right_after(at, "rule-create-0:action.fraction").value == "Input should be less than or equal to 1"

    at.number_input(key="rule-create-0:action.fraction").set_value(0.25)
    at.number_input(key="rule-create-0:action.priority_at_or_below").set_value(2)  # not mode priority's: not sent
    button(at, "Create rule").click().run()
    no_errors(at)
    created = {r["name"]: r for r in fleet.get("/rules")["items"]}["overflow-on-deep-queue"]
    assert created["action"] == {"kind": "overflow", "mode": "fraction", "fraction": 0.25, "priority_at_or_below": None}
    then = table(at, "now").set_index("rule").loc["overflow-on-deep-queue", "then"]
    assert then == "overflow to the cloud: requests predicted to miss their deadline and 25 % of the rest"

    # Berlin's queue (80) is over 40: the control loop puts the overflow in its policy, and the device page says so.
    berlin = fleet.agents["jetson-berlin-01"]
    wait_for(lambda: (fleet.get(f"/agents/{berlin}/policy")["models"].get("mlp") or {}).get("overflow"),
             "the overflow to reach Berlin's policy")  # fmt: skip
    device = open_page("device", agent=berlin)
    no_errors(device)
    assert table(device, "overflow").set_index("model").loc["mlp", "overflow"] == (
        "deadline misses and 25 % of the rest overflow"
    )
    rung = table(device, "rung").set_index("rung").loc["overflow to the cloud"]
    assert (rung["in force"], rung["by rules"]) == ("yes", "overflow-on-deep-queue")

    ident = created["id"]
    at.selectbox(key="rule_edit_pick").select("overflow-on-deep-queue").run()
    form = f"rule-edit-{ident}-{created['version']}"
    assert at.selectbox(key=f"{form}:action.kind").value == "overflow"
    assert at.number_input(key=f"{form}:action.fraction").value == 0.25
    at.selectbox(key=f"{form}:action.mode").select("priority")
    button(at, "Save rule").click().run()
    assert "mode priority needs the priority level" in right_after(at, f"{form}:action.priority_at_or_below").value
    at.number_input(key=f"{form}:action.priority_at_or_below").set_value(3)
    button(at, "Save rule").click().run()
    no_errors(at)
    assert [s.value for s in at.success] == ["Rule overflow-on-deep-queue saved."]
    saved = fleet.get(f"/rules/{ident}")
    assert saved["action"] == {"kind": "overflow", "mode": "priority", "fraction": None, "priority_at_or_below": 3}
    with fleet.client("editor") as editor:  # the other tests expect the seeded policies
        editor.delete(f"/api/v1/rules/{ident}").raise_for_status()


def test_backends_list_and_add_through_the_api(open_page: OpenPage, fleet: SeededPlane) -> None:
    at = open_page("backends")
    no_errors(at)
    backends = table(at, "url").set_index("backend")
    assert backends.loc["cloud-triton-eu", "url"] == "http://127.0.0.1:8500"
    assert backends.loc["cloud-triton-eu", "auth header"] == "set"
    assert "cloud-triton-eu" in set(table(at, "in flight / cap")["backend"])
    at.text_input(key="backend-create-0:name").set_value("cloud-kserve-us")
    at.text_input(key="backend-create-0:url").set_value("http://127.0.0.1:8600")
    at.text_input(key="backend-create-0:models").set_value("mlp, resnet")
    at.number_input(key="backend-create-0:weight").set_value(2.0)
    button(at, "Add backend").click().run()
    no_errors(at)
    created = {b["name"]: b for b in fleet.get("/backends")["items"]}["cloud-kserve-us"]
    assert (created["models"], created["weight"], created["auth_header_set"]) == (["mlp", "resnet"], 2.0, False)
    assert "cloud-kserve-us" in set(table(at, "url")["backend"])


def test_backends_show_openai_backends_and_add_one_with_a_model_map(open_page: OpenPage, fleet: SeededPlane) -> None:
    def vllm_checked() -> bool:  # nothing listens on its port: its readiness check (GET /v1/models) fails
        backends = {b["name"]: b for b in fleet.get("/status")["gateway"]["backends"]}
        return backends.get("cloud-vllm-eu", {}).get("healthy") is False

    wait_for(vllm_checked, "the gateway's first readiness check of the openai backend")
    at = open_page("backends")
    no_errors(at)
    vllm = table(at, "url").set_index("backend").loc["cloud-vllm-eu"]
    assert (vllm["protocol"], vllm["model map"]) == ("openai", "tiny-lm=Qwen2.5-7B-Instruct")
    assert table(at, "url").set_index("backend").loc["cloud-triton-eu", "protocol"] == "v2"
    live = table(at, "in flight / cap").set_index("backend").loc["cloud-vllm-eu"]
    assert (live["protocol"], live["state"], live["in flight / cap"]) == ("openai", "unhealthy (tiny-lm)", "0 / 32")

    at.text_input(key="backend-create-0:name").set_value("cloud-llamacpp")
    at.selectbox(key="backend-create-0:protocol").select("openai")
    at.text_input(key="backend-create-0:url").set_value("http://127.0.0.1:8602")
    at.text_input(key="backend-create-0:models").set_value("tiny-lm")
    at.text_input(key="backend-create-0:model_map").set_value("tiny-lm")
    button(at, "Add backend").click().run()
    assert "is not edge_name=cloud_name" in right_after(at, "backend-create-0:model_map").value
    at.text_input(key="backend-create-0:model_map").set_value("coder=qwen2.5-coder")
    button(at, "Add backend").click().run()  # the API's check across fields, shown under the field it names
    assert "'coder' is not one of this backend's models" in right_after(at, "backend-create-0:model_map").value
    at.text_input(key="backend-create-0:model_map").set_value("tiny-lm=qwen2.5-0.5b-instruct")
    button(at, "Add backend").click().run()
    no_errors(at)
    created = {b["name"]: b for b in fleet.get("/backends")["items"]}["cloud-llamacpp"]
    assert (created["protocol"], created["model_map"]) == ("openai", {"tiny-lm": "qwen2.5-0.5b-instruct"})
    with fleet.client("editor") as editor:
        editor.delete(f"/api/v1/backends/{created['id']}").raise_for_status()


def test_backends_page_shows_each_backends_live_state_in_the_gateway(open_page: OpenPage, fleet: SeededPlane) -> None:
    """A real V2 backend process behind the real gateway: three answers, then five 503s in a row eject it."""
    backend = start_faulty("cloud-faulty")
    editor = fleet.client("editor")
    ident = None
    try:
        created = editor.post(
            "/api/v1/backends",
            json=make_backend(name="cloud-faulty", url=backend.url, models=["vision"], max_concurrency=8),
        )
        created.raise_for_status()
        ident = created.json()["id"]
        agent = {"Authorization": f"Bearer {fleet.tokens['desktop-gpu-lab']}", "Content-Type": "application/json"}
        with httpx.Client(base_url=fleet.url, headers=agent, timeout=10) as client:
            for _ in range(3):
                assert client.post("/v2/models/vision/infer", content=MLP_REQUEST).status_code == 200
            backend.set(mode="status", status=503)
            for _ in range(5):
                assert client.post("/v2/models/vision/infer", content=MLP_REQUEST).status_code == 503
        wait_for(lambda: [e for e in fleet.get("/events?kind=backend.ejected")["items"]
                          if e["data"].get("backend") == "cloud-faulty"], "the ejection to be recorded")  # fmt: skip

        at = open_page("backends")
        no_errors(at)
        live = table(at, "in flight / cap").set_index("backend")
        row = live.loc["cloud-faulty"]
        assert row["state"].startswith("ejected until ") and row["state"].endswith(" s left)")
        assert (row["requests"], row["errors"], row["error rate"]) == (8, 5, "62.5%")
        assert row["in flight / cap"] == "0 / 8"
        assert row["ejection multiplier"] == 1
        assert 0 < row["p50 ms"] <= row["p99 ms"]
        assert "503" in row["last error"]
        assert any("requests in flight" in c.value and "retries in flight" in c.value for c in at.caption)
        events = table(at, "reason")
        ejected = events[(events["kind"] == "backend ejected") & (events["backend"] == "cloud-faulty")].iloc[0]
        assert ejected["actor"] == "gateway" and "5 consecutive failures" in ejected["reason"]
        assert "times_ejected=1" in ejected["numbers"]
        assert "backend created" in set(events["kind"])
    finally:
        backend.proc.terminate()
        backend.proc.wait(timeout=15)
        if ident is not None:
            editor.delete(f"/api/v1/backends/{ident}").raise_for_status()
        editor.close()


def test_events_timeline_filters_by_kind_agent_and_rule(open_page: OpenPage, fleet: SeededPlane) -> None:
    at = open_page("events")
    no_errors(at)
    events = table(at, "numbers")
    assert {"rule fired", "policy published", "slo created"} <= set(events["kind"])  # kinds in words
    assert list(events["id"]) == sorted(events["id"], reverse=True)  # newest first
    fired = events[(events["kind"] == "rule fired") & (events["rule"] == "shed-on-deep-queue")].iloc[-1]
    assert fired["agent"] == "jetson-berlin-01"
    assert "threshold=32" in fired["numbers"]

    at.selectbox(key="events_kind").select("rule.*").run()
    kinds = set(table(at, "numbers")["kind"])
    assert "rule fired" in kinds and all(k.startswith("rule ") for k in kinds)
    at.selectbox(key="events_kind").select(None)
    at.selectbox(key="events_rule").select(fleet.rules["shed-on-deep-queue"]).run()
    assert set(table(at, "numbers")["rule"]) == {"shed-on-deep-queue"}


def test_a_viewer_sees_every_page_with_editing_disabled(open_page: OpenPage) -> None:
    for page, submit in (("slos", "Create SLO"), ("rules", "Create rule"), ("backends", "Add backend")):
        at = open_page(page, role="viewer")
        no_errors(at)
        assert any("has the **viewer** role" in i.value for i in at.info)
        assert any(c.value.startswith("Signed in as **") and c.value.endswith("(viewer)") for c in at.sidebar.caption)
        assert button(at, submit).disabled
        assert all(t.disabled for t in at.text_input)
    at = open_page("rules", role="viewer")
    assert all(t.disabled for t in at.toggle)


def test_unreachable_api_and_refused_key_read_as_sentences(open_page: OpenPage) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    for page in ("fleet", "device", "slos", "rules", "backends", "events"):
        at = open_page(page, url=closed)
        assert not at.exception
        assert any("is unreachable" in e.value and closed in e.value for e in at.error), page
    at = open_page("slos", key="spk_0000000000000000_" + "x" * 43)
    assert not at.exception
    assert any("The API refused the key" in e.value for e in at.error)
