"""The one `spillway` command: subcommands call into the parts.

Imports stay inside commands, so that `spillway --help` and the agent's commands load no control-plane, dashboard or
demo code: on a lean install (`pip install spillway`, the agent alone) `spillway agent serve` works, and a
control-plane or dashboard command says which extra to install."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from spillway.slo_cli import slo_app  # typer and httpx only: a lean install imports it too

if TYPE_CHECKING:
    from controlplane.settings import Settings

app = typer.Typer(help="Spillway: keep edge AI inference inside its SLOs.", no_args_is_help=True)
controlplane_app = typer.Typer(help="Run and administer the control plane.", no_args_is_help=True)
agent_app = typer.Typer(help="Run the edge agent.", no_args_is_help=True)
models_app = typer.Typer(help="Model repository tools.", no_args_is_help=True)
app.add_typer(controlplane_app, name="controlplane")
app.add_typer(agent_app, name="agent")
app.add_typer(models_app, name="models")
app.add_typer(slo_app, name="slo")


def _settings(**overrides: Any) -> Settings:
    import re

    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from controlplane.settings import Settings
    from edge_agent.config_errors import plain_message

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            name = f"invalid setting SPILLWAY_{field.upper()}: " if field else ""
            typer.echo(f"error: {name}{plain_message(err, Settings)}", err=True)
        raise typer.Exit(2) from None
    except SettingsError as exc:  # a list or mapping variable that is not JSON
        found = re.search(r'field "(\w+)"', str(exc))
        name = f"SPILLWAY_{found.group(1).upper()}" if found else "a SPILLWAY_ variable"
        typer.echo(f"error: invalid setting {name}: not valid JSON (e.g. [1, 5, 10])", err=True)
        raise typer.Exit(2) from None


@app.command()
def version() -> None:
    """Print Spillway's version."""
    from spillway import __version__

    typer.echo(__version__)


@controlplane_app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="listen address [SPILLWAY_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="listen port [SPILLWAY_PORT]")] = None,
    migrate: Annotated[
        bool | None, typer.Option(help="migrate the database at start [SPILLWAY_MIGRATE_ON_START]")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(help="processes serving the port, SO_REUSEPORT; >1 needs PostgreSQL [SPILLWAY_WORKERS]"),
    ] = None,
) -> None:
    """Serve the REST policy API (migrates the database first unless --no-migrate)."""
    import uvicorn

    from controlplane.app import create_app
    from spillway.graceful import GracefulServer
    from spillway.workers import reuseport_socket, supervise, worker_index

    settings = _settings(host=host, port=port, migrate_on_start=migrate, workers=workers)
    _database_driver(settings.database_url)
    index = worker_index()
    if settings.workers > 1 and index is None:  # the parent: start the workers, each serving the port itself
        os.environ.update({"SPILLWAY_HOST": settings.host, "SPILLWAY_PORT": str(settings.port),
                           "SPILLWAY_MIGRATE_ON_START": str(settings.migrate_on_start).lower(),
                           "SPILLWAY_WORKERS": str(settings.workers)})  # fmt: skip
        argv = [sys.executable, "-c", "from spillway.cli import main; main()", "controlplane", "serve"]
        raise typer.Exit(supervise(settings.workers, argv, say=_say_err, address=(settings.host, settings.port)))
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
    if index is None:
        GracefulServer(config).run()
    else:  # one of several workers: its own listening socket on the shared port
        GracefulServer(config).run(sockets=[reuseport_socket(settings.host, settings.port)])


def _database_driver(url: str) -> None:
    """Import the URL's driver now: a missing psycopg is then main()'s one line naming the extra, not a traceback in
    the server's startup."""
    from sqlalchemy.engine import make_url

    from controlplane.db import normalise_url

    make_url(normalise_url(url)).get_dialect().import_dbapi()


