"""The agent's overflow forwarder against a real HTTP server playing the gateway (tests/utils/faulty_backend.py): an
answer that lands just after the deadline, as on a machine whose cores are busy, is an answer and no failure in the
breaker; silence past the grace is a failure."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from edge_agent.overflow.breaker import BreakerConfig
from edge_agent.overflow.forward import LATE_GRACE_S, Forwarded, Forwarder, NotForwarded
from tests.utils.gateway import MLP_REQUEST, Faulty, start_faulty

PATH = "/v2/models/mlp/infer"


@pytest.fixture(scope="module")
def gateway() -> Iterator[Faulty]:
    faulty = start_faulty("gateway")
    yield faulty
    faulty.proc.terminate()
    faulty.proc.wait(timeout=10)


def forward(gateway: Faulty, remaining_s: float, times: int = 1) -> tuple[list[Forwarded | NotForwarded], Forwarder]:
    async def run() -> tuple[list[Forwarded | NotForwarded], Forwarder]:
        forwarder = Forwarder(gateway.url, "agent-token", breaker=BreakerConfig(min_requests=2, stat_interval_s=60))
        try:
            results = [await forwarder.forward(PATH, MLP_REQUEST, {}, remaining_s) for _ in range(times)]
        finally:
            await forwarder.close()
        return results, forwarder

    return asyncio.run(run())


def test_an_answer_just_after_the_deadline_is_taken_and_is_no_failure(gateway: Faulty) -> None:
    gateway.set(mode="slow", delay_ms=130)  # 30 ms after the 100 ms deadline: inside the grace
    results, forwarder = forward(gateway, 0.100, times=3)
    assert all(isinstance(r, Forwarded) for r in results), results
    assert forwarder.breaker.state == "closed" and forwarder.breaker.json()["errors"] == 0
    assert forwarder.answered == 3


def test_silence_past_the_grace_is_a_gateway_failure_and_opens_the_breaker(gateway: Faulty) -> None:
    gateway.set(mode="hang")
    try:
        results, forwarder = forward(gateway, 0.050, times=2)
    finally:
        gateway.set(mode="ok")
    assert [r.reason for r in results if isinstance(r, NotForwarded)] == ["gateway_timeout"] * 2
    assert f"within {(0.050 + LATE_GRACE_S) * 1e3:.0f} ms" in results[0].message  # type: ignore[union-attr]
    assert forwarder.breaker.state == "open"
