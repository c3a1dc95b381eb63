"""The edge agent stays lean for a Jetson: it imports no control-plane, dashboard, demo or web-framework code, the
contract imports nothing else of ours, and `pip install spillway` (no extra) is enough to serve."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.utils.server import free_port

REPO = Path(__file__).resolve().parents[2]
# What the agent must never import: the other services, the demo and the one CLI, and their heavy dependencies.
# (prometheus_client is not among them: the agent serves /metrics through opentelemetry-exporter-prometheus.)
AGENT_FORBIDDEN = ("controlplane", "dashboards", "spillway.demo", "spillway.cli", "fastapi", "sqlalchemy", "alembic",
                   "streamlit", "pandas", "altair", "pydantic_settings")  # fmt: skip
CONTROLPLANE_FORBIDDEN = ("edge_agent", "dashboards", "spillway.demo", "spillway.cli")
# The agent's own dependencies: the base install holds these and nothing of the extras.
EXTRAS_ONLY = ("fastapi", "sqlalchemy", "alembic", "streamlit", "pandas", "pydantic-settings")


def _imports(package: Path) -> list[tuple[str, str]]:
    """(file, module) for every import in the package's files, relative imports resolved."""
    found = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(str(path.relative_to(REPO)), a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((str(path.relative_to(REPO)), node.module))
    return found


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{f}: {m}" for f, m in _imports(REPO / package) if any(m == x or m.startswith(x + ".") for x in forbidden)]


def test_no_agent_module_imports_server_dashboard_or_demo_code() -> None:
    assert _offenders("edge_agent", AGENT_FORBIDDEN) == []


def test_the_control_plane_shares_only_the_contract_with_the_agent() -> None:
    assert _offenders("controlplane", CONTROLPLANE_FORBIDDEN) == []


def test_the_contract_imports_nothing_else_of_ours() -> None:
    ours = [(f, m) for f, m in _imports(REPO / "spillway" / "contract") if m.split(".")[0] in
            ("spillway", "edge_agent", "controlplane", "dashboards")]  # fmt: skip
    assert [f"{f}: {m}" for f, m in ours if not m.startswith("spillway.contract")] == []


def test_serving_the_agent_loads_none_of_them() -> None:
    code = (
        "import sys; import edge_agent.serving.server, edge_agent.policy.client, edge_agent.telemetry, spillway.cli; "
        f"print(sorted(m for m in sys.modules if any(m == x or m.startswith(x + '.') for x in {AGENT_FORBIDDEN!r})"
        " and m != 'spillway.cli'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def _run(*args: str | Path, timeout: float = 600, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{args[:3]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_the_wheel_without_extras_installs_checks_and_serves(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", wheels, REPO)
    (wheel,) = wheels.glob("spillway-*.whl")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    bin_ = venv / "bin"
    _run(bin_ / "python", "-m", "pip", "install", "--quiet", wheel)
    _run(bin_ / "python", "-m", "pip", "check")  # every requirement of what is installed is there
    installed = {p["name"].lower() for p in json.loads(_run(bin_ / "python", "-m", "pip", "list", "--format=json"))}
    assert "onnxruntime" in installed and "spillway" in installed
    assert sorted(installed & set(EXTRAS_ONLY)) == []

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")}
    # A control-plane command on the agent-only install says which extra it needs, without a trace.
    refused = subprocess.run([bin_ / "spillway", "controlplane", "migrate"], capture_output=True, text=True,
                             timeout=60, env=env)  # fmt: skip
    assert refused.returncode == 2 and "pip install 'spillway[controlplane]'" in refused.stderr
    assert "Traceback" not in refused.stderr

    models = tmp_path / "models"
    _run(bin_ / "spillway", "models", "build-demo", "--out", models, env=env)
    port = free_port()
    agent = subprocess.Popen(
        [bin_ / "spillway", "agent", "serve", "--model-repository", models, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert agent.poll() is None, agent.stderr.read().decode() if agent.stderr else "the agent exited"
            assert time.monotonic() < deadline, "the agent never became ready"
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        row = np.linspace(-1, 1, 512, dtype=np.float32).tolist()
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 512], "data": row}]}
        answer = httpx.post(f"{url}/v2/models/mlp/infer", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.headers["spillway-outcome"] == "local"
        (output,) = answer.json()["outputs"]
        assert output["shape"] == [1, 1000] and len(output["data"]) == 1000
    finally:
        agent.terminate()
        agent.wait(timeout=30)
