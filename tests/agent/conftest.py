"""Fixtures for the edge agent: the demo repository built once, and a real agent process on a loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from spillway.demo.models import build_demo_repository
from tests.utils.server import free_ports


@pytest.fixture(scope="session")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_repository(tmp_path_factory.mktemp("models"))


@dataclass
class RunningAgent:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    grpc: str = ""  # host:port of its V2 gRPC endpoint

    def stats(self, version: str) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/v2/models/mlp/versions/{version}/stats", timeout=10)
        return dict(response.json()["model_stats"][0])

    def ended_job(self, job_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """`GET /spillway/v1/jobs/{id}` polled until the job is no longer queued or running."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = httpx.get(f"{self.url}/spillway/v1/jobs/{job_id}", timeout=10)
            assert job.status_code == 200, job.text
            body = dict(job.json())
            if body["status"] not in ("queued", "running"):
                return body
            assert time.monotonic() < deadline, f"job {job_id} still {body['status']} after {timeout_s:.0f} s"
            time.sleep(0.05)


def start_agent(repo: Path, workdir: Path, env: dict[str, str] | None = None, **settings: Any) -> RunningAgent:
    """`spillway agent serve` as its own process (as in production: no GIL shared with the test's clients), with
    `env` added to this process's environment."""
    port, grpc_port = free_ports(2)
    config = workdir / f"agent-{port}.yaml"
    # Each agent caches policies in its own state directory unless the test shares one (a restart); each has its own
    # gRPC port (the default, 8001, would be taken by the first).
    settings = {"state_dir": str(workdir / f"state-{port}"), "grpc_port": grpc_port, **settings}
    config.write_text(yaml.safe_dump({"model_repository": str(repo), "port": port, **settings}))
    log = workdir / f"agent-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spillway.cli", "agent", "serve", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT, env=None if env is None else {**os.environ, **env},
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    headers = {"authorization": f"Bearer {settings['token']}"} if settings.get("token") else {}
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/v2/health/ready", headers=headers, timeout=1).status_code == 200:
                grpc = f"127.0.0.1:{settings['grpc_port']}" if settings["grpc_port"] else ""
                return RunningAgent(url, proc, log, grpc)
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"agent not ready: {log.read_text()}"
        time.sleep(0.1)


def stop_agent(agent: RunningAgent) -> None:
    agent.proc.terminate()
    agent.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def agent(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningAgent]:
    """The real agent (both mlp versions, warmed up) on 127.0.0.1."""
    running = start_agent(demo_repo, tmp_path_factory.mktemp("agent"), intra_op_threads=2,
                          max_body_bytes=8 << 20, allow_non_finite=False)  # fmt: skip
    yield running
    stop_agent(running)