def _log_config() -> dict[str, Any]:
    """uvicorn's logging, with the access log leaving out the gateway's inference requests (a line per overflowed
    request would cost more than the gateway's own work; its metrics count them)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["no_gateway"] = {"()": "controlplane.gateway.dispatch.NotGatewayAccess"}
    config["handlers"]["access"]["filters"] = ["no_gateway"]
    # migrate-on-start says each revision it applies, with its duration (controlplane/db/migrate.py)
    config["loggers"]["spillway.controlplane.migrate"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


@controlplane_app.command()
def migrate(revision: Annotated[str, typer.Option(help="target revision")] = "head") -> None:
    """Upgrade the database schema (SPILLWAY_DATABASE_URL) to a revision, the newest by default; each revision
    applied is said on stderr with its duration."""
    from controlplane.db.migrate import migrate_to

    settings = _settings()
    started = time.monotonic()
    with _revision_errors(revision):
        applied = migrate_to(settings.database_url, revision, say=_say_err)
    typer.echo(f"database at {revision} ({applied} revision{'s' if applied != 1 else ''} applied in "
               f"{time.monotonic() - started:.1f} s)", err=True)  # fmt: skip


def _say_err(line: str) -> None:
    typer.echo(line, err=True)


@contextlib.contextmanager
def _revision_errors(revision: str) -> Iterator[None]:
    """Alembic's refusals (an unknown revision, a database stamped by a newer Spillway) as one line, exit 2."""
    from alembic.util import CommandError

    try:
        yield
    except CommandError as exc:
        typer.echo(f"error: cannot migrate to {revision!r}: {exc} (a typo in --revision, or a database migrated by "
                   "a newer Spillway: upgrade Spillway, or restore the backup taken before that upgrade)",
                   err=True)  # fmt: skip
        raise typer.Exit(2) from None


@controlplane_app.command()
def downgrade(revision: Annotated[str, typer.Option(help="target revision, e.g. -1 or base")]) -> None:
    """Downgrade the database schema (SPILLWAY_DATABASE_URL) to a revision; each revision undone is said on stderr
    with its duration."""
    from controlplane.db.migrate import downgrade_to

    with _revision_errors(revision):
        undone = downgrade_to(_settings().database_url, revision, say=_say_err)
    typer.echo(f"database at {revision} ({undone} revision{'s' if undone != 1 else ''} undone)", err=True)


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
    agent_port: Annotated[int, typer.Option(help="edge agent HTTP port")] = 8000,
    dashboard_port: Annotated[int, typer.Option(help="web dashboard port (0: no dashboard)")] = 8501,
    data_dir: Annotated[str, typer.Option(help="where the demo keeps its database")] = ".spillway-demo",
    once: Annotated[bool, typer.Option(help="play the story, then stop instead of serving until Ctrl-C")] = False,
) -> None:
    """Start a control plane, edge agents and the dashboard, seed the example fleet, and run the story: a burst, its
    telemetry and SLOs, a load ramp that makes a degradation rule fire and recover, overflow to a cloud backend
    (killed and brought back), and streaming generative traffic under a TTFT SLO."""
    from spillway.demo.run import run_demo

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


# ---- the edge agent (no control-plane imports) ----


def _import_in_background(module: str) -> None:
    """Import `module` on a daemon thread (what needs it later waits on Python's per-module import lock); a failure
    is left for the import that needs it to report."""
    import contextlib
    import importlib
    import threading

    def run() -> None:
        with contextlib.suppress(Exception):
            importlib.import_module(module)

    threading.Thread(target=run, name=f"import {module}", daemon=True).start()


