"""SIGTERM on a real control-plane process while agents overflow through its gateway on keep-alive connections:
every request it read is answered (the ones in flight at the backend included), its listener closes (later
connections are refused), each connection closes only between two requests, and it exits 0."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from spillway.demo.story import Story
from tests.utils.builders import make_agent, make_backend
from tests.utils.gateway import MLP_REQUEST, start_faulty, wait_for
from tests.utils.keepalive import KeepAliveLoad
from tests.utils.server import free_port


def test_sigterm_answers_every_gateway_request_it_read_then_exits(tmp_path: Path) -> None:
    backend = start_faulty("cloud")
    backend.set(mode="slow", delay_ms=5)  # requests are in flight at the backend when the signal comes
    story = Story(tmp_path, port=free_port(), agent_port=free_port())
    try:
        with story:
            admin = {"Authorization": f"Bearer {story.prepare()}"}
            story.start_control_plane()
            with httpx.Client(base_url=story.base, headers=admin, timeout=30) as api:
                token = api.post("/api/v1/agents", json=make_agent()).json()["token"]
                body = make_backend(url=backend.url, binary_tensors=True, max_concurrency=64, timeout_ms=10_000)
                assert api.post("/api/v1/backends", json=body).status_code == 201
            agent = {"Authorization": f"Bearer {token}"}
            url = f"{story.base}/v2/models/mlp/infer"
            wait_for(lambda: httpx.post(url, content=MLP_REQUEST, headers=agent, timeout=10).status_code == 200,
                     timeout_s=30)  # fmt: skip
            with KeepAliveLoad(url, MLP_REQUEST, clients=16, headers=agent) as load:
                load.wait_answers(200)
                assert story.cp is not None
                story.cp.send_signal(signal.SIGTERM)
                fates = load.join()
            code = story.cp.wait(timeout=60)
            output = story.cp_log.read_text()
            assert fates.lost == [], output
            assert code == 0, output
            assert "listener closed" in output
            assert fates.refused == 16  # every client ended on a refused connection, none on a cut one
            assert set(fates.answers) == {(200, "")} and fates.answered >= 200
    finally:
        backend.proc.terminate()
        backend.proc.wait(timeout=10)
