"""Body limits (413 without reading the body whole), probes, and settings that refuse nonsense."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from controlplane.app import create_app
from controlplane.settings import Settings
from tests.conftest import Api, make_keys, open_api
from tests.utils.builders import make_slo
from tests.utils.server import serving


@pytest.fixture
def small_api(sqlite_url: str) -> Iterator[Api]:
    yield from open_api(sqlite_url, max_body_bytes=2048)


def test_declared_oversize_body_is_413(small_api: Api) -> None:
    body = json.dumps(make_slo(description="x" * 1900)).encode()
    response = small_api.call("POST", "/api/v1/slos", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"] == "payload_too_large"
    assert "2048" in response.json()["message"]
    # A body under the limit still works on the same app.
    assert small_api.call("POST", "/api/v1/slos", json=make_slo()).status_code == 201


def test_streamed_oversize_body_is_413_before_it_is_read_whole(sqlite_url: str) -> None:
    """A chunked upload with no Content-Length is cut off once it passes the limit, over real HTTP."""
    keys = make_keys(sqlite_url)
    app = create_app(Settings(database_url=sqlite_url, max_body_bytes=2048))
    with serving(app) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /api/v1/slos HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + keys["editor"].encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            sent, answer = 0, b""
            chunk = b"400\r\n" + b"x" * 1024 + b"\r\n"
            sock.settimeout(0.05)
            for _ in range(1024):  # offers 1 MiB in all
                try:
                    sock.sendall(chunk)
                    sent += 1024
                    answer += sock.recv(65536)
                except (TimeoutError, BlockingIOError):
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
                if b"\r\n\r\n" in answer:
                    break
            sock.settimeout(5)
            while b"payload_too_large" not in answer:
                more = sock.recv(65536)
                if not more:
                    break
                answer += more
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"payload_too_large" in answer
    assert sent < 64 * 1024  # refused after a few KiB, not after reading the megabyte


def test_probes_answer_without_credentials(sqlite_api: Api) -> None:
    assert sqlite_api.client.get("/healthz").json() == {"status": "ok"}
    assert sqlite_api.client.get("/readyz").json() == {"status": "ready"}


def test_readyz_is_503_when_the_database_is_gone(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'missing-dir' / 'db.sqlite'}"
    with TestClient(create_app(Settings(database_url=url, migrate_on_start=False))) as client:
        assert client.get("/healthz").status_code == 200
        response = client.get("/readyz")
        assert response.status_code == 503
        assert response.json()["error"] == "not_ready"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SPILLWAY_MAX_BODY_BYTES": "-1"}, "max_body_bytes"),
        ({"SPILLWAY_STALE_AFTER_S": "0"}, "stale_after_s"),
        ({"SPILLWAY_DATABASE_URL": "mysql://x"}, "SPILLWAY_DATABASE_URL"),
        ({"SPILLWAY_DATABASE_URL": "postgresq://x"}, "SPILLWAY_DATABASE_URL"),
        ({"SPILLWAY_TLS_CERTFILE": "/x.pem"}, "SPILLWAY_TLS_KEYFILE"),
        ({"SPILLWAY_ENV": "production", "SPILLWAY_HOST": "0.0.0.0"}, "SPILLWAY_HOST"),
    ],
)
def test_settings_refuse_nonsense_naming_the_variable(monkeypatch: pytest.MonkeyPatch, env: dict, named: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError) as err:
        Settings()
    assert named in str(err.value)


def test_serve_refuses_bad_settings_with_a_message_not_a_trace(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "spillway.cli", "controlplane", "serve"],
        env={"SPILLWAY_MAX_BODY_BYTES": "0", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert "SPILLWAY_MAX_BODY_BYTES" in out.stderr
    assert "Traceback" not in out.stderr


def test_both_postgres_url_spellings_are_accepted() -> None:
    for url in ("postgres://u@h/db", "postgresql://u@h/db"):
        assert Settings(database_url=url).database_url == url
