"""The agent's overflow forwarder against a real HTTP server playing the gateway (tests/utils/faulty_backend.py): an
answer that lands just after the deadline, as on a machine whose cores are busy, is an answer and no failure in the
breaker; silence past the grace is a failure. Streams (generative answers) are handed over with their first bytes and
give the breaker one verdict; their server-sent events are split as they complete."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from edge_agent.overflow.breaker import BreakerConfig
from edge_agent.overflow.forward import LATE_GRACE_S, Forwarded, Forwarder, NotForwarded
from edge_agent.overflow.stream import ForwardedStream, SseEvents
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


def test_a_stream_is_handed_over_with_its_first_bytes_and_ends_with_one_verdict(gateway: Faulty) -> None:
    gateway.set(mode="ok")

    async def run() -> tuple[Forwarder, list[int], bytes]:
        forwarder = Forwarder(gateway.url, "agent-token", breaker=BreakerConfig(min_requests=2, stat_interval_s=60))
        try:
            opened = await forwarder.open_stream(PATH, MLP_REQUEST, {"content-type": "application/json"}, 1.0)
            assert isinstance(opened, ForwardedStream), opened
            in_flight = [forwarder.in_flight]
            body = await opened.read_all(1 << 20)
            opened.finish(True)
            opened.finish(False)  # only the first end counts
            in_flight.append(forwarder.in_flight)
        finally:
            await forwarder.close()
        return forwarder, in_flight, body

    forwarder, in_flight, body = asyncio.run(run())
    assert in_flight == [1, 0] and body.startswith(b"{")
    assert forwarder.breaker.json()["requests"] == 1 and forwarder.breaker.json()["errors"] == 0


def test_a_stream_without_a_first_byte_in_time_is_not_handed_over(gateway: Faulty) -> None:
    gateway.set(mode="hang")

    async def run() -> tuple[ForwardedStream | NotForwarded, int]:
        forwarder = Forwarder(gateway.url, "agent-token", breaker=BreakerConfig(min_requests=2, stat_interval_s=60))
        try:
            return await forwarder.open_stream(PATH, MLP_REQUEST, {}, 0.05), forwarder.in_flight
        finally:
            await forwarder.close()

    try:
        opened, in_flight = asyncio.run(run())
    finally:
        gateway.set(mode="ok")
    assert isinstance(opened, NotForwarded) and opened.reason == "gateway_timeout" and in_flight == 0


def test_server_sent_events_are_split_as_they_complete_whatever_the_line_ends() -> None:
    events = SseEvents()
    assert events.feed(b'data: {"a": 1}\r') == []
    assert events.feed(b"\n\r\ndata: [DO") == [(b'data: {"a": 1}\n\n', '{"a": 1}')]
    assert events.feed(b"NE]\n\n: a comment\n\n") == [(b"data: [DONE]\n\n", "[DONE]"), (b": a comment\n\n", None)]
    assert events.pending == b""
    assert events.feed(b"data: one\ndata: two\n\nda") == [(b"data: one\ndata: two\n\n", "one\ntwo")]
    assert events.pending == b"da"
