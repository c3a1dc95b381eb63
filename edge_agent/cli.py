"""`spillway agent ...` and `spillway models ...`: the edge agent's commands (no control-plane imports)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

agent_app = typer.Typer(help="Run the edge agent.", no_args_is_help=True)
models_app = typer.Typer(help="Model repository tools.", no_args_is_help=True)


@agent_app.command("serve")
def serve(
    model_repository: Annotated[Path | None, typer.Option(help="Triton-layout model repository")] = None,
    host: Annotated[str | None, typer.Option(help="listen address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="listen port (default 8001)")] = None,
    config: Annotated[Path | None, typer.Option(help="agent config YAML")] = None,
    allow_unauthenticated: Annotated[
        bool, typer.Option(help="serve beyond loopback without a token (not recommended)")
    ] = False,
    control_plane: Annotated[
        str | None, typer.Option(help="control plane URL: metrics go to <URL>/v1/metrics, policies are polled from it")
    ] = None,
    agent_token: Annotated[
        str | None, typer.Option(envvar="SPILLWAY_AGENT_TOKEN", help="this agent's token (or SPILLWAY_AGENT_TOKEN)")
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
) -> None:
    """Serve the models of a repository over the Open Inference Protocol (KServe V2)."""
    import logging

    from pydantic import ValidationError

    from edge_agent.config import AgentConfig
    from edge_agent.runtime.config import ModelConfigError
    from edge_agent.runtime.gpu import GpuMemoryError
    from edge_agent.runtime.runner import RunnerError

    try:
        agent = AgentConfig.load(
            config, model_repository=model_repository, host=host, port=port,
            allow_unauthenticated=allow_unauthenticated or None, control_plane=control_plane,
            agent_token=agent_token,
        )  # fmt: skip
    except (ValidationError, ValueError, OSError) as exc:
        typer.echo(f"error: invalid agent config: {exc}", err=True)
        raise typer.Exit(2) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per policy poll; failures log on their own
    from edge_agent.serving.server import build_registry, serve

    try:
        registry = build_registry(agent)
    except (ModelConfigError, RunnerError, GpuMemoryError) as exc:
        typer.echo(f"error: cannot load the model repository: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        serve(agent, registry=registry, log_level=log_level)
    except ModelConfigError as exc:  # settings that do not fit the models (overflow defaults, async models)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@models_app.command("build-demo")
def build_demo(out: Annotated[Path, typer.Option(help="where to write the model repository")]) -> None:
    """Write the demo repository: model `mlp`, v1 full (512-4096-4096-1000) and v2 lite (512-1024-1024-1000)."""
    from edge_agent.runtime.demo_models import build_demo_repository

    root = build_demo_repository(out)
    typer.echo(str(root))


@agent_app.command("burst")
def burst(
    url: Annotated[str, typer.Option(help="the agent's base URL")] = "http://127.0.0.1:8001",
    model: Annotated[str, typer.Option(help="model name")] = "mlp",
    version: Annotated[str, typer.Option(help="model version")] = "1",
    requests: Annotated[int, typer.Option(min=1, max=100_000, help="how many requests")] = 600,
    concurrency: Annotated[int, typer.Option(min=1, max=1024, help="concurrent clients")] = 48,
) -> None:
    """Send a short burst of mixed-priority traffic and print outcomes and latency per priority."""
    import asyncio

    from edge_agent.burst import format_report, run_burst

    reports = asyncio.run(run_burst(url, model=model, version=version, requests=requests, concurrency=concurrency))
    typer.echo(format_report(reports))
