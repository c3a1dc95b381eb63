"""The control plane's REST API as the dashboard uses it: one httpx client, JSON in and out, errors as exceptions.

Errors form one small tree, so a page can catch what it can explain to an operator:

    DashboardApiError           anything the dashboard could not get from the API
    ├── ApiUnreachable          no HTTP answer at all (refused, timed out, DNS)
    └── ApiError                an HTTP error answer: status, the API's stable `error` code, message, field details
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Role = Literal["viewer", "editor", "admin"]  # what an API key may be (an agent's token, `agent`, edits nothing)
MAX_PAGES = 50  # a list longer than 50 pages of 200 is cut there rather than hanging a page render


class DashboardApiError(Exception):
    """The dashboard could not get what it asked the API for."""


class ApiUnreachable(DashboardApiError):
    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach the control plane at {url}: {reason}")
        self.url = url
        self.reason = reason


@dataclass
class ApiError(DashboardApiError):
    """An error answer: `code` is the API's stable `error` field, `fields` its per-field messages."""

    status: int
    code: str
    message: str
    fields: dict[str, str] = field(default_factory=dict)
    details: Any = None

    def __post_init__(self) -> None:
        super().__init__(f"{self.status} {self.code}: {self.message}")

    @classmethod
    def from_response(cls, response: httpx.Response) -> ApiError:
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            text = response.text.strip()[:300] or response.reason_phrase
            return cls(response.status_code, "http_error", text)
        details = body.get("details")
        return cls(
            response.status_code,
            str(body.get("error") or "http_error"),
            str(body.get("message") or response.reason_phrase),
            field_errors(details),
            details,
        )


# A check across a body's fields names the field it is about first: `model_map: 'x' is not one of ...`.
NAMED_FIELD = re.compile(r"^([a-z_][a-z0-9_]*): (.+)$", re.DOTALL)


def field_errors(details: Any) -> dict[str, str]:
    """The API's `details: [{"field", "message"}]` as {path: message}, with the `body.` prefix dropped; a message
    about the whole body that starts with a field's name (`model_map: ...`) goes to that field."""
    if not isinstance(details, list):
        return {}
    found: dict[str, str] = {}
    for item in details:
        if not isinstance(item, dict) or "field" not in item:
            continue
        path = str(item["field"]).removeprefix("body.")
        message = str(item.get("message", "")).removeprefix("Value error, ")
        named = NAMED_FIELD.match(message) if path == "body" else None
        if named is not None:
            path, message = named.group(1), named.group(2)
        found[path] = f"{found[path]}; {message}" if path in found else message
    return found


class SpillwayApi:
    """A synchronous client for `/api/v1`; safe to share between threads (httpx.Client is)."""

    def __init__(self, base_url: str, key: str, *, timeout_s: float = 10.0, transport: Any = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {key}", "User-Agent": "spillway-dashboard"},
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0)),
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=8),
            transport=transport,
        )

    def close(self) -> None:
        self._client.close()

    # -- transport -------------------------------------------------------------------------------------------

    def request(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, json: Any = None, etag: str | None = None
    ) -> httpx.Response:
        headers = {"If-Match": etag} if etag else None
        clean = {k: v for k, v in (params or {}).items() if v is not None and v != ""}
        try:
            response = self._client.request(method, path, params=clean, json=json, headers=headers)
        except httpx.TransportError as exc:
            raise ApiUnreachable(self.base_url, _transport_reason(exc)) from None
        if response.status_code >= 400:
            raise ApiError.from_response(response)
        return response

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", f"/api/v1{path}", params=params).json()

    def get_with_etag(self, path: str) -> tuple[Any, str | None]:
        response = self.request("GET", f"/api/v1{path}")
        return response.json(), response.headers.get("etag")

    def create(self, kind: str, body: dict[str, Any]) -> Any:
        return self.request("POST", f"/api/v1/{kind}", json=body).json()

    def patch(self, kind: str, ident: str, body: dict[str, Any], etag: str | None) -> Any:
        return self.request("PATCH", f"/api/v1/{kind}/{ident}", json=body, etag=etag).json()

    def delete(self, kind: str, ident: str, etag: str | None) -> None:
        self.request("DELETE", f"/api/v1/{kind}/{ident}", etag=etag)

    def list_all(self, kind: str, **params: Any) -> list[dict[str, Any]]:
        """Every item of a cursor-paginated list."""
        return list(self._iterate(kind, params))

    def _iterate(self, kind: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        cursor = None
        for _ in range(MAX_PAGES):
            page = self.get(f"/{kind}", **params, limit=200, cursor=cursor)
            yield from page["items"]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    # -- reads the pages share -------------------------------------------------------------------------------

    def status(self, window: str = "5m") -> dict[str, Any]:
        return dict(self.get("/status", window=window))

    def agent_metrics(self, agent_id: str, window: str = "5m") -> dict[str, Any]:
        return dict(self.get(f"/agents/{agent_id}/metrics", window=window))

    def policy(self, agent_id: str) -> dict[str, Any]:
        return dict(self.get(f"/agents/{agent_id}/policy"))

    def events(self, **filters: Any) -> dict[str, Any]:
        return dict(self.get("/events", **filters))

    def whoami(self) -> dict[str, Any]:
        """Who this key is: `{"kind": "key"|"agent", "id", "name", "role": "viewer"|"editor"|"admin"|"agent"}`."""
        return dict(self.get("/whoami"))

    def agent_history(self, agent_id: str, window: str, step: str) -> dict[str, Any]:
        """An agent's figures per step over `window` (every step present, oldest first; null: no data)."""
        return dict(self.get(f"/agents/{agent_id}/metrics/history", window=window, step=step))

    def fleet_history(self, window: str, step: str) -> dict[str, Any]:
        """Every agent's figures summed per step over `window`."""
        return dict(self.get("/metrics/history", window=window, step=step))

    def slo_history(self, slo_id: str, window: str, step: str) -> dict[str, Any]:
        """An SLO's SLI, budget left and burn rates per step over `window`."""
        return dict(self.get(f"/slos/{slo_id}/history", window=window, step=step))


def _transport_reason(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused or host not found"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    return type(exc).__name__


ROLE_RANK: dict[str, int] = {"viewer": 0, "editor": 1, "admin": 2}


def may(role: str, needed: Role) -> bool:
    return ROLE_RANK.get(role, -1) >= ROLE_RANK[needed]


def gather(calls: dict[str, Callable[[], Any]], workers: int = 8) -> dict[str, Any]:
    """Run independent API reads at once (a page's per-agent reads); a failed read gives its exception."""
    if not calls:
        return {}
    with ThreadPoolExecutor(max_workers=min(workers, len(calls))) as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
    found: dict[str, Any] = {}
    for key, future in futures.items():
        try:
            found[key] = future.result()
        except DashboardApiError as exc:
            found[key] = exc
    return found
