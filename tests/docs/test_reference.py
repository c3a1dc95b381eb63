"""The generated references of the site (tools/gen_reference.py) are what the code generates now, and the code
describes everything they show: every command's option, every setting and config key, every validator's rule."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "run .venv/bin/python tools/gen_reference.py"
CODE = ["spillway", "controlplane", "edge_agent", "dashboards"]


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def _config_models() -> list[Any]:
    from controlplane.settings import Settings
    from edge_agent.config import AgentConfig

    return [Settings, *(model for _, model, _ in gen.agent_sections(AgentConfig))]


def _code_text() -> str:
    files = [f for folder in CODE for f in sorted((ROOT / folder).rglob("*.py"))] + [ROOT / "tests" / "conftest.py"]
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


@pytest.fixture(scope="module")
def outputs() -> dict[Path, str]:
    return gen.generate()


def test_the_committed_references_are_what_the_code_generates(outputs: dict[Path, str]) -> None:
    stale = [str(p.relative_to(ROOT)) for p in gen.stale(outputs)]
    assert stale == [], f"{', '.join(stale)} differ from the code: {REGENERATE}"


def test_every_command_option_and_argument_has_help() -> None:
    contexts = list(gen.commands())
    assert {"spillway agent serve", "spillway controlplane serve", "spillway slo import"} <= {
        ctx.command_path for ctx in contexts
    }
    bare = [ctx.command_path for ctx in contexts if not (ctx.command.help or "").strip()]
    bare += [f"{ctx.command_path} {p.opts[-1]}" for ctx in contexts for p in gen.parameters(ctx) if not p.help]
    assert bare == [], f"no help text (typer.Option(help=...), a docstring): {bare}"


def test_every_setting_and_config_key_has_a_description_and_every_validator_a_rule() -> None:
    models = _config_models()
    assert {m.__name__ for m in models} >= {"Settings", "AgentConfig", "OverflowSettings", "BreakerSettings",
                                           "GenerationSettings", "TenantConfig", "OtlpEndpoint"}  # fmt: skip
    bare = [f"{m.__name__}.{name}" for m in models for name, f in m.model_fields.items() if not f.description]
    assert bare == [], f"no Field(description=...): {bare}"
    for model in models:
        gen.rules(model)  # SystemExit naming a validator without a docstring


def test_a_changed_description_makes_the_check_fail(
    monkeypatch: pytest.MonkeyPatch, outputs: dict[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from controlplane.settings import Settings
    from edge_agent.config import BreakerSettings

    page = gen.REFERENCE / "configuration.md"
    committed = page.read_text(encoding="utf-8")
    monkeypatch.setattr(Settings.model_fields["port"], "description", "A changed description.")
    monkeypatch.setattr(BreakerSettings.model_fields["open_s"], "description", "another changed one")
    changed = gen.configuration_page()
    assert "| A changed description. |" in changed and "| another changed one |" in changed
    assert gen.stale({**outputs, page: changed}) == [page]
    schema = json.loads(outputs[gen.REFERENCE / "openapi.json"])
    monkeypatch.setattr(gen, "openapi_schema", lambda: schema)  # the app's schema once is enough
    assert gen.main(["--check"]) == 1
    assert "stale: docs/reference/configuration.md" in capsys.readouterr().err
    assert page.read_text(encoding="utf-8") == committed, "--check wrote the file"


def test_the_output_depends_on_the_code_alone(tmp_path: Path) -> None:
    """Another terminal, home, state folder, hash seed and SPILLWAY_*/OTEL_* variables: the same files."""
    env = {**os.environ, "COLUMNS": "37", "TERM": "dumb", "FORCE_COLOR": "1", "HOME": str(tmp_path),
           "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONHASHSEED": "7", "SPILLWAY_PORT": "1234",
           "SPILLWAY_DATABASE_URL": "postgresql://nowhere/spillway", "SPILLWAY_API": "http://elsewhere:1",
           "SPILLWAY_AGENT_TOKEN": "t", "OTEL_SERVICE_NAME": "other"}  # fmt: skip
    run = subprocess.run([sys.executable, "tools/gen_reference.py", "--check"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, f"the references changed with the environment: {run.stderr}"


def test_every_environment_variable_the_code_names_is_in_the_reference() -> None:
    from controlplane.settings import Settings
    from edge_agent.telemetry import environment

    code = _code_text()
    listed = [name for name, _, _ in gen.ENVIRONMENT if isinstance(name, str)]
    gone = [name for name in listed if not re.search(rf"[\"']{name}[\"']", code)]
    assert gone == [], f"listed in tools/gen_reference.py ENVIRONMENT, read nowhere in the code any more: {gone}"
    documented = {var for var, _, _ in gen.environment()} | {f"SPILLWAY_{n.upper()}" for n in Settings.model_fields}
    named = set(re.findall(r"[\"'](SPILLWAY_[A-Z0-9_]*[A-Z0-9])[\"']", code))
    named |= {v for k, v in vars(environment).items() if k.isupper() and str(v).startswith("OTEL_")}
    assert sorted(named - documented) == [], "add them to ENVIRONMENT in tools/gen_reference.py"


def test_the_anchors_other_pages_link_to_exist(outputs: dict[Path, str]) -> None:
    """The scheme of /work/notes/anchors19.md: a command, an option, a setting, a config key, a variable, an
    operation."""
    expected = {
        "cli.md": ["spillway-agent-serve", "spillway-agent-serve--grpc-port", "spillway-controlplane-serve--migrate",
                   "spillway-slo-import--file", "spillway-slo-export--all"],
        "configuration.md": ["control-plane", "spillway-ingest-ack", "control-plane-rules", "edge-agent", "agent-port",
                             "agent-overflow-breaker-slow-rt-ms", "agent-tenants", "agent-tenants-weight",
                             "environment-variables", "spillway-api-key", "otel-exporter-otlp-endpoint",
                             "edge-agent-rules", "model-configuration"],
        "rest-api.md": ["errors", "tag-slos", "post-api-v1-slos", "get-api-v1-slos-item-id-status", "post-v1-metrics"],
    }  # fmt: skip
    for page, anchors in expected.items():
        text = outputs[gen.REFERENCE / page]
        ids = set(re.findall(r'\{#([a-z0-9-]+)\}|<a id="([a-z0-9-]+)">', text))
        found = {a for pair in ids for a in pair if a}
        assert [a for a in anchors if a not in found] == [], page
