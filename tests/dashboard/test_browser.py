"""The dashboard in a real browser: Debian's Chromium driven by Playwright (never a downloaded browser), against a
real `spillway dashboard` process and a real, seeded control plane. Every page loads without an exception box and
shows the seeded names and numbers (a generative agent's streams on its device page, an `openai` backend on the
backends page), and the fleet, device and SLO pages' charts over time show more than one point on their first load
(from the history API: the seeded past minutes); an SLO edit and a generative rule (a TTFT condition capping
max_tokens) round-trip through the API; each page leaves a screenshot in tests/artifacts/dashboard/ (with
SPILLWAY_UPDATE_SCREENSHOTS=1, also the README's docs/screenshots/)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from dashboards.launch import wait_ready
from tests.dashboard.seeding import SeededPlane
from tests.utils.server import free_port

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts" / "dashboard"
README_SHOTS = ROOT / "docs" / "screenshots"
# Headless, and quiet: nothing that phones home (updates, safe browsing, translation, metrics, sync).
CHROMIUM_FLAGS = [
    "--disable-background-networking", "--disable-component-update", "--disable-default-apps", "--disable-sync",
    "--disable-domain-reliability", "--disable-client-side-phishing-detection", "--disable-breakpad",
    "--metrics-recording-only", "--no-first-run", "--no-default-browser-check", "--no-pings",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
    "--disable-dev-shm-usage", "--no-sandbox",  # CI runs as root in a container
]  # fmt: skip
PAGE_TIMEOUT_MS = 30_000
VIEWPORT = {"width": 1280, "height": 1000}
UPDATE_README = os.environ.get("SPILLWAY_UPDATE_SCREENSHOTS") == "1"


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not CHROMIUM.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {CHROMIUM} is missing: .ci/run installs it with apt-get install -y chromium")
        pytest.skip(f"no {CHROMIUM}: apt-get install -y chromium (Debian) to run the browser test")
    return CHROMIUM


@pytest.fixture(scope="module")
def dashboard(fleet: SeededPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`spillway dashboard --api URL --port P` as its own process, with an editor key."""
    port = free_port()
    log = tmp_path_factory.mktemp("dashboard-process") / "dashboard.log"
    env = {**os.environ, "SPILLWAY_API_KEY": fleet.keys["editor"], "SPILLWAY_DASHBOARD_REFRESH_S": "5"}
    command = [sys.executable, "-m", "spillway.cli", "dashboard", "--api", fleet.url, "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, proc, timeout_s=60)
        except RuntimeError as exc:
            pytest.fail(f"{exc}:\n{log.read_text()}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def browser(chromium: Path) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(chromium), headless=True, args=CHROMIUM_FLAGS)
        try:
            yield launched
        finally:
            launched.close()


# Every dataframe grid has filled the accessible table that mirrors its canvas (it does so after drawing).
GRIDS_FILLED = """() => [...document.querySelectorAll('[data-testid=stDataFrame]')]
    .every(grid => grid.querySelector('td') !== null)"""


def settle(page: Any) -> None:
    """Wait until the page has drawn its live part (its last-updated line), no script run is pending, and the
    dataframe grids hold their cells."""
    page.get_by_text("Last updated").first.wait_for(timeout=PAGE_TIMEOUT_MS)
    page.locator("[data-testid=stStatusWidget]").wait_for(state="detached", timeout=PAGE_TIMEOUT_MS)
    page.wait_for_function(GRIDS_FILLED, timeout=PAGE_TIMEOUT_MS)


def cells(page: Any) -> set[str]:
    """The text of every dataframe cell on the page (the grids' accessible tables)."""
    return {t.strip() for t in page.locator("[data-testid=stDataFrame] td").all_text_contents()}


def missing(page: Any, texts: list[str], timeout_s: float = 15.0) -> list[str]:
    """Which texts the page does not show, polled until none is missing or time runs out (an auto-refresh may
    be redrawing a grid at the moment of one reading)."""
    deadline = time.monotonic() + timeout_s
    while True:
        shown = page.inner_text("[data-testid=stMain]") + "\n" + "\n".join(cells(page))
        absent = [t for t in texts if t not in shown]
        if not absent or time.monotonic() > deadline:
            return absent
        page.wait_for_timeout(250)


def shoot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    if UPDATE_README:
        from PIL import Image

        README_SHOTS.mkdir(parents=True, exist_ok=True)
        with Image.open(path) as image:  # a small, palette PNG for the README
            image.convert("RGB").quantize(colors=96).save(README_SHOTS / f"{name}.png", optimize=True)


# The points (symbol marks) of the Vega chart whose title starts with the given text; -1 while no such chart is drawn.
# Line charts render as SVG (`charts.lines` asks vega-embed for it), each point a path in the chart's symbol mark.
CHART_POINTS = """(title) => {
    for (const svg of document.querySelectorAll('svg.marks')) {
        const titles = [...svg.querySelectorAll('.role-title text')].map(t => t.textContent);
        if (titles.some(t => t.startsWith(title))) return svg.querySelectorAll('.mark-symbol path').length;
    }
    return -1;
}"""


def chart_points(page: Any, title: str) -> int:
    """How many points the chart titled `title` draws once it draws more than one (or what it drew by the timeout)."""
    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_function(f"() => ({CHART_POINTS})({title!r}) > 1", timeout=10_000)
    return int(page.evaluate(CHART_POINTS, title))


def test_every_page_loads_and_shows_the_seeded_fleet(browser: Any, dashboard: str, fleet: SeededPlane) -> None:
    berlin, orin = fleet.agents["jetson-berlin-01"], fleet.agents["orin-chat-01"]
    expected = {
        "fleet": (
            "",
            [
                "jetson-berlin-01",
                "desktop-gpu-lab",
                "degraded",
                "mlp-latency",
                "3 / 3",
                "185",
                "orin-chat-01",
                "ttft ≤ 500 ms",
            ],
        ),
        "device": (f"device?agent={berlin}", ["degraded", "945", "80 / 80", "5.25 GiB", "shed-on-deep-queue", "185"]),
        "device-generative": (
            f"device?agent={orin}",
            [
                "Generation",
                "Tokens out/s (5m)",
                "KV-cache use (fullest)",
                "75%",
                "tiny-lm",
                "as configured",
                "Generative settings in force",
                "cap-tokens-on-full-kv",
            ],
        ),
        "slos": ("slos", ["mlp-latency", "mlp-availability", "56m/5m", "14.4", "FIRING"]),
        "rules": (
            "rules",
            [
                "shed-on-deep-queue",
                "lite-on-fast-burn",
                "dry run",
                "overflow to the cloud",
                "shed low priorities",
                "cap max_tokens at 128",
                "kv_cache_use_ratio above 0.7",
            ],
        ),
        "backends": (
            "backends",
            [
                "cloud-triton-eu",
                "http://127.0.0.1:8500",
                "Live state in the gateway",
                "requests in flight",
                "cloud-vllm-eu",
                "openai",
                "tiny-lm=Qwen2.5-7B-Instruct",
            ],
        ),
        "events": ("events", ["rule fired", "policy published", "slo created"]),
    }
    # On the first load, a chart over time per page with more than one point (the history API's, not this session's).
    charts = {"device": "GPU memory (GiB)", "device-generative": "GPU memory (GiB)", "slos": "Burn rate over time",
              "fleet": "Fleet requests/s"}  # fmt: skip
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    timings = {}
    try:
        for name, (path, texts) in expected.items():
            started = time.monotonic()
            page.goto(f"{dashboard}/{path}")
            settle(page)
            assert page.locator("[data-testid=stException]").count() == 0, name
            assert page.locator("[data-testid=stAlertContentError]").count() == 0, name
            assert missing(page, texts) == [], f"{name} page lacks them"
            if name in charts:
                assert chart_points(page, charts[name]) > 1, f"{name}: {charts[name]} chart"
            assert "sampled" not in page.inner_text("[data-testid=stMain]"), name
            shoot(page, name)
            timings[name] = round(time.monotonic() - started, 2)
    finally:
        context.close()
    print(f"page load times (s): {timings}")


def test_an_slo_edit_round_trips_through_the_api(browser: Any, dashboard: str, fleet: SeededPlane) -> None:
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    try:
        page.goto(f"{dashboard}/slos")
        settle(page)
        page.get_by_role("tab", name="Edit or delete an SLO").click()
        panel = page.get_by_role("tabpanel", name="Edit or delete an SLO")
        objective = panel.get_by_label("Objective (%)")
        objective.fill("100")
        panel.get_by_role("button", name="Save SLO").click()
        page.get_by_text("Input should be less than 100").wait_for(timeout=PAGE_TIMEOUT_MS)
        assert fleet.get(f"/slos/{fleet.slos['mlp-availability']}")["objective"] == 99.5

        page.get_by_role("tab", name="Edit or delete an SLO").click()
        objective = page.get_by_role("tabpanel", name="Edit or delete an SLO").get_by_label("Objective (%)")
        objective.fill("99.9")
        page.get_by_role("tabpanel", name="Edit or delete an SLO").get_by_role("button", name="Save SLO").click()
        page.get_by_text("SLO mlp-availability saved.").wait_for(timeout=PAGE_TIMEOUT_MS)
        assert fleet.get(f"/slos/{fleet.slos['mlp-availability']}")["objective"] == 99.9
        settle(page)
        assert missing(page, ["99.9 %"]) == []  # the table, read back from the API
        assert page.locator("[data-testid=stException]").count() == 0
    finally:
        context.close()


def choose(page: Any, scope: Any, label: str, option: str) -> None:
    """Pick `option` in the selectbox labelled `label` (its list opens in a popover outside `scope`). A click while
    the page is still redrawing may not open the list: click again, a few times at most."""
    box = scope.get_by_role("combobox", name=label, exact=True)
    item = page.get_by_role("option", name=option, exact=True)
    for _ in range(3):
        box.click()
        try:
            item.wait_for(timeout=3_000)
            break
        except PlaywrightTimeout:
            page.keyboard.press("Escape")
    item.click()
    page.wait_for_function(f"() => [...document.querySelectorAll('[role=combobox]')].some(b => b.value === {option!r})",
                           timeout=PAGE_TIMEOUT_MS)  # fmt: skip


def test_a_generative_rule_is_created_through_the_form(browser: Any, dashboard: str, fleet: SeededPlane) -> None:
    """The rules form in the browser: a TTFT condition that caps max_tokens (in dry run: the seeded policies stay)."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    ident = None
    try:
        page.goto(f"{dashboard}/rules")
        settle(page)
        page.get_by_role("tab", name="Create a rule").click()
        panel = page.get_by_role("tabpanel", name="Create a rule")
        choose(page, panel, "Condition", "latency")
        choose(page, panel, "Action", "cap_max_tokens")
        cap = panel.get_by_role("spinbutton", name="Cap max_tokens at", exact=True)
        cap.wait_for(timeout=PAGE_TIMEOUT_MS)  # the form redrawn for the kinds chosen
        panel.get_by_role("textbox", name="Name", exact=True).fill("cap-on-slow-first-token")
        panel.get_by_role("textbox", name="Selector model", exact=True).fill("tiny-lm")
        choose(page, panel, "Of", "time to first token")
        panel.get_by_role("spinbutton", name="Threshold (ms)", exact=True).fill("500")
        cap.fill("64")
        panel.get_by_text("Dry run (record what it would do").click()
        panel.get_by_role("button", name="Create rule").click()
        page.get_by_text("Rule created.").wait_for(timeout=PAGE_TIMEOUT_MS)
        created = {r["name"]: r for r in fleet.get("/rules")["items"]}["cap-on-slow-first-token"]
        ident = created["id"]
        assert created["condition"]["metric"] == "ttft" and created["condition"]["threshold_ms"] == 500
        assert created["action"] == {"kind": "cap_max_tokens", "max_tokens": 64} and created["dry_run"] is True
        settle(page)
        assert missing(page, ["cap-on-slow-first-token"]) == []  # the rules table, read back from the API
        assert page.locator("[data-testid=stException]").count() == 0
    finally:
        context.close()
        if ident is not None:
            with fleet.client("editor") as editor:
                editor.delete(f"/api/v1/rules/{ident}").raise_for_status()
