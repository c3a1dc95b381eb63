"""`spillway slo`: SLOs in and out of a control plane as OpenSLO v1 YAML, and its Prometheus rules.

Imports only typer, httpx and the standard library at module level: a lean agent install imports this too. The YAML is
the server's to check (it names what is wrong); this only carries it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn
from urllib.parse import quote

import httpx
import typer

slo_app = typer.Typer(help="SLOs in and out: OpenSLO import and export, Prometheus rules.", no_args_is_help=True)

DEFAULT_API = "http://127.0.0.1:8400"
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
NOT_THE_PLANE = "is --api (SPILLWAY_API) the control plane?"

Api = Annotated[str, typer.Option("--api", envvar="SPILLWAY_API", help="the control plane's base URL")]
Output = Annotated[Path | None, typer.Option("-o", "--output", help="write to this file instead of stdout")]


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"spillway slo: {message}", err=True)
    raise typer.Exit(code)


def _explain(response: httpx.Response) -> str:
    """The server's error as one line: its message and, for each field it names, the field and why."""
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {' '.join(response.text.split())[:300]}"
    message = str(body.get("message", "")) if isinstance(body, dict) else ""
    details = body.get("details") if isinstance(body, dict) else None
    fields = [f"{d['field']}: {d.get('message', '')}" for d in details or [] if isinstance(d, dict) and "field" in d]
    if fields and len(fields) > 1:
        message = "; ".join(fields)
    return f"HTTP {response.status_code}: {message or response.reason_phrase}"


def _json(response: httpx.Response) -> Any:
    """A success's JSON body; anything else ends the command with one line (a proxy's page, another server)."""
    try:
        return response.json()
    except ValueError:
        media = response.headers.get("content-type", "no content type")
        _fail(f"{str(response.url).partition('?')[0]} answered HTTP {response.status_code} with {media}, not "
              f"JSON: {NOT_THE_PLANE}")  # fmt: skip


class _Client:
    """The control plane's REST API with the caller's key; every failure ends the command with one line, which never
    holds the key."""

    def __init__(self, api: str) -> None:
        key = os.environ.get("SPILLWAY_API_KEY", "").strip()
        if not key:
            _fail("set SPILLWAY_API_KEY to an API key (spillway controlplane create-key)", code=2)
        if not (key.isascii() and key.isprintable()):
            _fail("SPILLWAY_API_KEY is not an API key: it has characters other than printable ASCII", code=2)
        self.key = key
        self.api = api.rstrip("/")
        try:
            self.http = httpx.Client(base_url=self.api, timeout=TIMEOUT, headers={"Authorization": f"Bearer {key}"})
        except (httpx.InvalidURL, ValueError) as exc:
            _fail(f"--api '{api}' is not a URL: {self._redacted(exc)}", code=2)

    def _redacted(self, exc: Exception) -> str:
        return str(exc).replace(self.key, "<SPILLWAY_API_KEY>")

    def request(self, method: str, path: str, ok: tuple[int, ...] = (200,), **kw: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kw)
        except httpx.TimeoutException:
            _fail(f"{self.api} did not answer in time ({method} {path})")
        except httpx.ProtocolError as exc:  # its text may quote the request's headers: the key
            _fail(f"HTTP protocol error talking to {self.api} ({type(exc).__name__}; {method} {path})")
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            _fail(f"cannot reach the control plane at {self.api}: {self._redacted(exc)} (is it running? --api or "
                  "SPILLWAY_API)")  # fmt: skip
        if response.status_code not in ok:
            _fail(_explain(response))
        return response

    def slo_id(self, ref: str) -> str:
        """An SLO's id from its id or its name. `GET /slos/<ref>` answering is not enough: `openslo`, `import` and
        `prometheus-rules` are routes of their own, so it must answer the SLO whose id is `ref`."""
        found = self.request("GET", f"/api/v1/slos/{quote(ref, safe='')}", ok=(200, 404, 405, 422))
        if found.status_code == 200 and found.headers.get("content-type", "").startswith("application/json"):
            body = _json(found)
            if isinstance(body, dict) and body.get("id") == ref:
                return ref
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 500, **({"cursor": cursor} if cursor else {})}
            page = _json(self.request("GET", "/api/v1/slos", params=params))
            items = page.get("items") if isinstance(page, dict) else None
            if not isinstance(items, list):
                _fail(f"{self.api}/api/v1/slos did not answer a list of SLOs: {NOT_THE_PLANE}")
            for item in items:
                if isinstance(item, dict) and item.get("name") == ref:
                    return str(item["id"])
            cursor = page.get("next_cursor")
            if not cursor:
                _fail(f"no SLO with the id or name '{ref}'")


def _write(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        _fail(f"cannot write {output}: {exc.strerror or exc}")
    typer.echo(f"wrote {output}", err=True)


@slo_app.command("import")
def import_(
    file: Annotated[Path, typer.Argument(help="an OpenSLO v1 YAML file ('-' for stdin)")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="check everything, write nothing")] = False,
    api: Api = DEFAULT_API,
) -> None:
    """Create or replace SLOs by name from OpenSLO v1 YAML (all or nothing)."""
    try:
        text = sys.stdin.read() if str(file) == "-" else file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"cannot read {file}: {getattr(exc, 'strerror', None) or exc}")
    client = _Client(api)
    response = client.request("POST", "/api/v1/slos/import", ok=(200, 201), params={"dry_run": str(dry_run).lower()},
                              content=text.encode(), headers={"Content-Type": "application/yaml"})  # fmt: skip
    verb = {"created": "would create", "updated": "would update", "unchanged": "unchanged"} if dry_run else {}
    body = _json(response)
    slos = body.get("slos") if isinstance(body, dict) else None
    if not isinstance(slos, list) or not all(isinstance(s, dict) and {"result", "name", "id"} <= set(s) for s in slos):
        _fail(f"{client.api}/api/v1/slos/import did not answer the imported SLOs: {NOT_THE_PLANE}")
    for item in slos:
        typer.echo(f"{verb.get(item['result'], item['result'])}\t{item['name']}\t{item['id'] or '-'}")


@slo_app.command("export")
def export(
    ref: Annotated[str | None, typer.Argument(help="the SLO's id or name")] = None,
    all_: Annotated[bool, typer.Option("--all", help="every SLO, one document each")] = False,
    output: Output = None,
    api: Api = DEFAULT_API,
) -> None:
    """Write an SLO (or --all) as OpenSLO v1 YAML, which `spillway slo import` reads back to the same SLO."""
    if (ref is None) == (not all_):
        _fail("give an SLO's id or name, or --all", code=2)
    client = _Client(api)
    path = "/api/v1/slos/openslo" if all_ else f"/api/v1/slos/{client.slo_id(str(ref))}/openslo"
    _write(client.request("GET", path).text, output)


@slo_app.command("rules")
def rules(
    ref: Annotated[str | None, typer.Argument(help="the SLO's id or name (every SLO when left out)")] = None,
    output: Output = None,
    api: Api = DEFAULT_API,
) -> None:
    """Write Prometheus recording and multiwindow burn-rate alerting rules for an SLO (or every SLO)."""
    client = _Client(api)
    path = "/api/v1/slos/prometheus-rules" if ref is None else f"/api/v1/slos/{client.slo_id(ref)}/prometheus-rules"
    _write(client.request("GET", path).text, output)


__all__ = ["slo_app"]
