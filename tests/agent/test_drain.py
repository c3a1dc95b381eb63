"""SIGTERM drains a real agent process: it stops admitting, answers everything it accepted, then exits 0."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.agent.conftest import start_agent

BODY = {"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.5] * 512}]}


def test_sigterm_answers_every_accepted_request_then_exits(demo_repo: Path, tmp_path: Path) -> None:
    agent = start_agent(demo_repo, tmp_path)
    base, proc = agent.url, agent.proc
    stop = threading.Event()
    answers: list[int] = []
    reasons: list[str] = []
    failures: list[str] = []
    closing: list[str | None] = []  # the Connection header of each `draining` answer
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=base, timeout=30) as c:
            while not stop.is_set():
                try:
                    r = c.post("/v2/models/mlp/versions/1/infer", json=BODY)
                except httpx.TransportError as exc:  # an accepted request must never just vanish
                    with lock:
                        failures.append(repr(exc))
                    return
                with lock:
                    answers.append(r.status_code)
                    if r.status_code == 503:
                        reasons.append(r.json()["reason"])
                        if reasons[-1] == "draining":
                            closing.append(r.headers.get("connection"))
                            return

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # a steady load of 8 concurrent clients
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    code = proc.wait(timeout=60)
    output = agent.log.read_text()
    assert failures == [], output
    assert code == 0, output
    assert "drained" in output
    assert set(answers) <= {200, 503} and answers.count(200) > 8
    assert set(reasons) <= {"draining", "timeout"}  # timeout: a queue deadline passed under this 2-core load
    assert closing and set(closing) == {"close"}  # no client keeps a connection the agent is about to close
