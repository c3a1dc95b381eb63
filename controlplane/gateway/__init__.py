"""The overflow gateway: forwards Open Inference Protocol requests from edge agents to cloud backends, and relays
OpenAI-compatible completions to `openai` backends stream by stream, with backend choice, active readiness checks,
passive outlier ejection and retries (docs/overflow/gateway.md).

`create_app` makes one `Gateway` (`app.state.gateway`) and puts a `GatewayDispatcher` outermost; the lifespan
starts and closes it.
"""

from controlplane.gateway.backend import BackendSpec, BackendState, Transition
from controlplane.gateway.budget import RetryBudget
from controlplane.gateway.catalog import BackendCatalog
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.dispatch import GatewayDispatcher, gateway_router, infer_target
from controlplane.gateway.errors import (
    BackendUnavailable,
    BadBackendResponse,
    DeadlineExceeded,
    Forbidden,
    GatewayError,
    InvalidRequest,
    NoBackend,
    NoCapacity,
    NoHealthyBackend,
    PayloadTooLarge,
    Refusal,
    TenantQuota,
    Unauthenticated,
)
from controlplane.gateway.forward import Gateway
from controlplane.gateway.outlier import OutlierDetector, OutlierPolicy
from controlplane.gateway.picker import BackendPicker, PowerOfTwoChoices, WeightedRandom, make_picker
from controlplane.gateway.pool import BackendPool
from controlplane.gateway.readiness import ReadinessPolicy
from controlplane.gateway.relay import OpenAIRelay
from controlplane.gateway.tokens import AgentTokens, TokenCache

__all__ = [
    "AgentTokens",
    "BackendCatalog",
    "BackendPicker",
    "BackendPool",
    "BackendSpec",
    "BackendState",
    "BackendUnavailable",
    "BadBackendResponse",
    "DeadlineExceeded",
    "Forbidden",
    "Gateway",
    "GatewayConfig",
    "GatewayDispatcher",
    "GatewayError",
    "InvalidRequest",
    "NoBackend",
    "NoCapacity",
    "NoHealthyBackend",
    "OpenAIRelay",
    "OutlierDetector",
    "OutlierPolicy",
    "PayloadTooLarge",
    "PowerOfTwoChoices",
    "ReadinessPolicy",
    "Refusal",
    "RetryBudget",
    "TenantQuota",
    "TokenCache",
    "Transition",
    "Unauthenticated",
    "WeightedRandom",
    "gateway_router",
    "infer_target",
    "make_picker",
]
