"""What the gateway answers itself (rather than passing on a backend's answer): one status and one stable code each.
The gateway uses the control plane's own classes (`controlplane.errors`) for what any endpoint refuses, and adds
its refusals:

SpillwayError (controlplane.errors)
├── Unauthenticated       401 unauthenticated      (no or an invalid agent token), with WWW-Authenticate: Bearer
├── Forbidden             403 forbidden            (an operator's API key: the gateway is for agents)
├── InvalidRequest        400 invalid_request      (a malformed deadline, JSON header or version)
│   └── InvalidModelName  400 invalid_model_name   (a model name no backend can register: NUL, '/', spaces, ...)
├── PayloadTooLarge       413 payload_too_large
└── GatewayError                                   (the gateway's own)
    ├── Refusal                                    (no backend can take the request now; retried nowhere)
    │   ├── NoBackend         503 no_backend           (none is registered for the model)
    │   ├── NoHealthyBackend  503 no_healthy_backend   (all are failing their checks or ejected)
    │   ├── NoCapacity        503 no_capacity          (all are at their max_concurrency)
    │   └── TenantQuota       429 tenant_quota         (the request's tenant holds its share of every backend with
    │                                                   room: `tenant_share`), with Retry-After
    ├── BackendUnavailable    502 backend_unavailable  (every attempt failed)
    ├── BadBackendResponse    502 bad_backend_response (a JSON-only backend's answer could not be translated back)
    └── DeadlineExceeded      504 deadline_exceeded

Each is answered as the rest of the control plane answers errors: `{"error": code, "message": text, "details": ...}`,
with the code also in the `spillway-reason` header.
"""

from __future__ import annotations

from controlplane.errors import Forbidden, InvalidRequest, PayloadTooLarge, SpillwayError, Unauthenticated

__all__ = [
    "BackendUnavailable",
    "BadBackendResponse",
    "DeadlineExceeded",
    "Forbidden",
    "GatewayError",
    "InvalidModelName",
    "InvalidRequest",
    "NoBackend",
    "NoCapacity",
    "NoHealthyBackend",
    "PayloadTooLarge",
    "Refusal",
    "TenantQuota",
    "Unauthenticated",
]


class GatewayError(SpillwayError):
    """A refusal of the gateway's own, in the control plane's error shape (`{"error", "message", "details"}`)."""


class InvalidModelName(InvalidRequest):
    code = "invalid_model_name"


class Refusal(GatewayError):
    status_code = 503


class NoBackend(Refusal):
    code = "no_backend"


class NoHealthyBackend(Refusal):
    code = "no_healthy_backend"


class NoCapacity(Refusal):
    code = "no_capacity"


class BackendUnavailable(GatewayError):
    status_code = 502
    code = "backend_unavailable"


class BadBackendResponse(GatewayError):
    status_code = 502
    code = "bad_backend_response"


class DeadlineExceeded(GatewayError):
    status_code = 504
    code = "deadline_exceeded"


class TenantQuota(Refusal):
    """The request's tenant (`spillway-tenant`) holds its `tenant_share` of every backend that has room for it."""

    status_code = 429
    code = "tenant_quota"