@agent_app.command("serve")
def agent_serve(
    model_repository: Annotated[
        Path | None, typer.Option(help="Triton-layout model repository (or the config's model_repository)")
    ] = None,
    host: Annotated[str | None, typer.Option(help="listen address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (default 8000)")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="V2 gRPC port (default 8001; -1: no gRPC)")] = None,
    config: Annotated[Path | None, typer.Option(help="agent config YAML; command-line options win over it")] = None,
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

    from edge_agent.config import AgentConfig
    from edge_agent.config_errors import AgentConfigError
    from edge_agent.runtime.config import ModelConfigError
    from edge_agent.runtime.gpu import GpuMemoryError
    from edge_agent.runtime.memory import HostMemoryError
    from edge_agent.runtime.runner import RunnerError

    try:
        agent = AgentConfig.load(
            config, model_repository=model_repository, host=host, port=port,
            grpc_port=None if grpc_port == -1 else grpc_port,
            allow_unauthenticated=allow_unauthenticated or None, control_plane=control_plane,
            agent_token=agent_token,
        )  # fmt: skip
    except AgentConfigError as exc:  # one plain line per problem: file, line, key and the fix
        for line in exc.lines:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(2) from None
    if grpc_port == -1:
        agent = agent.model_copy(update={"grpc_port": None})
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per policy poll; failures log on their own
    from edge_agent.serving.ports import PortUnavailable, check_ports
    from edge_agent.serving.server import build_registry, serve

    try:  # before the models load (minutes of warm-up on a small device): a port it cannot serve is said at once
        ports = check_ports(agent)
    except PortUnavailable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if ports.grpc is not None:  # grpcio and the generated code take ~0.5 s to import: beside the models' warm-up
        _import_in_background("edge_agent.serving.grpc_server")
    try:
        registry = build_registry(agent)
    except (ModelConfigError, RunnerError, GpuMemoryError, HostMemoryError) as exc:
        typer.echo(f"error: cannot load the model repository: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        serve(agent, registry=registry, ports=ports, log_level=log_level)
    except ModelConfigError as exc:  # settings that do not fit the models (overflow defaults, async models)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except (GpuMemoryError, HostMemoryError) as exc:  # a generative model's engines, loaded as the server starts
        typer.echo(f"error: cannot load the model repository: {exc}", err=True)
        raise typer.Exit(2) from None


@models_app.command("build-demo")
def build_demo(
    out: Annotated[Path, typer.Option(help="where to write the model repository")],
    size: Annotated[
        Literal["demo", "bench"],
        typer.Option(help="demo: the demo repository; bench: only `tiny-lm-bench` v1, the wider decoder"),
    ] = "demo",
) -> None:
    """Write the demo repository: model `mlp`, v1 full (512-4096-4096-1000) and v2 lite (512-1024-1024-1000), and the
    decoder `tiny-lm` (v1 3 layers, v2 lite 1 layer) with its byte-level tokenizer and chat template. With `--size
    bench`, only the decoder `tiny-lm-bench` v1 instead (width 512, 4 layers, 8 heads, 4 KV heads, context 1024; the
    same tokenizer and template), on which the model's compute dominates a step. Each version is named on stderr as
    it is written, with its count and duration (a progress bar on a terminal)."""
    from spillway.demo.models import DEMO_VERSIONS, build_bench_repository, build_demo_repository
    from spillway.demo.progress import Steps

    what = f"building the {size} model repository in {out} (seeded weights, no downloads)"
    with Steps(what, total=1 if size == "bench" else DEMO_VERSIONS) as steps:

        def built(line: str) -> None:
            steps.done(f"built {line}")

        if size == "bench":
            root = build_bench_repository(out, progress=built)
        else:
            root = build_demo_repository(out, progress=built)
    typer.echo(f"wrote {root} (serve it: spillway agent serve --model-repository {root})")


@agent_app.command("burst")
def agent_burst(
    url: Annotated[str, typer.Option(help="the agent's base URL")] = "http://127.0.0.1:8000",
    model: Annotated[str, typer.Option(help="model name")] = "mlp",
    version: Annotated[
        str | None, typer.Option(help="model version (default: none named, the version the agent serves by default)")
    ] = None,
    requests: Annotated[int, typer.Option(min=1, max=100_000, help="how many requests")] = 600,
    concurrency: Annotated[int, typer.Option(min=1, max=1024, help="concurrent clients")] = 48,
) -> None:
    """Send a short burst of mixed-priority traffic and print outcomes and latency per priority, and which versions
    answered."""
    import asyncio

    from spillway.demo.burst import format_report, run_burst

    route = f"version {version}" if version else "no version named: the agent's default"
    typer.echo(f"{requests} requests to {model} ({route}) from {concurrency} clients at {url}")
    reports = asyncio.run(run_burst(url, model=model, version=version, requests=requests, concurrency=concurrency))
    typer.echo(format_report(reports))


# What each extra brings: a command that needs one on an install without it says which to install.
_EXTRAS = {"fastapi": "controlplane", "sqlalchemy": "controlplane", "alembic": "controlplane",
           "prometheus_client": "controlplane", "psycopg": "postgres", "streamlit": "dashboard", "pandas": "dashboard",
           "altair": "dashboard"}  # fmt: skip


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as exc:
        extra = _EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        typer.echo(f"error: this command needs {exc.name}, which this install lacks: pip install 'spillway[{extra}]'",
                   err=True)  # fmt: skip
        sys.exit(2)


if __name__ == "__main__":
    main()
