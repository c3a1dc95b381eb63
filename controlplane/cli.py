"""The `spillway` command. Imports stay inside commands so that `spillway --help` and agent commands stay light."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from edge_agent.cli import agent_app, models_app

if TYPE_CHECKING:
    from controlplane.settings import Settings

app = typer.Typer(help="Spillway: keep edge AI inference inside its SLOs.", no_args_is_help=True)
controlplane_app = typer.Typer(help="Run and administer the control plane.", no_args_is_help=True)
app.add_typer(controlplane_app, name="controlplane")
app.add_typer(agent_app, name="agent")
app.add_typer(models_app, name="models")


def _settings(**overrides: Any) -> Settings:
    from pydantic import ValidationError

    from controlplane.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            name = f"SPILLWAY_{field.upper()}: " if field else ""
            typer.echo(f"error: invalid setting {name}{err['msg']}", err=True)
        raise typer.Exit(2) from None


@app.command()
def version() -> None:
    """Print Spillway's version."""
    from controlplane import __version__

    typer.echo(__version__)


@controlplane_app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="listen address [SPILLWAY_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="listen port [SPILLWAY_PORT]")] = None,
    migrate: Annotated[
        bool | None, typer.Option(help="migrate the database at start [SPILLWAY_MIGRATE_ON_START]")
    ] = None,
) -> None:
    """Serve the REST policy API (migrates the database first unless --no-migrate)."""
    import uvicorn

    from controlplane.app import create_app
    from edge_agent.serving.graceful import GracefulServer

    settings = _settings(host=host, port=port, migrate_on_start=migrate)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=_log_config(),
        ssl_certfile=settings.tls_certfile,
        ssl_keyfile=settings.tls_keyfile,
        proxy_headers=False,
        server_header=False,
    )
    # On SIGTERM: the listener closes first, every request read (the gateway's included) is answered, and each
    # keep-alive connection is closed only between two requests.
    GracefulServer(config).run()


def _log_config() -> dict[str, Any]:
    """uvicorn's logging, with the access log leaving out the gateway's inference requests (a line per overflowed
    request would cost more than the gateway's own work; its metrics count them)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["no_gateway"] = {"()": "controlplane.gateway.dispatch.NotGatewayAccess"}
    config["handlers"]["access"]["filters"] = ["no_gateway"]
    return config


@controlplane_app.command()
def migrate(revision: Annotated[str, typer.Option(help="target revision")] = "head") -> None:
    """Upgrade the database schema (SPILLWAY_DATABASE_URL) to a revision, the newest by default."""
    from controlplane.db.migrate import migrate_to

    settings = _settings()
    migrate_to(settings.database_url, revision)
    typer.echo(f"database at {revision}", err=True)


@controlplane_app.command()
def downgrade(revision: Annotated[str, typer.Option(help="target revision, e.g. -1 or base")]) -> None:
    """Downgrade the database schema to a revision."""
    from controlplane.db.migrate import downgrade_to

    downgrade_to(_settings().database_url, revision)
    typer.echo(f"database at {revision}", err=True)


@controlplane_app.command("create-key")
def create_key(
    name: Annotated[str, typer.Option(help="unique key name, e.g. the operator's")],
    role: Annotated[str, typer.Option(help="viewer, editor or admin")] = "viewer",
) -> None:
    """Create an API key and print it alone on stdout (it is shown only once)."""
    from pydantic import ValidationError

    from controlplane.access import issue_api_key
    from controlplane.db import make_engine, make_sessionmaker, migrate_to, transaction
    from controlplane.db.repository import Actor
    from controlplane.errors import SpillwayError
    from controlplane.schemas.access import ApiKeyCreate

    try:
        body = ApiKeyCreate.model_validate({"name": name, "role": role})
    except ValidationError as exc:
        for err in exc.errors():
            typer.echo(f"error: --{err['loc'][0]}: {err['msg']}", err=True)
        raise typer.Exit(2) from None
    settings = _settings()
    migrate_to(settings.database_url)
    engine = make_engine(settings.database_url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            _, key = issue_api_key(
                session, body.name, body.role, Actor("cli", "created with spillway controlplane create-key")
            )
    except SpillwayError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from None
    finally:
        engine.dispose()
    sys.stdout.write(key + "\n")


@app.command()
def demo(
    port: Annotated[int, typer.Option(help="control plane port")] = 8400,
    agent_port: Annotated[int, typer.Option(help="edge agent port")] = 8001,
    dashboard_port: Annotated[int, typer.Option(help="web dashboard port (0: no dashboard)")] = 8501,
    data_dir: Annotated[str, typer.Option(help="where the demo keeps its database")] = ".spillway-demo",
    once: Annotated[bool, typer.Option(help="seed, print, and stop instead of serving until Ctrl-C")] = False,
) -> None:
    """Start a control plane, an edge agent and the dashboard, seed the example fleet, and run the story: a burst,
    its telemetry and SLOs, and a load ramp that makes a degradation rule fire and recover."""
    from controlplane.demo import run_demo

    raise typer.Exit(run_demo(port=port, agent_port=agent_port, data_dir=data_dir, once=once,
                              dashboard_port=dashboard_port))  # fmt: skip


@app.command()
def dashboard(
    api: Annotated[str, typer.Option(help="the control plane's base URL")] = "http://127.0.0.1:8400",
    port: Annotated[int, typer.Option(help="dashboard port")] = 8501,
    host: Annotated[str, typer.Option(help="dashboard listen address")] = "127.0.0.1",
) -> None:
    """Serve the web dashboard (Streamlit) for a control plane; the API key comes from SPILLWAY_API_KEY."""
    import os

    from dashboards import run_dashboard

    key = os.environ.get("SPILLWAY_API_KEY", "").strip()
    if not key:
        typer.echo("error: set SPILLWAY_API_KEY to an API key (viewer, editor or admin); a viewer key can look but "
                   "not edit", err=True)  # fmt: skip
        raise typer.Exit(2)
    typer.echo(f"Spillway dashboard on http://{host}:{port} for the control plane at {api}", err=True)
    run_dashboard(api, key, port=port, host=host)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
