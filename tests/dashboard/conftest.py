"""Fixtures for the dashboard: a seeded real control plane on loopback, and Streamlit's AppTest against it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

import dashboards
from tests.dashboard.seeding import SeededPlane, seeded_plane

APP = Path(dashboards.__file__).resolve().parent / "app.py"
PAGES = {
    "fleet": "views/fleet.py",
    "device": "views/device.py",
    "slos": "views/slos.py",
    "rules": "views/rules.py",
    "backends": "views/backends.py",
    "events": "views/events.py",
    "tenants": "views/tenants.py",
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeededPlane]:
    """One seeded control plane per test module (SQLite: the subject here is the dashboard, not the database)."""
    db = tmp_path_factory.mktemp("dashboard") / "spillway.db"
    with seeded_plane(f"sqlite:///{db}") as seeded:
        yield seeded


OpenPage = Callable[..., AppTest]


@pytest.fixture
def open_page(fleet: SeededPlane, monkeypatch: pytest.MonkeyPatch) -> OpenPage:
    """`open_page("slos", role="viewer")`: a fresh browser session on that page, already run once."""

    def _open(page: str, role: str = "editor", url: str | None = None, key: str | None = None,
              **query: Any) -> AppTest:  # fmt: skip
        monkeypatch.setenv("SPILLWAY_API_URL", url or fleet.url)
        monkeypatch.setenv("SPILLWAY_API_KEY", key or fleet.keys[role])
        at = AppTest.from_file(str(APP), default_timeout=30)
        for name, value in query.items():
            at.query_params[name] = value
        at.run()
        if page != "fleet":
            at.switch_page(PAGES[page]).run()
        return at

    return _open
