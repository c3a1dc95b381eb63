"""(being written)"""

import typer

slo_app = typer.Typer(help="SLOs in and out: OpenSLO import and export, Prometheus rules.", no_args_is_help=True)
