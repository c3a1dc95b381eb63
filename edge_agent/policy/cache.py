"""The last good policy document on disk, so that an agent restarted without its control plane keeps behaving as
it was told. Written atomically (a temporary file, fsync, rename, fsync of the directory): a crash or a full disk
leaves the old file or the new one, never half of one, and no temporary file behind."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from edge_agent.errors import AgentError
from spillway.contract.policy import PolicyDocument

log = logging.getLogger("spillway.agent.policy")

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class CacheUnreadable(AgentError, ValueError):
    """The cache file exists but holds no usable document; the message says why."""


class CacheUnwritable(AgentError):
    """The disk refused the new document (`full`: no space left); the old file, if any, is untouched."""

    def __init__(self, message: str, *, full: bool) -> None:
        super().__init__(message)
        self.full = full


@dataclass(frozen=True)
class CachedPolicy:
    document: PolicyDocument
    etag: str | None


class PolicyCache:
    """`<state_dir>/policy-<agent id>.json`: the agent id, the document's ETag and the document."""

    def __init__(self, state_dir: Path, agent_id: str) -> None:
        self.agent_id = agent_id
        self.path = state_dir / f"policy-{_UNSAFE.sub('_', agent_id)}.json"

    def load(self) -> CachedPolicy | None:
        """The cached document, None when there is none; raises CacheUnreadable for a file that is not one."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CacheUnreadable(f"{self.path}: cannot read: {exc}") from None
        try:
            stored = json.loads(raw)
        except ValueError as exc:
            raise CacheUnreadable(f"{self.path}: not JSON: {exc}") from None
        if not isinstance(stored, dict) or "document" not in stored:
            raise CacheUnreadable(f"{self.path}: not a cached policy (no 'document')")
        if stored.get("agent_id") != self.agent_id:
            raise CacheUnreadable(f"{self.path}: cached for agent {stored.get('agent_id')!r}, not {self.agent_id!r}")
        try:
            document = PolicyDocument.model_validate(stored["document"])
        except ValidationError as exc:
            raise CacheUnreadable(f"{self.path}: invalid policy document: {exc}") from None
        etag = stored.get("etag")
        return CachedPolicy(document, etag if isinstance(etag, str) else None)

    def store(self, document: PolicyDocument, etag: str | None) -> None:
        """Replace the cached document atomically; raises CacheUnwritable when the disk refuses."""
        payload = json.dumps(
            {"agent_id": self.agent_id, "etag": etag, "document": document.model_dump(mode="json")}, indent=1
        ).encode()
        try:
            self._replace(payload)
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise CacheUnwritable(f"{self.path}: cannot write: {exc}", full=full) from exc

    def _replace(self, payload: bytes) -> None:
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (where the platform lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        log.debug("fsync of %s failed", directory, exc_info=True)
    finally:
        os.close(fd)
