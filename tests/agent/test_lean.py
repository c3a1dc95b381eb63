"""The edge agent stays lean for a Jetson: no control-plane, web-framework or database imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "edge_agent"
FORBIDDEN = ("controlplane", "fastapi", "sqlalchemy", "alembic", "streamlit")


def test_no_agent_module_imports_server_code() -> None:
    offenders = []
    for path in AGENT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


def test_serving_the_agent_loads_none_of_them() -> None:
    code = (
        "import sys; import edge_agent.serving.server, spillway.cli, spillway.demo.burst; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
