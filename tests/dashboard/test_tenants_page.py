"""The Tenants page under Streamlit's AppTest against a real control plane on loopback: it lists each tenant with the
agents it is on, its limits and tokens; an admin adds and edits tenants (the API's messages under the fields),
makes a token that is shown once, and revokes it; other roles read only. Per-tenant traffic shows when the agent
metrics carry it, and says so when they do not."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from streamlit.testing.v1 import AppTest

import dashboards
from controlplane.app import create_app
from controlplane.settings import Settings
from dashboards.api import SpillwayApi
from dashboards.fmt import DASH
from dashboards.views.tenants import NO_TENANT_DATA, tenant_rows
from spillway.contract.tenants import hash_token
from tests.conftest import make_keys
from tests.utils.server import serving

APP = Path(dashboards.__file__).resolve().parent / "app.py"
PAGE = "views/tenants.py"


@dataclass
class Plane:
    url: str
    keys: dict[str, str]
    agents: dict[str, str]  # name -> id
    acme: str  # the seeded tenant's id

    def call(self, method: str, path: str, **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.keys['admin']}"}
        response = httpx.request(method, f"{self.url}/api/v1{path}", headers=headers, timeout=10, **kw)
        response.raise_for_status()
        return response.json() if response.content else None


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    """Two agents (Berlin and Munich) and one tenant on Berlin's, with one token."""
    url = f"sqlite:///{tmp_path_factory.mktemp('tenants-page') / 'spillway.db'}"
    keys = make_keys(url)
    with serving(create_app(Settings(database_url=url, control_loop_interval_s=0))) as base:
        seeded = Plane(base, keys, {}, "")
        for name, site in (("edge-berlin", "berlin"), ("edge-munich", "munich")):
            body = {"name": name, "labels": {"site": site}, "device_class": "jetson"}
            seeded.agents[name] = seeded.call("POST", "/agents", json=body)["agent"]["id"]
        seeded.acme = seeded.call("POST", "/tenants", json={"name": "acme", "selector": {"labels": {"site": "berlin"}},
                                                           "weight": 3, "rate_rps": 50})["id"]  # fmt: skip
        seeded.call("POST", f"/tenants/{seeded.acme}/tokens", json={"label": "billing"})
        yield seeded


@pytest.fixture
def open_page(plane: Plane, monkeypatch: pytest.MonkeyPatch) -> Any:
    def _open(role: str = "admin") -> AppTest:
        monkeypatch.setenv("SPILLWAY_API_URL", plane.url)
        monkeypatch.setenv("SPILLWAY_API_KEY", plane.keys[role])
        at = AppTest.from_file(str(APP), default_timeout=30)
        at.run()
        at.switch_page(PAGE).run()
        return at

    return _open


def table(at: AppTest, having: str) -> Any:
    return next(df.value for df in at.dataframe if having in df.value.columns)


def right_after(at: AppTest, key: str) -> Any:
    """The element drawn right after the widget with this key (where a field's error message goes)."""
    nodes = flat(at.main)
    index = next(i for i, node in enumerate(nodes) if getattr(node, "key", None) == key)
    return nodes[index + 1]


def flat(node: Any) -> list[Any]:
    out = [node]
    for child in getattr(node, "children", {}).values():
        out += flat(child)
    return out


def button(at: AppTest, label: str) -> Any:
    return next(b for b in at.button if b.label == label)


