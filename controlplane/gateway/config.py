"""The gateway's knobs, taken from the control plane's settings once at start."""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.gateway.outlier import OutlierPolicy
from controlplane.gateway.readiness import ReadinessPolicy
from controlplane.settings import Settings


@dataclass(frozen=True)
class GatewayConfig:
    refresh_s: float = 2.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 1.0
    max_body_bytes: int = 1 << 20
    auth_ttl_s: float = 30.0
    max_connections: int = 1024
    retry_budget_percent: float = 20.0
    min_retry_concurrency: int = 3
    outlier: OutlierPolicy = field(default_factory=OutlierPolicy)
    readiness: ReadinessPolicy = field(default_factory=ReadinessPolicy)

    @classmethod
    def from_settings(cls, settings: Settings) -> GatewayConfig:
        return cls(
            refresh_s=settings.gateway_refresh_s,
            health_interval_s=settings.gateway_health_interval_s,
            health_timeout_s=settings.gateway_health_timeout_s,
            max_body_bytes=settings.max_body_bytes,
            auth_ttl_s=settings.gateway_auth_ttl_s,
            max_connections=settings.gateway_max_connections,
            retry_budget_percent=settings.gateway_retry_budget_percent,
            min_retry_concurrency=settings.gateway_min_retry_concurrency,
            outlier=OutlierPolicy(
                consecutive_failures=settings.gateway_consecutive_failures,
                base_ejection_s=settings.gateway_base_ejection_s,
                max_ejection_s=settings.gateway_max_ejection_s,
                max_ejection_percent=settings.gateway_max_ejection_percent,
                interval_s=settings.gateway_outlier_interval_s,
            ),
            readiness=ReadinessPolicy(
                unhealthy_threshold=settings.gateway_unhealthy_threshold,
                healthy_threshold=settings.gateway_healthy_threshold,
            ),
        )
