"""Run Alembic from code: the `migrations/` folder of a checkout, or the copy packed into the wheel."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from controlplane.db.session import normalise_url


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


def migrate_to(url: str, revision: str = "head") -> None:
    """Upgrade the database to `revision` (default: the newest)."""
    command.upgrade(alembic_config(url), revision)


def downgrade_to(url: str, revision: str) -> None:
    """Downgrade the database to `revision` (`base` empties it, `-1` steps back one)."""
    command.downgrade(alembic_config(url), revision)
