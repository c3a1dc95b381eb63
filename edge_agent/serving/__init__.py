"""The agent's HTTP side. Its modules, imported by name (this package imports none of them, so that a module that
needs only `models` does not pay for the server):

- `server`: builds the registry and the `Agent` (app, policy applier, telemetry, overflow, async queue) and serves;
- `app`: the ASGI app: health, metadata, statistics, jobs, and inference through the pipeline;
- `pipeline`: one inference request, decode -> admission verdict -> scheduler | overflow -> one outcome;
- `admission`: the frozen admission verdicts, pure functions of the policy and the scheduler's refusal;
- `models`: the registry of loaded model versions and the variant routing.
"""

__all__ = ["admission", "app", "models", "pipeline", "server"]
