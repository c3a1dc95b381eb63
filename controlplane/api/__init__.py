"""The REST policy API's routers and their dependencies (authentication, roles, limits, errors). `controlplane.app`
mounts them; imported by module."""

__all__ = ["access", "agent_metrics", "auth", "deps", "errors", "events", "ingest", "limits", "methods", "monitoring",
           "policy", "resources", "rule_status", "slo_status", "status"]  # fmt: skip
