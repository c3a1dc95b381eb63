"""Policy documents on the agent (the document itself is the shared contract, `spillway.contract.policy`): what one
means for the served models (`plan`), applying it live (`apply`), polling the control plane (`client`), and the
last good one on disk (`cache`). Imported by module; this package imports none of them."""

__all__ = ["apply", "cache", "client", "plan"]
