"""The request parsing both sides share (`spillway.contract.v2`): one rule for each header and parameter, whether the
agent or the gateway reads it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from spillway.contract import v2


def test_header_length_is_a_length_inside_the_body() -> None:
    assert v2.parse_header_length(None, 10) is None
    assert v2.parse_header_length(b"10", 10) == 10 and v2.parse_header_length(b" 4 ", 10) == 4
    for raw in (b"0", b"11", b"-1", b"4.0", b"", b"abc"):
        with pytest.raises(v2.TensorError, match="inference-header-content-length"):
            v2.parse_header_length(raw, 10)


def test_the_deadline_budget_is_whole_microseconds_and_at_least_one() -> None:
    assert v2.parse_timeout_budget_us(None) is None
    assert v2.parse_timeout_budget_us(b"250000") == 250000
    assert v2.parse_timeout_budget_us(b"0") == 1  # nothing left: refused as too late, never "no deadline"
    with pytest.raises(v2.TensorError, match="spillway-timeout-us"):
        v2.parse_timeout_budget_us(b"-5")


def test_scheduling_parameters_follow_triton() -> None:
    assert v2.scheduling_parameters({}) == (0, None)
    assert v2.scheduling_parameters({"priority": 2, "timeout": 0}) == (2, None)  # a timeout of 0 is none
    assert v2.scheduling_parameters({"timeout": 1500}) == (0, 1500)
    for bad in ({"priority": -1}, {"priority": True}, {"priority": "high"}, {"timeout": -1}, {"timeout": 1.5}):
        with pytest.raises(v2.TensorError, match="priority" if "priority" in bad else "timeout"):
            v2.scheduling_parameters(bad)
    # A proxy reads the timeout alone: a priority the serving side would refuse is not the proxy's to judge.
    assert v2.timeout_parameter_us({"priority": "high", "timeout": 7}) == 7


def test_the_tighter_deadline_wins() -> None:
    assert v2.deadline_us(None, None) is None
    assert v2.deadline_us(250, None) == 250 and v2.deadline_us(None, 100) == 100
    assert v2.deadline_us(250, 100) == 100


def _receiver(*chunks: bytes, disconnect: bool = False) -> Any:
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    if disconnect:
        messages = [*messages[:1], {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    return receive


def test_a_body_is_read_whole_and_refused_over_the_limit() -> None:
    async def read(receive: Any, declared: bytes | None, limit: int) -> bytes:
        return await v2.read_body(receive, declared, limit)

    assert asyncio.run(read(_receiver(b"ab", b"", b"cd"), None, 4)) == b"abcd"
    assert asyncio.run(read(_receiver(b""), None, 4)) == b""
    with pytest.raises(v2.BodyTooLarge, match="exceeds 4 bytes"):
        asyncio.run(read(_receiver(b"abc", b"de"), None, 4))  # found while reading
    with pytest.raises(v2.BodyTooLarge):
        asyncio.run(read(_receiver(b"x"), b"5", 4))  # said by Content-Length: nothing is read
    with pytest.raises(v2.ClientGone):
        asyncio.run(read(_receiver(b"ab", b"cd", disconnect=True), None, 4))
