"""A real small filesystem a test can fill to the last byte and free again: a tmpfs mounted on a temporary folder.

Mounting needs root (CI and the dev containers run as root). Elsewhere the tests that need it are skipped, except
under CI=true, where they fail: CI must run them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class SmallDisk:
    """A mounted tmpfs: `fill` takes every byte left, `free` gives them back."""

    root: Path

    @property
    def filler(self) -> Path:
        return self.root / ".filler"

    def available(self) -> int:
        stats = os.statvfs(self.root)
        return stats.f_bavail * stats.f_frsize

    def fill(self) -> None:
        """Write the filler until the disk says ENOSPC, in ever smaller writes, down to single bytes."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 16, 1 << 12, 1 << 8, 1):
                chunk = b"\0" * size
                for _ in range(1 << 16):  # bounded: 2 MiB takes 32 of the largest writes
                    try:
                        os.write(fd, chunk)
                    except OSError:
                        break
        finally:
            os.close(fd)
        assert self.available() == 0, f"{self.root} still has {self.available()} bytes free"

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


def _refuse(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but a small tmpfs cannot be mounted: {reason}")
    pytest.skip(f"needs a small tmpfs (mounting one needs root): {reason}")


@contextlib.contextmanager
def small_disk(root: Path, size: str = "2m") -> Iterator[SmallDisk]:
    """Mount a tmpfs of `size` on `root` (created if need be) for the block; unmounted after, whatever is left on it
    (stop the processes that use it first)."""
    root.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        _refuse(f"running as uid {os.geteuid()}, not root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(root)],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    if mounted.returncode != 0:
        _refuse(f"mount -t tmpfs failed: {mounted.stderr.strip() or mounted.returncode}")
    disk = SmallDisk(root)
    try:
        yield disk
    finally:
        disk.free()
        if subprocess.run(["umount", str(root)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(root)], capture_output=True, timeout=30)  # a file still open: lazily
