"""Fixtures for the edge agent: the demo repository built once, and a real agent on a loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edge_agent.config import AgentConfig
from edge_agent.runtime.demo_models import build_demo_repository
from edge_agent.serving.app import InferenceApp
from edge_agent.serving.models import ModelRegistry
from edge_agent.serving.server import build_registry
from tests.utils.server import serving


@pytest.fixture(scope="session")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_repository(tmp_path_factory.mktemp("models"))


@dataclass
class RunningAgent:
    url: str
    app: InferenceApp
    registry: ModelRegistry


@pytest.fixture(scope="module")
def agent(demo_repo: Path) -> Iterator[RunningAgent]:
    """The real agent (both mlp versions, warmed up) behind uvicorn on 127.0.0.1."""
    config = AgentConfig(model_repository=demo_repo, intra_op_threads=2, max_body_bytes=8 << 20)
    registry = build_registry(config)
    app = InferenceApp(registry, max_body_bytes=config.max_body_bytes, allow_non_finite=False)
    with serving(app) as url:  # type: ignore[arg-type]
        yield RunningAgent(url, app, registry)
    for model in registry.all():
        model.worker.close()
