"""`spillway agent burst` against a plain `spillway agent serve`: with no version named it goes where the agent's
requests without one go (the newest version loaded, as in Triton, unless `default_versions` says otherwise), and it
says which version answered."""

from __future__ import annotations

import re

import httpx
from typer.testing import CliRunner

from spillway.cli import app
from tests.agent.conftest import RunningAgent


def _burst(agent: RunningAgent, *extra: str) -> str:
    result = CliRunner().invoke(app, ["agent", "burst", "--url", agent.url, "--requests", "60", "--concurrency", "4",
                                      *extra])  # fmt: skip
    assert result.exit_code == 0, result.output
    return result.stdout


def _answered(stdout: str) -> dict[str, int]:
    found = re.search(r"^answered by version (.+)$", stdout, re.MULTILINE)
    assert found, stdout
    return {v: int(n) for v, n in re.findall(r"(\w+): (\d+)", found.group(1))}


def test_burst_names_no_version_by_default_and_says_which_answered(agent: RunningAgent) -> None:
    default = httpx.get(f"{agent.url}/v2/spillway/status", timeout=10).json()["models"]["mlp"]["served_version"]
    plain = httpx.post(f"{agent.url}/v2/models/mlp/infer", timeout=10, json={
        "inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.1] * 512}]})  # fmt: skip
    assert plain.json()["model_version"] == str(default)
    stdout = _burst(agent)
    assert "60 requests to mlp (no version named: the agent's default) from 4 clients" in stdout
    answered = _answered(stdout)
    assert list(answered) == [str(default)], stdout  # the version a request naming none gets, and only it
    served = re.search(r"^served (\d+) of 60", stdout, re.MULTILINE)
    assert served and sum(answered.values()) == int(served.group(1)), stdout


def test_burst_for_a_named_version_reaches_that_version(agent: RunningAgent) -> None:
    stdout = _burst(agent, "--version", "1")
    assert "60 requests to mlp (version 1)" in stdout
    assert list(_answered(stdout)) == ["1"], stdout