def no_errors(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_the_page_lists_tenants_and_is_read_only_below_admin(open_page: Any, plane: Plane) -> None:
    at = open_page("editor")
    no_errors(at)
    rows = table(at, "tenant").set_index("tenant")
    acme = rows.loc["acme"]
    assert (acme["selector"], acme["agents"], acme["weight"], acme["requests/s"], acme["max streams"]) == (
        "site=berlin", "edge-berlin", 3.0, "50", DASH)  # fmt: skip
    assert acme["tokens"] == 1
    assert any("editing needs **admin**" in i.value for i in at.info)
    assert button(at, "Save tenant").disabled and button(at, "Make a token").disabled
    tokens = table(at, "label")
    assert list(tokens["label"]) == ["billing"] and tokens["token"].iloc[0].startswith("spt_")
    # Per-tenant traffic: shown when the agent metrics carry it, else the page says there is none yet.
    assert at.selectbox(key="tenants_agent").value == plane.agents["edge-berlin"]  # the agent with a tenant first
    real = plane.call("GET", f"/agents/{plane.agents['edge-berlin']}/metrics", params={"window": "5m"})
    if "by_tenant" in real:
        assert any("tenant" in df.value.columns for df in at.dataframe[1:]) or any(
            "No requests from any tenant" in c.value for c in at.caption)  # fmt: skip
    else:
        assert NO_TENANT_DATA in [c.value for c in at.caption]


def test_an_admin_adds_a_tenant_with_the_apis_messages_under_the_fields(open_page: Any, plane: Plane) -> None:
    at = open_page()
    at.tabs[1].text_input(key="tenant-create-0:name").set_value("Globex Corp")
    at.number_input(key="tenant-create-0:weight").set_value(0.0)
    at.text_input(key="tenant-create-0:max_streams").set_value("two")
    button(at, "Add tenant").click().run()
    assert not at.exception
    assert "should match pattern" in right_after(at, "tenant-create-0:name").value  # the API's words, under the field
    assert "greater than 0" in right_after(at, "tenant-create-0:weight").value
    assert "valid integer" in right_after(at, "tenant-create-0:max_streams").value
    assert "Globex Corp" not in {t["name"] for t in plane.call("GET", "/tenants")["items"]}

    at.text_input(key="tenant-create-0:name").set_value("globex")
    at.text_input(key="tenant-create-0:selector.labels").set_value("site=munich")
    at.number_input(key="tenant-create-0:weight").set_value(2.0)
    at.text_input(key="tenant-create-0:max_streams").set_value("")
    at.text_input(key="tenant-create-0:max_in_flight").set_value("4")
    button(at, "Add tenant").click().run()
    no_errors(at)
    assert [s.value for s in at.success] == ["Tenant added."]
    made = {t["name"]: t for t in plane.call("GET", "/tenants")["items"]}["globex"]
    assert (made["selector"], made["weight"], made["max_in_flight"], made["rate_rps"]) == (
        {"labels": {"site": "munich"}}, 2.0, 4, None)  # fmt: skip
    assert table(at, "tenant").set_index("tenant").loc["globex", "agents"] == "edge-munich"
    plane.call("DELETE", f"/tenants/{made['id']}")


def test_an_admin_edits_a_tenant_and_the_agents_policy_follows(open_page: Any, plane: Plane) -> None:
    at = open_page()
    at.selectbox(key="tenant_edit_pick").select("acme").run()
    version = plane.call("GET", f"/tenants/{plane.acme}")["version"]
    form = f"tenant-edit-{plane.acme}-{version}"
    at.number_input(key=f"{form}:weight").set_value(5.0)
    assert at.text_input(key=f"{form}:rate_rps").value == "50"
    at.text_input(key=f"{form}:rate_rps").set_value("")  # emptied: the quota lifted
    at.text_input(key=f"{form}:max_priority").set_value("2")
    button(at, "Save tenant").click().run()
    no_errors(at)
    assert [s.value for s in at.success] == ["Tenant acme saved."]
    saved = plane.call("GET", f"/tenants/{plane.acme}")
    assert (saved["weight"], saved["rate_rps"], saved["max_priority"]) == (5.0, None, 2)
    document = plane.call("GET", f"/agents/{plane.agents['edge-berlin']}/policy")
    assert [(t["name"], t["weight"], t["max_priority"]) for t in document["tenants"]] == [("acme", 5.0, 2)]


def test_a_token_is_shown_once_and_revoked(open_page: Any, plane: Plane) -> None:
    at = open_page()
    at.selectbox(key="tenant_edit_pick").select("acme").run()
    key = f"tenant-tokens-{plane.acme}"
    at.text_input(key=f"{key}:label").set_value("checkout")
    button(at, "Make a token").click().run()
    no_errors(at)
    shown = [c.value for c in at.code]
    assert len(shown) == 1 and shown[0].startswith("spt_")
    secret = shown[0]
    listed = plane.call("GET", f"/tenants/{plane.acme}/tokens")["items"]
    made = next(t for t in listed if t["label"] == "checkout")
    assert made["prefix"] == secret[:10] and secret not in str(listed)
    document = plane.call("GET", f"/agents/{plane.agents['edge-berlin']}/policy")
    assert hash_token(secret) in document["tenants"][0]["token_sha256"]  # what the agents check a bearer against

    at.run()  # the next run: the secret is gone from the page
    assert [c.value for c in at.code] == []

    at.selectbox(key=f"{key}:pick").select(made["id"]).run()
    at.checkbox(key=f"{key}:sure").check().run()
    button(at, "Revoke token").click().run()
    no_errors(at)
    assert [s.value for s in at.success] == [f"Token {made['prefix']}… of acme revoked."]
    assert made["id"] not in {t["id"] for t in plane.call("GET", f"/tenants/{plane.acme}/tokens")["items"]}
    document = plane.call("GET", f"/agents/{plane.agents['edge-berlin']}/policy")
    assert hash_token(secret) not in document["tenants"][0]["token_sha256"]


def test_per_tenant_traffic_share_and_refusals_from_the_agent_metrics(
    open_page: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """H7's `by_tenant` in the agent metrics answer, added here to the real answer (its shape may be a mapping of
    tenant -> numbers or a list of entries: `tenant_rows` takes both)."""
    seen = [  # the shape of the control plane's `TenantTraffic` (controlplane/api/agent_metrics.py)
        {"tenant": "acme", "requests": 300.0, "rps": 1.0, "outcomes": {"local": 270.0, "rejected": 30.0},
         "served": 270.0, "share": 0.75, "rejected": 30.0,
         "latency_ms": {"count": 270.0, "mean": 12.0, "p50": 10.0, "p95": 30.0, "p99": 45.0},
         "ttft_ms": {"p50": None, "p90": None, "p99": None}, "tokens_out_per_s": 0.0},
        {"tenant": "default", "requests": 90.0, "rps": 0.3, "outcomes": {"local": 90.0}, "served": 90.0,
         "share": 0.25, "rejected": 0.0, "latency_ms": {"count": 90.0, "mean": 5.0, "p50": 5.0, "p95": 9.0, "p99": 9.5},
         "ttft_ms": {"p50": None, "p90": None, "p99": None}, "tokens_out_per_s": 0.0},
    ]  # fmt: skip
    original = SpillwayApi.agent_metrics

    def with_tenants(self: SpillwayApi, agent_id: str, window: str = "5m") -> dict[str, Any]:
        return {**original(self, agent_id, window), "by_tenant": seen}

    monkeypatch.setattr(SpillwayApi, "agent_metrics", with_tenants)
    at = open_page("viewer")
    no_errors(at)
    rows = table(at, "share").set_index("tenant")
    assert (rows.loc["acme", "share"], rows.loc["default", "share"]) == ("75 %", "25 %")
    assert (rows.loc["acme", "refused"], rows.loc["acme", "outcomes"]) == (30, "local 90%, rejected 10%")
    assert (rows.loc["acme", "p99 ms"], rows.loc["default", "requests/s"]) == (45, 0.3)


def test_tenant_rows_tolerate_missing_figures() -> None:
    rows = tenant_rows([{"tenant": "a", "requests": 1.0, "share": None}, "junk"])
    assert [(r["tenant"], r["requests"], r["share"], r["p99 ms"], r["outcomes"]) for r in rows] == [
        ("a", 1.0, DASH, None, DASH)]  # fmt: skip
    assert tenant_rows(None) == [] and tenant_rows({"a": {}}) == []
