"""SIGTERM drains a real agent process under keep-alive load: it stops admitting, answers every request it read
(200, or 503 `draining` with `Connection: close`), closes its listener (later connections are refused) and each
connection only between two requests, then exits 0."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import orjson

from tests.agent.conftest import start_agent
from tests.utils.keepalive import KeepAliveLoad

BODY = orjson.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.5] * 512}]})


def test_sigterm_answers_every_request_it_read_then_exits(demo_repo: Path, tmp_path: Path) -> None:
    agent = start_agent(demo_repo, tmp_path)
    # 16 clients that go on after `draining` (a new connection each time) until the agent refuses one.
    with KeepAliveLoad(f"{agent.url}/v2/models/mlp/versions/1/infer", BODY, clients=16) as load:
        load.wait_answers(200)  # a steady keep-alive load
        os.kill(agent.proc.pid, signal.SIGTERM)
        fates = load.join()
    code = agent.proc.wait(timeout=60)
    output = agent.log.read_text()
    assert fates.lost == [], output
    assert code == 0, output
    assert "drained" in output and "listener closed" in output
    assert fates.refused == 16  # every client ended on a refused connection, none on a cut one
    statuses = {status for status, _ in fates.answers}
    assert statuses <= {200, 503} and fates.count(200) >= 200
    # timeout: a queue deadline passed under this 2-core load
    assert {reason for status, reason in fates.answers if status == 503} <= {"draining", "timeout"}
    assert fates.closing and set(fates.closing) == {"close"}  # no client keeps a connection the agent will close
