"""For the policy tests: a real policy endpoint on loopback (the control plane's contract), model repositories
made from the demo models with other version policies, and request bodies."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response

from spillway.demo.models import CONFIG_PBTXT

AGENT_ID = "edge-test-1"
TOKEN = "spa_edge-test-1_secret"


class PolicyServer:
    """`GET /api/v1/agents/{id}/policy` as the control plane serves it: bearer token, strong ETag (quoted sha256),
    If-None-Match -> 304, 401 for a bad token, 403 for another agent. Also accepts OTLP metrics (and drops them)."""

    def __init__(self, agent_id: str = AGENT_ID, token: str = TOKEN) -> None:
        self.agent_id = agent_id
        self.token = token
        self.body = b""
        self.failing: int | None = None  # answer every poll with this status
        self.etags = True  # False: a server that sends no ETag and ignores If-None-Match
        self.seen: list[str | None] = []  # If-None-Match of each poll
        self._lock = threading.Lock()
        self.app = FastAPI()
        self.app.get("/api/v1/agents/{agent_id}/policy")(self._policy)
        self.app.post("/v1/metrics")(self._metrics)

    def publish(self, document: dict[str, Any] | bytes) -> str:
        """Serve `document` from now on; returns its ETag."""
        with self._lock:
            self.body = document if isinstance(document, bytes) else json.dumps(document).encode()
            return self.etag

    @property
    def etag(self) -> str:
        return f'"{hashlib.sha256(self.body).hexdigest()}"'

    async def _policy(self, agent_id: str, request: Request) -> Response:
        with self._lock:
            self.seen.append(request.headers.get("if-none-match"))
            if request.headers.get("authorization") != f"Bearer {self.token}":
                return Response(b'{"error":"unauthenticated"}', 401, media_type="application/json")
            if agent_id != self.agent_id:
                return Response(b'{"error":"forbidden"}', 403, media_type="application/json")
            if self.failing is not None:
                return Response(b'{"error":"down"}', self.failing, media_type="application/json")
            if not self.etags:
                return Response(self.body, 200, media_type="application/json")
            if request.headers.get("if-none-match") == self.etag:
                return Response(status_code=304, headers={"ETag": self.etag})
            return Response(self.body, 200, media_type="application/json", headers={"ETag": self.etag})

    async def _metrics(self) -> Response:
        return Response(b"", 200, media_type="application/x-protobuf")


def document(version: int, agent: str = AGENT_ID, **models: dict[str, Any]) -> dict[str, Any]:
    """A policy document; keyword `all` is the `*` entry."""
    entries = {("*" if name == "all" else name): entry for name, entry in models.items()}
    return {"format": 1, "agent": agent, "version": version, "models": entries}


def make_repository(demo_repo: Path, out: Path, *, versions: tuple[int, ...] = (1, 2), deadlines: bool = True) -> Path:
    """The demo model under `out`, serving only `versions` (the others stay on disk as variants); without
    `deadlines` no priority level has a default timeout (so a test's load is never refused for time)."""
    model_dir = out / "mlp"
    for version in (1, 2):
        (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
        source, target = demo_repo / "mlp" / str(version) / "model.onnx", model_dir / str(version) / "model.onnx"
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
    config = CONFIG_PBTXT.replace(
        "version_policy { all { } }", f"version_policy {{ specific {{ versions: {list(versions)} }} }}"
    )
    if not deadlines:
        config = config.replace("default_timeout_microseconds: 100000", "default_timeout_microseconds: 0")
        config = config.replace("default_timeout_microseconds: 1000000", "default_timeout_microseconds: 0")
    assert config != CONFIG_PBTXT or versions == (1, 2)
    (model_dir / "config.pbtxt").write_text(config)
    return out


def infer_body(x: np.ndarray, **parameters: object) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    if parameters:
        body["parameters"] = parameters
    return body


def default_output(value: float = 0.5, shape: tuple[int, ...] = (1000,), **over: Any) -> list[dict[str, Any]]:
    count = int(np.prod(shape))
    return [{"name": "output", "datatype": "FP32", "shape": list(shape), "data": [value] * count, **over}]
