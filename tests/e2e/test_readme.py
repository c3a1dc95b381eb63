"""The README stays true: every setting and every CLI command it must mention is there."""

from __future__ import annotations

from pathlib import Path

from typer.main import get_command

from controlplane.settings import Settings
from spillway.cli import app

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_documented() -> None:
    names = [f"SPILLWAY_{name.upper()}" for name in Settings.model_fields]
    missing = [name for name in names if f"`{name}`" not in README]
    assert missing == []


def test_every_cli_command_is_documented() -> None:
    root = get_command(app)
    commands = []
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        subcommands = getattr(command, "commands", None)
        commands += [f"spillway {name} {sub}" for sub in subcommands] if subcommands else [f"spillway {name}"]
    missing = [c for c in commands if c not in README]
    assert missing == []
    assert "make demo" in README and "make test" in README


def test_every_agent_config_key_is_documented() -> None:
    from edge_agent.config import AgentConfig

    missing = [name for name in AgentConfig.model_fields if f"`{name}`" not in README]
    assert missing == []
