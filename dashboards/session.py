"""What every page shares: the API client, the key's role, auto-refresh, and errors shown as sentences."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import streamlit as st

from dashboards.api import ApiError, ApiUnreachable, DashboardApiError, Role, SpillwayApi, may
from dashboards.launch import API_KEY_ENV, API_URL_ENV

REFRESH_ENV = "SPILLWAY_DASHBOARD_REFRESH_S"
DEFAULT_API_URL = "http://127.0.0.1:8400"
REFRESH_CHOICES = (0, 5, 10, 30, 60)  # seconds; 0: off
WHOAMI_TTL_S = 60.0  # one cheap read a minute per browser session; a key changed meanwhile still gets a clear 403


@dataclass(frozen=True)
class Config:
    api_url: str
    api_key: str
    refresh_s: int


class NotConfigured(Exception):
    pass


class LocalFieldErrors(Exception):
    """Input the dashboard itself could not turn into a request body, per field, like the API's details."""

    def __init__(self, fields: dict[str, str]) -> None:
        super().__init__("; ".join(f"{k}: {v}" for k, v in fields.items()))
        self.fields = fields


def config() -> Config:
    """The dashboard's settings, read from the environment on each run (the `spillway dashboard` command sets it)."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    if not key:
        raise NotConfigured(f"no API key: set {API_KEY_ENV} to a viewer, editor or admin key before starting")
    try:
        refresh = int(os.environ.get(REFRESH_ENV, "10"))
    except ValueError:
        raise NotConfigured(f"{REFRESH_ENV} must be a whole number of seconds") from None
    return Config(os.environ.get(API_URL_ENV, DEFAULT_API_URL).strip().rstrip("/"), key, max(refresh, 0))


@st.cache_resource(show_spinner=False)
def _client(api_url: str, api_key: str) -> SpillwayApi:
    return SpillwayApi(api_url, api_key)


def api() -> SpillwayApi:
    cfg = config()
    return _client(cfg.api_url, cfg.api_key)


def whoami() -> dict[str, Any]:
    """Who the key is (`GET /api/v1/whoami`: kind, id, name, role), asked at most once a minute per browser session."""
    cached = st.session_state.get("_whoami")
    if cached is not None and time.monotonic() - cached[1] < WHOAMI_TTL_S:
        found: dict[str, Any] = cached[0]
        return found
    found = api().whoami()
    st.session_state["_whoami"] = (found, time.monotonic())
    return found


def role() -> str:
    """The key's role: viewer, editor or admin (an agent's token: agent, which edits nothing here)."""
    return str(whoami().get("role", "viewer"))


def can_edit(needed: Role = "editor") -> bool:
    return may(role(), needed)


def read_only_note(needed: Role = "editor") -> None:
    if not can_edit(needed):
        st.info(f"Your API key has the **{role()}** role: editing needs **{needed}**, so the forms are disabled.")


def refresh_s() -> int:
    return int(st.session_state.get("refresh_s", config().refresh_s))


def sidebar() -> None:
    """The API, who the key is and the refresh controls, on every page."""
    with st.sidebar:
        try:
            cfg = config()
        except NotConfigured as exc:
            st.error(str(exc))
            return
        st.caption(f"API: `{cfg.api_url}`")
        with guard(quiet=True):
            me = whoami()
            st.caption(f"Signed in as **{me.get('name', '?')}** ({me.get('role', '?')})")
        default = cfg.refresh_s if cfg.refresh_s in REFRESH_CHOICES else REFRESH_CHOICES[2]
        st.selectbox(
            "Auto-refresh", REFRESH_CHOICES, index=REFRESH_CHOICES.index(default), key="refresh_s",
            format_func=lambda s: "off" if s == 0 else f"every {s} s",
        )  # fmt: skip
        if st.button("Refresh now", width="stretch"):
            st.rerun()


def live(body: Callable[[], None]) -> None:
    """Run `body` in a fragment that reruns by itself every `refresh_s` seconds, ending with the update time."""
    every = refresh_s() or None

    @st.fragment(run_every=every)
    def _fragment() -> None:
        with guard():
            body()
        updated = datetime.now(timezone.utc).strftime("%H:%M:%S UTC")
        st.caption(f"Last updated {updated}" + (f" · refreshes every {every} s" if every else " · auto-refresh off"))

    _fragment()


def history_points(call: Callable[[], dict[str, Any]]) -> list[dict[str, Any]] | None:
    """A history answer's points for the charts; when the API cannot give them (a control plane from before the
    history API answers 404), a note in their place and None."""
    try:
        points: list[dict[str, Any]] = call()["points"]
    except DashboardApiError as exc:
        st.caption(f"No charts over time: the history API did not answer ({explain(exc)}).")
        return None
    return points


def explain(exc: BaseException) -> str:
    """A sentence for an operator, never a traceback."""
    if isinstance(exc, NotConfigured):
        return str(exc)
    if isinstance(exc, ApiUnreachable):
        return (f"The control plane at {exc.url} is unreachable ({exc.reason}). Check that it is running and that "
                f"`spillway dashboard --api` points at it; this page retries on the next refresh.")  # fmt: skip
    if isinstance(exc, ApiError):
        if exc.status == 401:
            return f"The API refused the key ({exc.message}): set {API_KEY_ENV} to a valid, unrevoked API key."
        if exc.status == 403:
            return f"Your key lacks the role for this: {exc.message}."
        if exc.status == 412:
            return "Someone changed this since you opened it: your change was not applied. Reload and apply it again."
        if exc.status == 404:
            return f"Not found: {exc.message} (it may have just been deleted)."
        return f"The API answered {exc.status} {exc.code}: {exc.message}"
    return f"Unexpected error: {exc}"


@contextmanager
def guard(*, quiet: bool = False) -> Iterator[None]:
    """Show API failures as a message in place of the block; `quiet` shows nothing (e.g. the sidebar)."""
    try:
        yield
    except (NotConfigured, ApiUnreachable, ApiError) as exc:
        if not quiet:
            st.error(explain(exc))


def errors_key(form: str) -> str:
    return f"_errors_{form}"


def fresh_key(base: str) -> str:
    """A form key that changes after each successful submission, so a create form starts empty again."""
    return f"{base}-{st.session_state.get(f'_generation_{base}', 0)}"


def opened(kind: str, ident: str) -> tuple[dict[str, Any], str | None]:
    """A resource as it was when this session opened it for editing, with its ETag. The edit goes back with that
    ETag as If-Match, so a change someone made meanwhile is refused (412), not silently overwritten."""
    key = f"_opened_{kind}_{ident}"
    if key not in st.session_state:
        st.session_state[key] = api().get_with_etag(f"/{kind}/{ident}")
    found: tuple[dict[str, Any], str | None] = st.session_state[key]
    return found


def reopen(kind: str, ident: str) -> None:
    """Forget the copy being edited: the next run reads the resource as it is now."""
    st.session_state.pop(f"_opened_{kind}_{ident}", None)


def reload_button(kind: str, ident: str, form: str, latest_version: int) -> None:
    """Offer to read the resource afresh, and say so when it changed since this session opened it."""
    current, _ = opened(kind, ident)
    if current["version"] != latest_version:
        st.warning(f"This {kind[:-1]} changed since you opened it (version {current['version']}, now "
                   f"{latest_version}); saving would be refused. Reload to edit the latest.")  # fmt: skip
    if st.button("Reload (discard my edits)", key=f"reload-{form}"):
        reopen(kind, ident)
        st.session_state.pop(errors_key(form), None)
        st.rerun()


def submit(
    form: str, action: Callable[[], Any], done: str, *, reset: str | None = None, edited: tuple[str, str] | None = None
) -> None:
    """Call the API for a form and rerun. A validation error's per-field messages are kept for the next run,
    which draws them under their fields (the widgets were drawn before the submit button was pressed); on
    success the form's messages go, `done` is shown once, the form `reset` (a `fresh_key` base) empties, and
    the `edited` resource (kind, id) is read afresh."""
    try:
        action()
    except LocalFieldErrors as exc:
        st.session_state[errors_key(form)] = dict(exc.fields)
        st.rerun()
    except ApiError as exc:
        summary = "The API refused this; see the messages under the fields." if exc.fields else explain(exc)
        st.session_state[errors_key(form)] = {"_": summary, **exc.fields}
        st.rerun()
    except (ApiUnreachable, NotConfigured) as exc:
        st.session_state[errors_key(form)] = {"_": explain(exc)}
        st.rerun()
    st.session_state.pop(errors_key(form), None)
    if edited is not None:
        reopen(*edited)
    if reset is not None:
        st.session_state[f"_generation_{reset}"] = st.session_state.get(f"_generation_{reset}", 0) + 1
    st.session_state["_flash"] = done
    st.rerun()


def flash() -> None:
    """The outcome of the last form, shown once after the rerun that followed it."""
    message = st.session_state.pop("_flash", None)
    if message:
        st.success(message)


def form_errors(form: str) -> dict[str, str]:
    return dict(st.session_state.get(errors_key(form), {}))


def field_error(errors: dict[str, str], path: str) -> None:
    """The API's message for a form field, right under it. `condition.metric` matches the API's
    `condition.gauge.metric` (a union's tag sits in the path): the field's parts, in order, within the path."""
    for found, message in errors.items():
        if found != "_" and field_matches(path.split("."), found.split(".")):
            st.error(message, icon=":material/error:")


def form_summary(errors: dict[str, str], paths: list[str]) -> None:
    """The form's overall error, and any field message that no drawn field took."""
    if "_" in errors:
        st.error(errors["_"])
    for found, message in errors.items():
        if found != "_" and not any(field_matches(p.split("."), found.split(".")) for p in paths):
            st.error(f"{found}: {message}")


def field_matches(parts: list[str], path: list[str]) -> bool:
    """Whether a form field (`condition.metric`) takes an API message for `path` (`condition.gauge.metric`)."""
    if not parts or not path or parts[0] != path[0]:
        return False
    rest = iter(path)
    return all(part in rest for part in parts)
