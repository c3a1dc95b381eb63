"""Domain errors of the control plane, each mapped to one HTTP status and a stable error code.

SpillwayError
├── NotFound              404 not_found
├── ValidationFailed      422 validation_error
│   └── DuplicateName     422 duplicate_name
├── Conflict              409 conflict
├── PreconditionFailed    412 precondition_failed
├── Unauthenticated       401 unauthenticated
├── Forbidden             403 forbidden
├── InvalidRequest        400 invalid_request         (a malformed request the API cannot even validate)
├── PayloadTooLarge       413 payload_too_large
├── UndecodableMetrics    400 bad_request             (OTLP ingest)
├── UnsupportedMediaType  415 unsupported_media_type  (OTLP ingest)
└── Overloaded            503 overloaded, with Retry-After

The overflow gateway adds its own refusals (controlplane/gateway/errors.py); every class maps to its status and body
in one place, `controlplane/api/errors.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class SpillwayError(Exception):
    """Base of every error the API answers with `{"error", "message", "details"}`."""

    status_code = 500
    code = "internal_error"

    def __init__(self, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class NotFound(SpillwayError):
    status_code = 404
    code = "not_found"


class ValidationFailed(SpillwayError):
    status_code = 422
    code = "validation_error"

    @classmethod
    def field(cls, field: str, message: str) -> ValidationFailed:
        return cls(f"{field}: {message}", details=[{"field": field, "message": message}])

    @classmethod
    def of(
        cls, errors: Iterable[Mapping[str, Any]], *, lead: str = "", under: tuple[str, ...] = ()
    ) -> ValidationFailed:
        """pydantic's errors, each named by its field (`under` + its location, e.g. `body.window`), the first one in
        the message after `lead`."""
        details = [{"field": ".".join(map(str, (*under, *err["loc"]))) or "body", "message": err["msg"]}
                   for err in errors]  # fmt: skip
        first = details[0] if details else {"field": "body", "message": "invalid"}
        more = f" (and {len(details) - 1} more)" if len(details) > 1 else ""
        return cls(f"{lead}{first['field']}: {first['message']}{more}", details=details)


class DuplicateName(ValidationFailed):
    code = "duplicate_name"


class Conflict(SpillwayError):
    status_code = 409
    code = "conflict"


class PreconditionFailed(SpillwayError):
    status_code = 412
    code = "precondition_failed"


class Unauthenticated(SpillwayError):
    status_code = 401
    code = "unauthenticated"


class Forbidden(SpillwayError):
    status_code = 403
    code = "forbidden"


class InvalidRequest(SpillwayError):
    status_code = 400
    code = "invalid_request"


class PayloadTooLarge(SpillwayError):
    status_code = 413
    code = "payload_too_large"


class UndecodableMetrics(SpillwayError):
    status_code = 400
    code = "bad_request"


class UnsupportedMediaType(SpillwayError):
    status_code = 415
    code = "unsupported_media_type"


class Overloaded(SpillwayError):
    status_code = 503
    code = "overloaded"
