"""The Open Inference Protocol (KServe V2) over HTTP, as a plain ASGI app: lean enough to add well under
a millisecond to a request, with Triton's status codes and error shape. Beside inference: health, metadata,
statistics, Triton's model config and repository extension (repository_api.py), `/metrics` and async jobs.

A path no route has is answered 404; 405 (with `Allow`) only where the route exists for another method.

Every request but `/v2/health/live` is authenticated where the agent has any token (its own, or a tenant's): the
bearer token names the request's tenant (tenants/), put in `scope["spillway.tenant"]` and handed to the pipeline and
the generative APIs; a missing or unknown token is 401. gRPC goes through this app, so the same holds for it."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_agent import __version__
from edge_agent.overflow.fallback import ResponseCache
from edge_agent.overflow.forward import Forwarder
from edge_agent.overflow.jobs import StoreUnavailable
from edge_agent.runtime.repository import UnknownModelError
from edge_agent.serving.models import ModelRegistry
from edge_agent.serving.pipeline import JOBS_PREFIX, InferencePipeline, PolicyGate, reject
from edge_agent.serving.pipeline import respond as _respond
from edge_agent.serving.repository_api import (
    LoadConflict,
    LoadFailed,
    ModelControl,
    NotInRepository,
    RepositoryError,
    check_load_body,
    check_unload_body,
    parse_index_body,
)
from edge_agent.serving.triton_config import completed_config, config_json, generative_config
from edge_agent.tenants import TenantRegistry
from spillway.contract import names
from spillway.contract.tenants import DEFAULT_TENANT
from spillway.contract.v2 import BodyTooLarge, ClientGone, encode_error, read_body

if TYPE_CHECKING:
    from edge_agent.generation.pool import EnginePool
    from edge_agent.overflow.queue import AsyncQueue
    from edge_agent.serving.openai_api import OpenAIApi

log = logging.getLogger("spillway.agent")
# The headers, as ASGI carries them (bytes, lower case).
_H_JOB_STATUS = names.H_JOB_STATUS.encode()
_H_RETRY_AFTER = names.H_RETRY_AFTER.encode()
Scope = dict[str, Any]
Receive = Any
Send = Any

_UNAUTHENTICATED = {"/v2/health/live"}
_GET = ("GET", "HEAD")
_POST = ("POST",)
_CONTROL_BODY_BYTES = 1 << 20  # the repository extension's bodies are a few bytes of JSON
# A job's status that the job store cannot read now (an I/O error) is asked for again after this long.
STORE_UNAVAILABLE_RETRY_AFTER_S = 5


class InferenceApp:
    """Routes `/v2/...`: health, metadata, statistics and jobs here; inference through the pipeline."""

    def __init__(
        self,
        registry: ModelRegistry,
        *,
        token: str | None = None,
        max_body_bytes: int = 64 << 20,
        allow_non_finite: bool = True,
        policy: PolicyGate | None = None,
        responses: ResponseCache | None = None,
        status: Callable[[], dict[str, Any]] | None = None,
        forwarder: Forwarder | None = None,
        default_outputs: dict[str, dict[str, np.ndarray]] | None = None,
        jobs: AsyncQueue | None = None,
        openai: OpenAIApi | None = None,
        tenants: TenantRegistry | None = None,
    ) -> None:
        """Args beyond the obvious:
        token: the operator's bearer token (the `default` tenant's), when `tenants` is None.
        policy: overflow, shed, fallback and variant decisions per model (None: serve everything as configured).
        responses: recent successful answers, filled on every success and read by `cache` fallbacks.
        status: the body of `GET /v2/spillway/status`.
        forwarder: overflow to the control plane's gateway (None: nowhere to overflow to).
        default_outputs: per model, the outputs (one row each) answered as `fallback_default` when overflow fails.
        jobs: the async queue, the last fallback when overflow fails, for the models it accepts.
        openai: the OpenAI-compatible API of the generative models (None: none are served).
        tenants: who a token belongs to, and the tenants' quotas and ceilings (None: `token` alone, no tenants).
        """
        self.registry = registry
        self.tenants = tenants if tenants is not None else TenantRegistry([], token)
        self.status = status
        self.jobs = jobs
        self.openai = openai
        self.engines: dict[str, EnginePool] = {}  # drained with the workers on shutdown
        self.pipeline = InferencePipeline(
            registry, max_body_bytes=max_body_bytes, allow_non_finite=allow_non_finite, policy=policy,
            responses=responses, forwarder=forwarder, default_outputs=default_outputs, jobs=jobs, tenants=self.tenants,
        )  # fmt: skip
        self.ready = True
        self.unrouted: Counter[str] = Counter()  # infer requests for models that do not exist
        # `GET /metrics`: (body, content type) in the Prometheus text format (None: 404, metrics are off).
        self.metrics: Callable[[], tuple[bytes, str]] | None = None
        self.control = ModelControl(registry, registry.source, policy=policy, engines=lambda: self.engines)
        # Run at lifespan startup (before the first request: the cached policy, the poller) and shutdown.
        self.on_startup: list[Callable[[], Awaitable[None]]] = []
        self.on_shutdown: list[Callable[[], Awaitable[None]]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        send = self._closing_when_draining(send)
        path: str = scope["path"]
        headers = dict(scope["headers"])
        tenant = self.tenants.resolve(headers.get(b"authorization"))
        if tenant is None:
            if path not in _UNAUTHENTICATED:
                message = "missing or invalid bearer token"
                body = _openai_error(message, "invalid_api_key") if path.startswith("/v1/") else encode_error(message)
                await _respond(send, 401, body, extra=[(b"www-authenticate", b"Bearer")])
                return
            tenant = DEFAULT_TENANT
        scope["spillway.tenant"] = tenant
        method: str = scope["method"]
        try:
            if path.startswith("/v1/"):
                if self.openai is None:
                    await _respond(send, 404, _openai_error("this agent serves no generative model", "model_not_found"))
                else:
                    await self.openai.handle(method, path, headers, receive, send, tenant=tenant)
                return
            allowed = allowed_methods(path)
            if allowed is None:
                await _respond(send, 404, encode_error(f"no such endpoint: {path}"))
            elif method not in allowed:
                methods = ", ".join(allowed)
                await _respond(send, 405, encode_error(f"method {method} not allowed on {path}; use {allowed[0]}"),
                               extra=[(b"allow", methods.encode())])  # fmt: skip
            elif tenant != DEFAULT_TENANT and _operator_only(path):
                # Loading and unloading models, the agent's status (every tenant's traffic) and /metrics: the
                # operator's, never a tenant's (one tenant could unload what the others use).
                await _respond(send, 403, encode_error(f"{path} is the operator's: use the agent's own token"))
            elif method == "POST" and path.startswith("/v2/repository/"):
                await self._repository(path, headers, receive, send)
            elif method == "POST" and path.endswith(("/generate", "/generate_stream")):
                await self._generate(path, headers, receive, send, tenant)
            elif method == "POST":
                await self._infer(path, headers, receive, send, tenant)
            elif path.startswith(JOBS_PREFIX):
                await self._job(path[len(JOBS_PREFIX) :], send)
            elif path.strip("/") == "metrics":
                await self._metrics(send)
            else:
                await self._get(path, send)
        except UnknownModelError as exc:
            await _respond(send, 404, encode_error(str(exc)))
        except StoreUnavailable as exc:  # reading a job (or the status's job counts) from a store that refuses
            body = json.dumps({"error": str(exc), "reason": exc.reason}).encode()
            await _respond(send, 503, body, extra=[(_H_RETRY_AFTER, str(STORE_UNAVAILABLE_RETRY_AFTER_S).encode())])

    def _closing_when_draining(self, send: Send) -> Send:
        """Once draining, every answer closes its connection, so no client reuses one the agent will close."""

        async def closing_send(message: dict[str, Any]) -> None:
            if not self.ready and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        return closing_send

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    for hook in self.on_startup:
                        await hook()
                except Exception as exc:
                    log.exception("agent startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for hook in self.on_shutdown:
                    try:
                        await hook()
                    except Exception:  # one failing hook must not keep the others from running
                        log.exception("agent shutdown step failed")
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- metadata, health, statistics ------------------------------------------------------------

    async def _get(self, path: str, send: Send) -> None:
        parts = path.strip("/").split("/")
        if parts == ["v2"]:
            body = {"name": "spillway-edge-agent", "version": __version__,
                    "extensions": ["binary_tensor_data", "statistics", "parameters", "model_repository",
                                    "model_configuration"]}  # fmt: skip
            await _respond_json(send, 200, body)
        elif parts == ["v2", "health", "live"]:
            await _respond_json(send, 200, {"live": True})
        elif parts == ["v2", "health", "ready"]:
            await _respond_json(send, 200 if self.ready else 503, {"ready": self.ready})
        elif parts == ["v2", "spillway", "status"] and self.status is not None:
            await _respond_json(send, 200, self.status())
        elif parts == ["v2", "models", "stats"]:
            stats = [m.worker.stats.json(m.config.name, str(m.version)) for m in self.registry.all()]
            await _respond_json(send, 200, {"model_stats": stats})
        elif len(parts) >= 3 and parts[:2] == ["v2", "models"]:
            name, version, rest = _model_path(parts[2:])
            if rest == ["config"]:
                await _respond_json(send, 200, self._config(name, version))
                return
            pool = None
            if self.openai is not None and name not in self.registry.names():
                pool = self.openai.engines.get(name)
            if pool is not None and rest in ([], ["ready"]):  # a generative model: Triton's decoupled LLM shape
                config = self._config(name, version)  # UnknownModelError for a version it does not serve
                if rest == ["ready"]:  # an engine left: a broken one refuses; a draining pool has left the dict
                    ready = self.ready and any(engine.broken is None for engine in pool.instances)
                    await _respond_json(send, 200 if ready else 503, {"name": name, "ready": ready})
                    return
                optional = [("stream", "BOOL"), ("sampling_parameters", "BYTES"), ("exclude_input_in_output", "BOOL")]
                inputs = [{"name": n, "datatype": t, "shape": [1]} for n, t in [("text_input", "BYTES"), *optional]]
                await _respond_json(send, 200, {"name": name, "versions": [pool.version],
                                                "platform": config.get("platform", ""), "inputs": inputs,
                                                "outputs": [{"name": "text_output", "datatype": "BYTES",
                                                             "shape": [1]}]})  # fmt: skip
                return
            model = self.registry.get(name, version)
            if rest == []:
                await _respond_json(send, 200, self._metadata(model.config.name, version))
            elif rest == ["ready"]:
                ready = self.ready and not model.worker.scheduler.draining
                await _respond_json(send, 200 if ready else 503, {"name": name, "ready": ready})
            elif rest == ["stats"]:
                if version:  # the statistics of that very version, wherever its traffic goes now
                    found = self.registry.loaded(name, _version_number(name, version))
                    if found is None:
                        raise UnknownModelError(f"unknown version '{version}' of model '{name}'")
                    model = found
                models = [model] if version else [m for m in self.registry.all() if m.config.name == name]
                stats = [m.worker.stats.json(m.config.name, str(m.version)) for m in models]
                await _respond_json(send, 200, {"model_stats": stats})
            else:
                await _respond(send, 404, encode_error(f"no such endpoint: {path}"))
        else:
            await _respond(send, 404, encode_error(f"no such endpoint: {path}"))

    def _config(self, name: str, version: str | None) -> dict[str, Any]:
        """Triton's model configuration endpoint: the config the model was loaded with, as Triton returns it."""
        pool = self.engines.get(name) if name not in self.registry.names() else None
        if pool is None:
            model = self.registry.get(name, version)
            message = model.triton_config
            if message is None:  # a model handed to the registry without its file
                message = completed_config(None, model.config, model.providers)
            return config_json(message)
        if version not in (None, "", pool.version):
            raise UnknownModelError(f"unknown version '{version}' of model '{name}' (it serves {pool.version})")
        source = self.registry.source
        message = source.generative.get(name) if source is not None else None
        return config_json(message if message is not None else generative_config(name, pool.version, None, ()))

    def _metadata(self, name: str, version: str | None) -> dict[str, Any]:
        model = self.registry.get(name, version)
        config = model.config
        batch = [-1] if config.max_batch_size > 0 else []

        def tensors(specs: Any) -> list[dict[str, Any]]:
            return [{"name": t.name, "datatype": t.datatype, "shape": batch + list(t.shape)} for t in specs]

        return {
            "name": config.name,
            "versions": [str(v) for v in self.registry.versions(config.name)],
            "platform": config.platform,
            "inputs": tensors(config.inputs),
            "outputs": tensors(config.outputs),
        }

    async def _job(self, job_id: str, send: Send) -> None:
        """`GET /spillway/v1/jobs/{id}`: an async job's status, and its answer once done."""
        if self.jobs is None:
            await _respond(send, 404, encode_error("this agent has no async queue (agent config async_jobs.models)"))
            return
        job = await self.jobs.get(job_id) if 0 < len(job_id) <= 128 and "/" not in job_id else None
        if job is None:
            await _respond(send, 404, encode_error(f"no job {job_id!r} (unknown, or expired and removed)"))
            return
        body = job.json()
        extra = [(_H_JOB_STATUS, job.status.encode())]
        if job.status in ("queued", "running"):
            extra.append((_H_RETRY_AFTER, b"1"))
        await _respond(send, 200, json.dumps(body).encode(), extra=extra)

    async def _metrics(self, send: Send) -> None:
        """`GET /metrics`: the agent's instruments in the Prometheus text format, collected off the event loop."""
        if self.metrics is None:
            await _respond(send, 404, encode_error("metrics are off"))
            return
        try:
            body, content_type = await asyncio.to_thread(self.metrics)
        except Exception:  # telemetry never takes a request down with a trace
            log.exception("collecting the metrics failed")
            await _respond(send, 500, encode_error("collecting the metrics failed; see the agent log"))
            return
        await _respond(send, 200, body, content_type=content_type.encode())

    # ---- the repository extension (repository_api.py) -------------------------------------------------------------

    async def _repository(self, path: str, headers: dict[bytes, bytes], receive: Receive, send: Send) -> None:
        """`POST /v2/repository/index`, `/v2/repository/models/{m}/load` and `.../unload`."""
        try:
            body = await read_body(receive, headers.get(b"content-length"), _CONTROL_BODY_BYTES)
        except BodyTooLarge:
            await _respond(send, 413, encode_error(f"the body is over {_CONTROL_BODY_BYTES} bytes"))
            return
        except ClientGone:
            return
        parts = path.strip("/").split("/")
        try:
            if parts == ["v2", "repository", "index"]:
                rows = self.control.index(ready_only=parse_index_body(body))
                await _respond(send, 200, json.dumps(rows).encode())
                return
            name, action = parts[3], parts[4]
            if not self.ready:
                await _respond(send, 503, encode_error(f"the agent is shutting down: {name!r} is not {action}ed"))
                return
            if action == "load":
                check_load_body(name, body)
                loaded = await self.control.load(name)
                versions = [str(m.version) for m in loaded]
                await _respond_json(send, 200, {"name": name, "versions": versions, "state": "READY"})
            else:
                check_unload_body(name, body)
                await self.control.unload(name)
                await _respond_json(send, 200, {"name": name, "state": "UNAVAILABLE", "reason": "unloaded"})
        except RepositoryError as exc:
            await _respond(send, _repository_status(exc), encode_error(str(exc)))

    async def _generate(self, path: str, headers: dict[bytes, bytes], receive: Receive, send: Send,
                        tenant: str = DEFAULT_TENANT) -> None:  # fmt: skip
        """Triton's generate extension, for the generative models (openai_api.py)."""
        name, version, rest = _model_action(path)
        if rest not in (["generate"], ["generate_stream"]):
            await _respond(send, 404, encode_error(f"no such endpoint: {path}"))
        elif self.openai is None or name not in self.openai.engines:
            await _respond(send, 404, encode_error(f"unknown generative model '{name}' (V2 models answer /infer)"))
        else:
            await self.openai.triton_generate(name, version, rest == ["generate_stream"], headers, receive, send,
                                              tenant=tenant)  # fmt: skip

    # ---- inference: the pipeline (pipeline.py) ------------------------------------------------------------------

    async def _infer(self, path: str, headers: dict[bytes, bytes], receive: Receive, send: Send,
                     tenant: str = DEFAULT_TENANT) -> None:  # fmt: skip
        name, version, rest = _model_action(path)
        if rest != ["infer"]:
            await _respond(send, 404, encode_error(f"no such endpoint: {path}"))
            return
        try:
            requested = self.registry.get(name, version)
        except UnknownModelError as exc:  # before anything was read: counted on no model
            self.unrouted["unknown_model"] += 1
            await reject(send, 404, str(exc), "unknown_model")
            return
        await self.pipeline.handle(path, requested, name, version, headers, receive, send, tenant)


