"""For the gateway's tests: a real control plane on loopback with an enrolled agent, and faulty backends as
separate processes (tests/utils/faulty_backend.py)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from controlplane.app import create_app
from controlplane.settings import Settings
from spillway.demo.harness import Process
from tests.conftest import make_keys
from tests.utils.builders import make_agent, make_backend
from tests.utils.server import free_port, serving

MLP_REQUEST = orjson.dumps(
    {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [0.5, 1.5, 2.5, 3.5]}]}
)


@dataclass
class Faulty:
    """One faulty backend process; `set(mode=..., status=..., delay_ms=..., ready=...)` changes its behaviour."""

    name: str
    url: str
    proc: Process

    def set(self, **change: Any) -> None:
        httpx.post(f"{self.url}/control", json=change, timeout=5).raise_for_status()

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/stats", timeout=5).json())


def start_faulty(name: str) -> Faulty:
    """A faulty backend process (its output with the tests'), once it answers; the caller stops it."""
    port = free_port()
    command = [sys.executable, "-m", "tests.utils.faulty_backend", "--port", str(port), "--name", name]
    proc = Process.start(command, name=f"faulty backend {name}")
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_ready(f"{url}/stats", status=None, timeout_s=30, interval_s=0.02)
    except BaseException:
        proc.stop()
        raise
    return Faulty(name, url, proc)


@dataclass
class Plane:
    """A control plane with an admin key and one enrolled agent's token."""

    url: str
    admin: str
    token: str
    app: Any
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30))

    @property
    def operator(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin}"}

    @property
    def agent(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def register(self, backend_url: str, **over: Any) -> dict[str, Any]:
        body = make_backend(url=backend_url, **{"binary_tensors": True, "max_concurrency": 64, **over})
        created = self.client.post(f"{self.url}/api/v1/backends", json=body, headers=self.operator)
        assert created.status_code == 201, created.text
        return dict(created.json())

    def infer(self, body: bytes = MLP_REQUEST, model: str = "mlp", **headers: str) -> httpx.Response:
        return self.client.post(f"{self.url}/v2/models/{model}/infer", content=body, headers={**self.agent, **headers})

    def get(self, path: str, **params: Any) -> Any:
        response = self.client.get(f"{self.url}{path}", params=params, headers=self.operator)
        assert response.status_code == 200, response.text
        return response.json() if "json" in response.headers.get("content-type", "") else response.text

    def gateway(self) -> dict[str, dict[str, Any]]:
        """The gateway section of the fleet status, by backend name."""
        return {b["name"]: b for b in self.get("/api/v1/status")["gateway"]["backends"]}

    def events(self, kind: str) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/events", kind=kind)["items"])


@contextmanager
def running_plane(db_url: str, **settings: Any) -> Iterator[Plane]:
    admin = make_keys(db_url)["admin"]
    settings = {"control_loop_interval_s": 0, "gateway_health_interval_s": 0.2, **settings}
    app = create_app(Settings(database_url=db_url, **settings))
    with serving(app) as url:
        headers = {"Authorization": f"Bearer {admin}"}
        created = httpx.post(f"{url}/api/v1/agents", json=make_agent(), headers=headers, timeout=30)
        plane = Plane(url, admin, created.json()["token"], app)
        try:
            yield plane
        finally:
            plane.client.close()


def wait_for(condition: Any, timeout_s: float = 10.0, every_s: float = 0.02) -> Any:
    """Poll `condition` until it returns something truthy (returned), or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(every_s)
