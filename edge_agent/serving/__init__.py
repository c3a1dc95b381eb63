"""The agent's serving side. Its modules, imported by name (this package imports none of them, so that a module that
needs only `models` does not pay for the server):

- `server`: builds the registry and the `Agent` (app, policy applier, telemetry, overflow, async queue) and serves
  HTTP and gRPC;
- `app`: the ASGI app: health, metadata, config, statistics, jobs, the repository extension, /metrics, and inference
  through the pipeline;
- `pipeline`: one inference request, decode -> admission verdict -> scheduler | overflow -> one outcome;
- `admission`: the frozen admission verdicts, pure functions of the policy and the scheduler's refusal;
- `models`: the registry of loaded model versions and the variant routing;
- `repository_api`: Triton's repository extension (index, load, unload), loads following the active policy;
- `triton_config`: a model's config as Triton returns it (`GET /v2/models/{m}/config`);
- `grpc_server`: Triton's GRPCInferenceService, every call answered by the app in-process;
- `grpc_generate`: Triton's generate extension on ModelStreamInfer (a generative model's request and its events);
- `ports`: which ports are served beside HTTP, checked before the models load, and their listeners;
- `legacy_port`: the 0.1 HTTP port (8001), shared with gRPC for one release;
- `openai_api`: the OpenAI-compatible API and Triton's generate extension of the generative models.
"""

__all__ = ["admission", "app", "grpc_generate", "grpc_server", "legacy_port", "models", "openai_api", "pipeline",
           "ports", "repository_api", "server", "triton_config"]  # fmt: skip