def allowed_methods(path: str) -> tuple[str, ...] | None:
    """The methods a route takes (None: no route has that path, a 404). `/v1/...` is the OpenAI API's to answer."""
    parts = path.strip("/").split("/")
    if parts in (["v2"], ["v2", "health", "live"], ["v2", "health", "ready"], ["v2", "spillway", "status"],
                 ["v2", "models", "stats"], ["metrics"]):  # fmt: skip
        return _GET
    if parts == ["v2", "repository", "index"]:
        return _POST
    if len(parts) == 5 and parts[:3] == ["v2", "repository", "models"] and parts[4] in ("load", "unload"):
        return _POST
    if path.startswith(JOBS_PREFIX):
        return _GET
    if len(parts) >= 3 and parts[:2] == ["v2", "models"]:
        rest = _model_path(parts[2:])[2]
        if rest in ([], ["ready"], ["stats"], ["config"]):
            return _GET
        if rest in (["infer"], ["generate"], ["generate_stream"]):
            return _POST
    return None


def _repository_status(exc: RepositoryError) -> int:
    """The HTTP status of a refused repository request (the tree in repository_api.py's docstring)."""
    if isinstance(exc, NotInRepository):
        return 404
    if isinstance(exc, LoadConflict):  # the memory free now, or the active policy: it may load later
        return 409
    if isinstance(exc, LoadFailed):
        return 500
    return 400


