"""A config error at `spillway agent serve` is a plain line naming the file, the line (and column, for YAML syntax),
the key and the fix, with exit code 2 and no traceback; and `spillway models build-demo` says what it builds.

The CLI runs as a real process; every config here is refused before any model loads (the repository is absent)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.config import AgentConfig
from edge_agent.config_errors import AgentConfigError

PYDANTIC_WORDS = ("Traceback", "<unicode string>", "errors.pydantic.dev", "input_value", "Value error", "Input should")


def _serve(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`spillway agent serve ARGS` in `cwd`, without the caller's SPILLWAY_ variables (an agent token)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")}
    return subprocess.run([sys.executable, "-m", "spillway.cli", "agent", "serve", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def _refused(tmp_path: Path, config: str) -> list[str]:
    """The error lines of `spillway agent serve --config agent.yaml` with `config` in agent.yaml."""
    (tmp_path / "agent.yaml").write_text(config)
    result = _serve(tmp_path, "--config", "agent.yaml")
    assert result.returncode == 2, result.stderr
    for words in PYDANTIC_WORDS:
        assert words not in result.stderr
    return result.stderr.splitlines()


def test_a_yaml_indentation_error_names_line_and_column(tmp_path: Path) -> None:
    lines = _refused(tmp_path, "model_repository: models\nport: 8000\n  host: 0.0.0.0\n")
    assert lines == ["error: agent.yaml:3:7: mapping values are not allowed here (check the indentation: this line "
                     "is indented more than the key above it)"]  # fmt: skip


def test_a_key_out_of_line_is_a_yaml_error_with_the_fix(tmp_path: Path) -> None:
    lines = _refused(tmp_path, "model_repository: models\noverflow:\n    enabled: true\n  gateway: http://gw\n")
    assert len(lines) == 1 and lines[0].startswith("error: agent.yaml:4:3: ")
    assert "same column" in lines[0]


def test_a_misspelt_key_gets_the_closest_known_key(tmp_path: Path) -> None:
    lines = _refused(tmp_path, "model_repository: models\nprot: 8000\n")
    assert lines == ["error: agent.yaml:2: unknown setting `prot` (did you mean `port`?)"]


def test_a_misspelt_nested_key_gets_the_closest_key_of_its_mapping(tmp_path: Path) -> None:
    lines = _refused(tmp_path, "model_repository: models\noverflow:\n  gatway: http://gw\n")
    assert lines == ["error: agent.yaml:3: unknown setting `overflow.gatway` (did you mean `gateway`?)"]


def test_an_out_of_range_value_names_its_line_and_key_path(tmp_path: Path) -> None:
    lines = _refused(tmp_path, "model_repository: models\nport: 70000\noverflow:\n  breaker:\n    open_s: 0\n")
    assert lines == ["error: agent.yaml:2: port: must be at most 65535 (got 70000)",
                     "error: agent.yaml:5: overflow.breaker.open_s: must be more than 0 (got 0)"]  # fmt: skip


def test_a_wrong_type_names_the_expected_type(tmp_path: Path) -> None:
    lines = _refused(tmp_path, "model_repository: models\nport: eighty\nproviders: CPUExecutionProvider\n")
    assert lines == ["error: agent.yaml:2: port: must be a whole number (got 'eighty')",
                     "error: agent.yaml:3: providers: must be a list (got 'CPUExecutionProvider'): write [value], "
                     "or `- value` lines"]  # fmt: skip


def test_a_model_validator_keeps_its_words_at_the_key_it_names(tmp_path: Path) -> None:
    lines = _refused(tmp_path, "model_repository: models\nport: 9000\ncontrol_plane: http://cp:8400\n")
    assert lines == ["error: agent.yaml:3: control_plane needs agent_token: the control plane accepts metrics only "
                     "from agents"]  # fmt: skip


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    result = _serve(tmp_path, "--config", "agent.yaml")
    assert (result.returncode, result.stderr) == (2, "error: agent.yaml: no such file\n")


def test_command_line_settings_are_named_by_their_option(tmp_path: Path) -> None:
    result = _serve(tmp_path, "--model-repository", "models", "--port", "70000")
    assert (result.returncode, result.stderr) == (2, "error: --port: must be at most 65535 (got 70000)\n")


# In-process: what a person relies on beyond the CLI's shape.


def _problems(tmp_path: Path, config: str, **overrides: object) -> list[str]:
    path = tmp_path / "agent.yaml"
    path.write_text(config)
    with pytest.raises(AgentConfigError) as refused:
        AgentConfig.load(path, **overrides)
    return [line.removeprefix(f"{path}:") for line in refused.value.lines]


def test_secrets_are_never_echoed(tmp_path: Path) -> None:
    config = ("model_repository: m\nagent_token: 123456789\notlp_endpoints:\n"
              "  - endpoint: http://collector:4318/v1/metrics\n    headers: {api-key: 987654321}\n")  # fmt: skip
    problems = _problems(tmp_path, config)
    assert problems == ["2: agent_token: must be a string: put it in quotes",
                        "5: otlp_endpoints[0].headers.api-key: must be a string: put it in quotes"]  # fmt: skip


def test_a_union_value_gets_one_line_about_the_member_it_was_meant_for(tmp_path: Path) -> None:
    config = "model_repository: m\notlp_endpoints:\n  - 4318\n  - endpoint: http://c:4318\n    protcol: grpc\n"
    assert _problems(tmp_path, config) == [
        "3: otlp_endpoints[0]: must be a string or a mapping of settings (got 4318)",
        "5: unknown setting `otlp_endpoints[1].protcol` (did you mean `protocol`?)",
    ]


def test_a_key_set_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    assert _problems(tmp_path, "model_repository: m\nport: 9000\nport: 9001\n") == [
        "3: port is set twice (also on line 2; remove one)"
    ]


def test_many_problems_are_capped(tmp_path: Path) -> None:
    config = "model_repository: m\n" + "".join(f"unknown{i}: 1\n" for i in range(8))
    problems = _problems(tmp_path, config)
    assert len(problems) == 6 and problems[-1] == "and 3 more problems"
    assert problems[0] == "2: unknown setting `unknown0` (remove it)"


def test_a_nested_validator_is_placed_at_the_key_it_names(tmp_path: Path) -> None:
    config = "model_repository: m\ngeneration:\n  levels: 3\n  default_level: 5\n"
    assert _problems(tmp_path, config) == ["4: generation: default_level 5 is not one of the 3 levels"]


# ---- build-demo ----


def test_build_demo_says_what_it_builds(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "spillway.cli", "models", "build-demo"]
    assert "--out" in subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60).stdout
    result = subprocess.run([*command, "--out", "models"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    # Progress (stderr is not a terminal here: plain lines): each version as it is written, its count and duration.
    steps = [re.fullmatch(r"(built .+) \((\d) of 4, \d+\.\d s\)", line) for line in result.stderr.splitlines()
             if line.startswith("built ")]  # fmt: skip
    assert all(steps) and [int(m.group(2)) for m in steps if m] == [1, 2, 3, 4], result.stderr
    built = [m.group(1) for m in steps if m]
    assert [line.split(":")[0] for line in built] == ["built mlp v1 (full)", "built mlp v2 (lite)", "built tiny-lm v1",
                                                      "built tiny-lm v2 (lite)"]  # fmt: skip
    assert built[0].endswith("MLP 512 -> 4096 -> 4096 -> 1000, ReLU, FP32, 88 MiB")
    assert all(line.endswith("MiB") or line.endswith("KiB") for line in built)
    assert re.search(r"^building the demo model repository in models .*: 4 of 4 done in \d+\.\d s$", result.stderr,
                     re.MULTILINE), result.stderr  # fmt: skip
    assert result.stdout == "wrote models (serve it: spillway agent serve --model-repository models)\n"
    assert (tmp_path / "models" / "tiny-lm" / "2" / "model.onnx").is_file()


@pytest.mark.parametrize("stage", ["build_registry", "serve"])
def test_a_memory_refusal_at_start_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """A model that does not fit (host memory on a CPU or a Jetson, or a decoder's engines loaded as the server
    starts) stops the agent like any model that cannot load: one line naming why, exit 2, no traceback."""
    from typer.testing import CliRunner

    import edge_agent.serving.server as server
    from edge_agent.runtime.memory import HostMemoryError
    from spillway.cli import app

    def refuse(*args: object, **kwargs: object) -> None:
        raise HostMemoryError("mlp v1 needs about 900 MiB plus 256 MiB headroom, but only 512 MiB are available")

    if stage == "serve":
        monkeypatch.setattr(server, "build_registry", lambda agent: object())
    monkeypatch.setattr(server, stage, refuse)
    (tmp_path / "models").mkdir()
    result = CliRunner().invoke(app, ["agent", "serve", "--model-repository", str(tmp_path / "models"), "--port", "0",
                                      "--grpc-port", "-1"], env={"SPILLWAY_AGENT_TOKEN": ""})  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1] == (
        "error: cannot load the model repository: mlp v1 needs about 900 MiB plus 256 MiB headroom, but only 512 MiB "
        "are available"
    )
    assert result.exception is None or isinstance(result.exception, SystemExit)
