"""Poll the control plane for this agent's policy document and hand every new one to the applier.

`GET {control_plane}/api/v1/agents/{agent_id}/policy` with the agent token and `If-None-Match`: 304 means
unchanged; a new document is validated and applied at once. The poll runs as a task on the event loop with a
bounded HTTP client, so a slow or absent control plane costs serving nothing: any failure (network, timeout, a
5xx, a 401/403/404) keeps the active policy, backs off exponentially (jittered, capped), and is logged once per
streak of failures (and once when polls work again). A refused document is not fetched again for a minute, so
one bad document is not refused (and counted) on every poll; after that it is tried again (memory may be free).
Every poll tick also writes the policy cache if a write the disk refused left it behind, whether or not the control
plane answers (a restart without it must find the active policy).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from pydantic import ValidationError

from edge_agent.errors import AgentError
from edge_agent.failures import FailureStreak, cancelled
from edge_agent.policy.apply import PolicyApplier, isoformat_utc
from spillway.contract.policy import parse

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("spillway.agent.policy")

MAX_DOCUMENT_BYTES = 1 << 20
RETRY_REFUSED_AFTER_S = 60.0


class PollFailed(AgentError):
    """One poll got no usable answer; the message says why."""


class PolicyPoller:
    """The poll loop's state and one poll at a time (`poll_once`), for the loop and for tests alike."""

    def __init__(
        self,
        control_plane: str,
        agent_id: str,
        token: str,
        applier: PolicyApplier,
        *,
        interval_s: float = 5.0,
        timeout_s: float = 5.0,
        max_backoff_s: float = 60.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = f"{control_plane.rstrip('/')}/api/v1/agents/{quote(agent_id, safe='')}/policy"
        self._token = token
        self.applier = applier
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self._rng = rng or random.Random()  # noqa: S311 (jitter, not secrets)
        self._clock = clock
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._refused: tuple[str, float] | None = None  # (ETag, when) of the last refused document
        self.polls = 0
        self.streak = FailureStreak(
            log,
            "policy poll failed: {error}; keeping the active policy and retrying with backoff (logged again once "
            "polls work)",
            "policy polls work again after {failures} failed",
        )
        self.last_poll_at: float | None = None
        self.last_success_at: float | None = None
        self.last_error_at: float | None = None

    @property
    def failures(self) -> int:
        """Failed polls in a row (the backoff doubles with each)."""
        return self.streak.failures

    @failures.setter
    def failures(self, value: int) -> None:
        self.streak.failures = value

    @property
    def last_error(self) -> str | None:
        return self.streak.last_error

    # ---- one poll ----------------------------------------------------------------------------

    def _if_none_match(self) -> str | None:
        if self._refused is not None and self._clock() - self._refused[1] < RETRY_REFUSED_AFTER_S:
            return self._refused[0]
        return self.applier.etag

    async def poll_once(self) -> str:
        """Ask once; returns "applied", "unchanged", "refused" or "failed" (never raises for a bad answer)."""
        self.polls += 1
        self.last_poll_at = self._clock()
        await self.applier.sync_cache()
        try:
            etag, body = await self._fetch()
        except PollFailed as exc:
            self._failed(str(exc))
            return "failed"
        self._succeeded()
        if body is None or etag == self.applier.etag:
            if etag is not None and etag == self.applier.etag:
                self.applier.confirmed()  # a cached policy the control plane still serves is the control plane's
            return "unchanged"
        try:
            document = parse(body)
        except ValidationError as exc:
            self.applier.refuse(f"invalid policy document: {_brief(exc)}", _version_of(body), "control_plane")
            self._remember_refused(etag)
            return "refused"
        if await self.applier.apply(document, "control_plane", etag):
            self._refused = None
            return "applied"
        self._remember_refused(etag)
        return "refused"

    async def _fetch(self) -> tuple[str | None, bytes | None]:
        """(ETag, body) of a new document, or (ETag, None) when unchanged; raises PollFailed."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s, connect=min(2.0, self.timeout_s)),
                limits=httpx.Limits(max_connections=2, max_keepalive_connections=1),
                headers={"Authorization": f"Bearer {self._token}", "Accept": "application/json"},
            )
        headers = {}
        match = self._if_none_match()
        if match is not None:
            headers["If-None-Match"] = match
        try:
            async with self._client.stream("GET", self.url, headers=headers) as response:
                if response.status_code == 304:
                    return response.headers.get("etag", match), None
                if response.status_code != 200:
                    detail = (await response.aread())[:300].decode("utf-8", "replace")
                    raise PollFailed(_http_error(response.status_code, detail))
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_DOCUMENT_BYTES:
                        raise PollFailed(f"the policy document exceeds {MAX_DOCUMENT_BYTES} bytes")
                    chunks.append(chunk)
                body = b"".join(chunks)
                # Without an ETag from the server, the body's own digest tells an unchanged document from a new one.
                return response.headers.get("etag") or f'W/"{hashlib.sha256(body).hexdigest()}"', body
        except httpx.HTTPError as exc:
            raise PollFailed(f"cannot reach {self.url}: {type(exc).__name__}: {exc}") from None

    def _failed(self, message: str) -> None:
        self.streak.failed(message)
        self.last_error_at = self._clock()

    def _succeeded(self) -> None:
        self.streak.worked()
        self.last_success_at = self._clock()

    def _remember_refused(self, etag: str | None) -> None:
        self._refused = None if etag is None else (etag, self._clock())

    # ---- the loop ----------------------------------------------------------------------------

    def next_delay(self) -> float:
        """Seconds until the next poll: the interval (the document's, else the config's), doubled per failure in a
        row up to `max_backoff_s`, times a random factor in [0.8, 1.2] so that a fleet does not poll in step."""
        base = self.applier.plan.poll_interval_s or self.interval_s
        if self.failures:
            base = min(base * 2 ** min(self.failures, 16), max(self.max_backoff_s, base))
        return base * self._rng.uniform(0.8, 1.2)

    async def run(self) -> None:
        """Poll now, then after every delay, until cancelled; nothing in here can end the loop but cancellation."""
        while True:
            try:
                await self.poll_once()
            except Exception:  # a bug of ours: counted as a failed poll, never the end of polling
                if self.failures == 0:
                    log.exception("policy poll crashed")
                self._failed("internal error while polling; see the agent log")
            await asyncio.sleep(self.next_delay())

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="policy-poll")

    async def stop(self) -> None:
        await cancelled(self._task)
        self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def json(self) -> dict[str, Any]:
        def when(seconds: float | None) -> str | None:
            return None if seconds is None else isoformat_utc(seconds)

        return {
            "url": self.url,
            "interval_s": self.applier.plan.poll_interval_s or self.interval_s,
            "polls": self.polls,
            "consecutive_failures": self.failures,
            "last_poll_at": when(self.last_poll_at),
            "last_success_at": when(self.last_success_at),
            "last_error": self.last_error,
            "last_error_at": when(self.last_error_at),
        }


def _http_error(status: int, detail: str) -> str:
    meaning = {401: "the control plane refused the agent token", 403: "the agent token is not this agent's",
               404: "the control plane does not know this agent"}.get(status, "unexpected answer")  # fmt: skip
    return f"HTTP {status} ({meaning}): {detail.strip()}"


def _brief(exc: ValidationError) -> str:
    errors = exc.errors()
    shown = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'document'}: {e['msg']}" for e in errors[:5])
    return shown + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else "")


def _version_of(body: bytes) -> int | None:
    """The version an invalid document claims, when it says one (for the refusal report)."""
    import json

    try:
        version = json.loads(body).get("version")
    except (ValueError, AttributeError):
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) else None