def _model_action(path: str) -> tuple[str, str | None, list[str]]:
    """`/v2/models/m[/versions/v]/<action>` -> (m, v, [action, ...]); ("", None, []) for any other path."""
    parts = path.strip("/").split("/")
    return _model_path(parts[2:]) if len(parts) >= 4 and parts[:2] == ["v2", "models"] else ("", None, [])


def _model_path(parts: list[str]) -> tuple[str, str | None, list[str]]:
    """`m[/versions/v][/rest...]` -> (m, v, rest)."""
    name = parts[0]
    if len(parts) >= 3 and parts[1] == "versions":
        return name, parts[2], parts[3:]
    return name, None, parts[1:]


def _version_number(name: str, version: str) -> int:
    try:
        return int(version)
    except ValueError:
        raise UnknownModelError(f"unknown version '{version}' of model '{name}'") from None


def _openai_error(message: str, code: str) -> bytes:
    """OpenAI's error body, for `/v1/...` (openai_api.py answers the rest of them): OpenAI answers a bad key 401
    `invalid_request_error`/`invalid_api_key` and an unknown model 404 `model_not_found`."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": error}).encode()


async def _respond_json(send: Send, status: int, body: dict[str, Any]) -> None:
    await _respond(send, status, json.dumps(body).encode())


def _operator_only(path: str) -> bool:
    """Routes only the agent's own token (the `default` tenant) reaches once tenants exist."""
    return path.startswith(("/v2/repository/", "/v2/spillway/")) or path.strip("/") == "metrics"
