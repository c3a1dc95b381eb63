"""The standard OpenTelemetry environment variables the agent honours, read as the SDK documents them
(https://opentelemetry.io/docs/specs/otel/protocol/exporter/ and .../configuration/sdk-environment-variables/):

- OTEL_EXPORTER_OTLP_METRICS_ENDPOINT: the metrics URL, used as is; else OTEL_EXPORTER_OTLP_ENDPOINT, a base URL to
  which http/protobuf appends `/v1/metrics` (grpc uses it as is). Neither set: no OTLP destination from the
  environment (the SDK would default to localhost; the agent exports nowhere it was not told to).
- OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL: `http/protobuf` (default) or `grpc` (spillway[otlp-grpc]).
- OTEL_EXPORTER_OTLP_[METRICS_]HEADERS: `key=value,...` (values URL-decoded), the signal-specific variable replacing
  the generic one. They are secrets: never logged, and never sent to the control plane.
- OTEL_RESOURCE_ATTRIBUTES (and OTEL_SERVICE_NAME, as the SDK reads them): merged into the resource; the agent's
  own attributes win.
- OTEL_METRIC_EXPORT_INTERVAL: milliseconds.

A value the agent cannot use is refused (ValueError naming the variable, never its value: a header may be a key)."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import unquote

ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
HEADERS = "OTEL_EXPORTER_OTLP_HEADERS"
METRICS_HEADERS = "OTEL_EXPORTER_OTLP_METRICS_HEADERS"
PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
METRICS_PROTOCOL = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
SERVICE_NAME = "OTEL_SERVICE_NAME"
EXPORT_INTERVAL = "OTEL_METRIC_EXPORT_INTERVAL"

HTTP_PROTOBUF = "http/protobuf"
GRPC = "grpc"
PROTOCOLS = (HTTP_PROTOBUF, GRPC)
METRICS_PATH = "/v1/metrics"


def _get(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of `names` set to something other than blanks, with its value (the SDK treats empty as unset)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def protocol(env: Mapping[str, str]) -> str:
    found = _get(env, METRICS_PROTOCOL, PROTOCOL)
    if found is None:
        return HTTP_PROTOBUF
    name, value = found
    if value not in PROTOCOLS:
        raise ValueError(f"{name}={value}: the agent exports metrics over {' or '.join(PROTOCOLS)}")
    return value


def endpoint(env: Mapping[str, str], protocol_: str) -> str | None:
    """The metrics endpoint the variables name, or None."""
    found = _get(env, METRICS_ENDPOINT)
    if found is not None:
        return found[1]
    found = _get(env, ENDPOINT)
    if found is None:
        return None
    return found[1] if protocol_ == GRPC else found[1].rstrip("/") + METRICS_PATH


def headers(env: Mapping[str, str]) -> dict[str, str]:
    """OTEL_EXPORTER_OTLP_METRICS_HEADERS, else OTEL_EXPORTER_OTLP_HEADERS; names lower-cased (as HTTP/2 and gRPC
    metadata want them)."""
    found = _get(env, METRICS_HEADERS, HEADERS)
    if found is None:
        return {}
    return {key.lower(): value for key, value in _pairs(found[0], found[1], what="header").items()}


def resource_attributes(env: Mapping[str, str]) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES, with OTEL_SERVICE_NAME as service.name (which the agent's own name wins over)."""
    attributes: dict[str, str] = {}
    found = _get(env, RESOURCE_ATTRIBUTES)
    if found is not None:
        attributes.update(_pairs(found[0], found[1], what="attribute"))
    service = _get(env, SERVICE_NAME)
    if service is not None:
        attributes["service.name"] = service[1]
    return attributes


def export_interval_s(env: Mapping[str, str]) -> float | None:
    found = _get(env, EXPORT_INTERVAL)
    if found is None:
        return None
    name, value = found
    try:
        millis = float(value)
    except ValueError:
        raise ValueError(f"{name}={value}: expected the export interval in milliseconds") from None
    if not millis > 0 or millis == float("inf"):
        raise ValueError(f"{name}={value}: the export interval must be a positive number of milliseconds")
    return millis / 1000


def _pairs(name: str, value: str, *, what: str) -> dict[str, str]:
    """`key=value,key=value` (W3C Baggage style; values URL-decoded). A malformed item is refused, named by its
    position only."""
    pairs: dict[str, str] = {}
    for position, item in enumerate(value.split(","), 1):
        if not item.strip():
            continue
        key, equals, raw = item.partition("=")
        key = unquote(key).strip()
        if not equals or not key:
            raise ValueError(f"{name}: {what} {position} is not key=value (comma-separated, values URL-encoded)")
        pairs[key] = unquote(raw).strip()
    return pairs
