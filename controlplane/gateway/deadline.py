"""A request's deadline, from what the caller said: the `spillway-timeout-us` header (the remaining deadline an
overflowing agent sends) and the request's `timeout` parameter (Triton's convention: microseconds, 0 for none)."""

from __future__ import annotations

import orjson

from controlplane.gateway.errors import InvalidRequest


def header_length(raw: bytes | None, body_size: int) -> int | None:
    """`Inference-Header-Content-Length`: the JSON part's length in a binary request (None: all JSON)."""
    if raw is None:
        return None
    text = raw.strip()
    if not text.isdigit() or not 0 < int(text) <= body_size:
        shown = text[:40].decode("latin-1")
        raise InvalidRequest(
            f"inference-header-content-length: must be a whole number of bytes from 1 to the body's {body_size}, "
            f"got '{shown}'"
        )
    return int(text)


def timeout_header_us(raw: bytes | None) -> int | None:
    if raw is None:
        return None
    text = raw.strip()
    if not text.isdigit():
        raise InvalidRequest(
            f"spillway-timeout-us: must be a whole number of microseconds, got '{text[:40].decode('latin-1')}'"
        )
    return int(text)


def timeout_parameter_us(json_header: bytes) -> int | None:
    """The `timeout` request parameter, from the request's JSON (the whole body, or a binary request's header)."""
    try:
        request = orjson.loads(json_header)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request JSON: not valid JSON ({exc})") from None
    if not isinstance(request, dict):
        raise InvalidRequest(f"request JSON: must be an object, got {type(request).__name__}")
    parameters = request.get("parameters")
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        raise InvalidRequest("request JSON: 'parameters' must be an object")
    timeout = parameters.get("timeout")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
        raise InvalidRequest(f"parameter 'timeout' must be a non-negative integer of microseconds, got {timeout!r}")
    return timeout or None


def deadline_us(header_us: int | None, parameter_us: int | None) -> int | None:
    """The tighter of the two; None when the caller set neither (each backend's timeout_ms bounds it then)."""
    given = [t for t in (header_us, parameter_us) if t is not None]
    return min(given) if given else None
