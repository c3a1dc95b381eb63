"""Active readiness checks, the moving part: every interval, all backends at once; the pool decides what the
answers mean. A V2 backend: `GET /v2/health/ready` and `GET /v2/models/{m}/ready` for each model it lists; a
`v2_grpc` one: the same as the `ServerReady` and `ModelReady` RPCs. An `openai` backend: one `GET /v1/models`, whose
list must hold the backend's name (`model_map`) of each model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from controlplane.gateway.backend import BackendSpec
from controlplane.gateway.grpc_backend import GrpcBackends
from controlplane.gateway.pool import BackendPool

SERVER_READY = "/v2/health/ready"
OPENAI_MODELS = "/v1/models"
_MODELS_LIMIT = 4 << 20  # a model list longer than this is not one


class ReadinessChecker:
    def __init__(
        self,
        http: Callable[[], aiohttp.ClientSession],
        pool: BackendPool,
        *,
        timeout_s: float,
        grpc: GrpcBackends,  # the gateway's channels (it closes them): a checker of its own would leak its channels
    ) -> None:
        self.http = http
        self.pool = pool
        self.grpc = grpc
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.rounds = 0

    async def check_all(self) -> None:
        specs = [state.spec for state in self.pool.states.values()]
        results = await asyncio.gather(*(self.check(spec) for spec in specs))
        for spec, (ready, error) in zip(specs, results, strict=True):
            self.pool.checked(spec.id, ready, error)
        self.rounds += 1

    async def check(self, spec: BackendSpec) -> tuple[dict[str, bool], str | None]:
        """model -> passed, and the first failure's description (None when all passed)."""
        headers = {"Authorization": spec.auth_header} if spec.auth_header else {}
        if spec.protocol == "openai":
            return await self._check_openai(spec, headers)
        if spec.protocol == "v2_grpc":
            return await self.grpc.ready(spec, self.timeout.total or 1.0)
        paths = [SERVER_READY, *(f"/v2/models/{m}/ready" for m in spec.models)]
        probes = await asyncio.gather(*(self._probe(spec.url, path, headers) for path in paths))
        server_error = probes[0]
        ready = {m: server_error is None and error is None for m, error in zip(spec.models, probes[1:], strict=True)}
        error = next((e for e in probes if e is not None), None)
        return ready, error

    async def _check_openai(self, spec: BackendSpec, headers: dict[str, str]) -> tuple[dict[str, bool], str | None]:
        listed: set[str] = set()
        error = None
        try:
            async with self.http().get(spec.url + OPENAI_MODELS, headers=headers, timeout=self.timeout) as response:
                raw = await response.content.read(_MODELS_LIMIT)
                if response.status != 200:
                    error = f"GET {OPENAI_MODELS} answered {response.status}"
                else:
                    listed = _model_ids(raw)
        except asyncio.TimeoutError:
            error = f"GET {OPENAI_MODELS}: no answer within {self.timeout.total:g} s"
        except aiohttp.ClientError as exc:
            error = f"GET {OPENAI_MODELS}: {type(exc).__name__}: {exc}"
        except ValueError as exc:
            error = f"GET {OPENAI_MODELS}: not a model list: {exc}"
        ready = {m: error is None and spec.cloud_model(m) in listed for m in spec.models}
        if error is None:
            missing = next((spec.cloud_model(m) for m in spec.models if not ready[m]), None)
            if missing is not None:
                error = f"GET {OPENAI_MODELS} does not list '{missing}'"
        return ready, error

    async def _probe(self, base: str, path: str, headers: dict[str, str]) -> str | None:
        try:
            async with self.http().get(base + path, headers=headers, timeout=self.timeout) as response:
                await response.read()  # small; read so that the connection goes back to the pool
                return None if response.status == 200 else f"GET {path} answered {response.status}"
        except asyncio.TimeoutError:
            return f"GET {path}: no answer within {self.timeout.total:g} s"
        except aiohttp.ClientError as exc:
            return f"GET {path}: {type(exc).__name__}: {exc}"


def _model_ids(raw: bytes) -> set[str]:
    """The ids in an OpenAI model list (`{"object": "list", "data": [{"id": ...}, ...]}`); ValueError if not one."""
    doc: Any = orjson.loads(raw)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("no 'data' list")
    return {item["id"] for item in data if isinstance(item, dict) and isinstance(item.get("id"), str)}
