"""Migrations say each revision they apply, with its duration: `spillway controlplane migrate` on stderr, and the
control plane's migrate-on-start through its log."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from controlplane.db.migrate import downgrade_to, migrate_to, migrations_dir
from spillway.cli import app

STEP = re.compile(r"^(migrating|downgrading) (\S+) -> (\S+): \d+\.\d\d s$")


def _revisions() -> list[str]:
    """The revision files' names, oldest first (`0001_initial`, ...)."""
    return sorted(p.stem for p in (migrations_dir() / "versions").glob("[0-9]*.py"))


def test_migrate_to_says_each_revision_with_its_duration(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    said: list[str] = []
    names = _revisions()
    assert migrate_to(url, names[1].split("_")[0], say=said.append) == 2
    assert migrate_to(url, say=said.append) == len(names) - 2
    steps = [STEP.match(line) for line in said]
    assert all(steps), said
    assert [(m.group(2), m.group(3)) for m in steps if m] == list(zip(["base", *names[:-1]], names, strict=True))
    said.clear()
    assert migrate_to(url, say=said.append) == 0 and said == []  # at head already: nothing to say
    assert downgrade_to(url, "-1", say=said.append) == 1
    assert said[0].startswith(f"downgrading {names[-1]} -> {names[-2]}: ")


def test_the_migrate_command_prints_a_line_per_revision_on_stderr(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    result = CliRunner().invoke(app, ["controlplane", "migrate"], env={"SPILLWAY_DATABASE_URL": url})
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    names = _revisions()
    assert [line.split(":")[0] for line in lines[:-1]] == [
        f"migrating {a} -> {b}" for a, b in zip(["base", *names[:-1]], names, strict=True)
    ]
    assert re.fullmatch(rf"database at head \({len(names)} revisions applied in \d+\.\d s\)", lines[-1]), lines
    assert result.stdout == ""


def test_an_unknown_revision_or_a_newer_database_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import sqlite3

    url = f"sqlite:///{tmp_path / 'newer.db'}"
    env = {"SPILLWAY_DATABASE_URL": url}
    typo = CliRunner().invoke(app, ["controlplane", "migrate", "--revision", "0042"], env=env)
    assert typo.exit_code == 2 and typo.stderr.startswith("error: cannot migrate to '0042'"), typo.output
    assert CliRunner().invoke(app, ["controlplane", "migrate"], env=env).exit_code == 0
    with sqlite3.connect(tmp_path / "newer.db") as conn:  # as a newer Spillway would have left it
        conn.execute("UPDATE alembic_version SET version_num = '0999'")
    for command in (["migrate"], ["downgrade", "--revision", "-1"]):
        result = CliRunner().invoke(app, ["controlplane", *command], env=env)
        assert result.exit_code == 2, result.output
        assert "'0999'" in result.stderr and "newer Spillway" in result.stderr and "Traceback" not in result.output
        assert len(result.stderr.splitlines()) == 1


def test_a_postgresql_url_without_psycopg_names_the_extra(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = "import sys; sys.modules['psycopg'] = None; from spillway.cli import main; main()"
    for command in (["migrate"], ["serve"]):
        result = subprocess.run([sys.executable, "-c", script, "controlplane", *command], cwd=tmp_path,
                                env={"SPILLWAY_DATABASE_URL": "postgresql://x@127.0.0.1:9/db", "PATH": "/usr/bin"},
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert result.returncode == 2, result.stderr
        extra = "pip install 'spillway[postgres]'"
        assert result.stderr == f"error: this command needs psycopg, which this install lacks: {extra}\n"
