"""Active readiness checks, the moving part: every interval, each backend's `GET /v2/health/ready` and
`GET /v2/models/{m}/ready` for each model it lists, all at once; the pool decides what the answers mean."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from controlplane.gateway.backend import BackendSpec
from controlplane.gateway.pool import BackendPool

SERVER_READY = "/v2/health/ready"


class ReadinessChecker:
    def __init__(self, http: Callable[[], aiohttp.ClientSession], pool: BackendPool, *, timeout_s: float) -> None:
        self.http = http
        self.pool = pool
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
        paths = [SERVER_READY, *(f"/v2/models/{m}/ready" for m in spec.models)]
        probes = await asyncio.gather(*(self._probe(spec.url, path, headers) for path in paths))
        server_error = probes[0]
        ready = {m: server_error is None and error is None for m, error in zip(spec.models, probes[1:], strict=True)}
        error = next((e for e in probes if e is not None), None)
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
