"""The Open Inference Protocol (KServe V2) over HTTP, as a plain ASGI app: lean enough to add well under
a millisecond to a request, with Triton's status codes and error shape."""

from __future__ import annotations

import hmac
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
from spillway.contract import names
from spillway.contract.v2 import encode_error

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
    ) -> None:
        """Args beyond the obvious:
        policy: overflow, shed, fallback and variant decisions per model (None: serve everything as configured).
        responses: recent successful answers, filled on every success and read by `cache` fallbacks.
        status: the body of `GET /v2/spillway/status`.
        forwarder: overflow to the control plane's gateway (None: nowhere to overflow to).
        default_outputs: per model, the outputs (one row each) answered as `fallback_default` when overflow fails.
        jobs: the async queue, the last fallback when overflow fails, for the models it accepts.
        openai: the OpenAI-compatible API of the generative models (None: none are served).
        """
        self.registry = registry
        self.token = token.encode() if token else None
        self.status = status
        self.jobs = jobs
        self.openai = openai
        self.engines: dict[str, EnginePool] = {}  # drained with the workers on shutdown
        self.pipeline = InferencePipeline(
            registry, max_body_bytes=max_body_bytes, allow_non_finite=allow_non_finite, policy=policy,
            responses=responses, forwarder=forwarder, default_outputs=default_outputs, jobs=jobs,
        )  # fmt: skip
        self.ready = True
        self.unrouted: Counter[str] = Counter()  # infer requests for models that do not exist
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
        if self.token is not None and path not in _UNAUTHENTICATED and not self._authorised(headers):
            message = "missing or invalid bearer token"
            body = _openai_error(message, "invalid_api_key") if path.startswith("/v1/") else encode_error(message)
            await _respond(send, 401, body, extra=[(b"www-authenticate", b"Bearer")])
            return
        method: str = scope["method"]
        try:
            if path.startswith("/v1/"):
                if self.openai is None:
                    await _respond(send, 404, _openai_error("this agent serves no generative model", "model_not_found"))
                else:
                    await self.openai.handle(method, path, headers, receive, send)
            elif method == "POST" and path.endswith(("/generate", "/generate_stream")):
                await self._generate(path, headers, receive, send)
            elif method == "POST" and path.endswith("/infer"):
                await self._infer(path, headers, receive, send)
            elif method in ("GET", "HEAD") and path.startswith(JOBS_PREFIX):
                await self._job(path[len(JOBS_PREFIX) :], send)
            elif method in ("GET", "HEAD"):
                await self._get(path, send)
            else:
                await _respond(send, 405, encode_error(f"method {method} not allowed on {path}"))
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

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        value = headers.get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        assert self.token is not None
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.token)

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
                    "extensions": ["binary_tensor_data", "statistics", "parameters"]}  # fmt: skip
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

    async def _generate(self, path: str, headers: dict[bytes, bytes], receive: Receive, send: Send) -> None:
        """Triton's generate extension, for the generative models (openai_api.py)."""
        name, version, rest = _model_action(path)
        if rest not in (["generate"], ["generate_stream"]):
            await _respond(send, 404, encode_error(f"no such endpoint: {path}"))
        elif self.openai is None or name not in self.openai.engines:
            await _respond(send, 404, encode_error(f"unknown generative model '{name}' (V2 models answer /infer)"))
        else:
            await self.openai.triton_generate(name, version, rest == ["generate_stream"], headers, receive, send)

    # ---- inference: the pipeline (pipeline.py) ------------------------------------------------------------------

    async def _infer(self, path: str, headers: dict[bytes, bytes], receive: Receive, send: Send) -> None:
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
        await self.pipeline.handle(path, requested, name, version, headers, receive, send)


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
