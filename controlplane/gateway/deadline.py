"""A request as the gateway reads it: its body, its JSON header's length and its deadline, with the parsing the agent
uses too (`spillway.contract.v2`): the `spillway-timeout-us` header (the remaining deadline an overflowing agent sends)
and the request's `timeout` parameter (Triton's convention: microseconds, 0 for none). A malformed one is the
gateway's 400 `invalid_request`; a body over the limit its 413."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from controlplane.errors import InvalidRequest, PayloadTooLarge
from spillway.contract import v2


def _invalid(exc: v2.TensorError) -> InvalidRequest:
    return InvalidRequest(str(exc))


def header_length(raw: bytes | None, body_size: int) -> int | None:
    """`Inference-Header-Content-Length`: the JSON part's length in a binary request (None: all JSON)."""
    try:
        return v2.parse_header_length(raw, body_size)
    except v2.TensorError as exc:
        raise _invalid(exc) from None


def timeout_header_us(raw: bytes | None) -> int | None:
    """`spillway-timeout-us`: what is left of an overflowed request's deadline."""
    try:
        return v2.parse_timeout_budget_us(raw)
    except v2.TensorError as exc:
        raise _invalid(exc) from None


def timeout_parameter_us(json_header: bytes) -> int | None:
    """The `timeout` request parameter, from the request's JSON (the whole body, or a binary request's header)."""
    try:
        return v2.timeout_parameter_us(v2.request_parameters(json_header))
    except v2.TensorError as exc:
        raise _invalid(exc) from None


deadline_us = v2.deadline_us  # the tighter of the two; None when the caller set neither (a backend's timeout_ms)


async def read_body(receive: Callable[[], Any], declared: bytes | None, limit: int) -> bytes:
    """Raises PayloadTooLarge, or v2.ClientGone when the client left."""
    try:
        return await v2.read_body(receive, declared, limit)
    except v2.BodyTooLarge:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes", {"max_bytes": limit}) from None
