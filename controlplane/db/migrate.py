"""Run Alembic from code: the `migrations/` folder of a checkout, or the copy packed into the wheel.

Each revision applied is said as it completes, with its duration (`migrating 0005_backend_protocol -> 0006_tenants:
0.41 s`): to the caller's `say`, or else at INFO on the `spillway.controlplane.migrate` logger (the control plane's
migrate-on-start, whose log configuration shows it). The hook is Alembic's `on_version_apply`, handed to
`migrations/env.py` in `Config.attributes["on_version_apply"]`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from controlplane.db.session import normalise_url

log = logging.getLogger("spillway.controlplane.migrate")


def migrations_dir() -> Path:
    packed = Path(__file__).resolve().parent.parent / "_migrations"
    if packed.is_dir():
        return packed
    return Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # ConfigParser interpolation treats % specially (URL-encoded passwords).
    cfg.set_main_option("sqlalchemy.url", normalise_url(url).replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest revision this code knows: what `/readyz` expects the database to be at."""
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None
    return head


class _StepTimer:
    """Alembic's `on_version_apply` callback: one line per revision applied, timed from the previous one (the
    first from the start of the command, which includes connecting)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.last = time.monotonic()
        self.steps = 0

    def __call__(self, *, step: Any, **_: Any) -> None:
        now = time.monotonic()
        if not step.is_migration:  # a stamp
            return
        source, target = _label(step.source_revision_ids, step), _label(step.destination_revision_ids, step)
        verb = "migrating" if step.is_upgrade else "downgrading"
        self.say(f"{verb} {source} -> {target}: {now - self.last:.2f} s")
        self.last, self.steps = now, self.steps + 1


def _label(revisions: tuple[str, ...], step: Any) -> str:
    """`0006_tenants` for revision `0006` (its file's name), `base` for none."""
    if not revisions:
        return "base"
    names = []
    for revision in revisions:
        script = step.revision_map.get_revision(revision)
        names.append(Path(script.path).stem if script is not None and script.path else revision)
    return ", ".join(names)


def _run(action: Callable[[Config, str], None], url: str, revision: str, say: Callable[[str], None] | None) -> int:
    cfg = alembic_config(url)
    timer = _StepTimer(say or log.info)
    cfg.attributes["on_version_apply"] = timer
    action(cfg, revision)
    return timer.steps


def migrate_to(url: str, revision: str = "head", *, say: Callable[[str], None] | None = None) -> int:
    """Upgrade the database to `revision` (default: the newest); returns how many revisions were applied. Each is
    said with its duration to `say` (default: INFO on this module's logger)."""
    return _run(command.upgrade, url, revision, say)


def downgrade_to(url: str, revision: str, *, say: Callable[[str], None] | None = None) -> int:
    """Downgrade the database to `revision` (`base` empties it, `-1` steps back one); returns how many revisions
    were undone, each said as by `migrate_to`."""
    return _run(command.downgrade, url, revision, say)
