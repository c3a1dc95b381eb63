"""Start the dashboard: a Streamlit server process running `dashboards/app.py` against one control plane."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from spillway.demo.harness import Process  # the standard library and httpx only

APP = Path(__file__).resolve().parent / "app.py"
API_URL_ENV = "SPILLWAY_API_URL"  # the control plane's base URL, read by the app on each run
API_KEY_ENV = "SPILLWAY_API_KEY"  # an API key: viewer, editor or admin


def streamlit_command(port: int, host: str = "127.0.0.1") -> list[str]:
    """The command line of a dashboard server: headless, no usage statistics, no file watching."""
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.address", host, "--server.port", str(port), "--server.headless", "true",
        "--server.fileWatcherType", "none", "--server.runOnSave", "false",
        "--browser.gatherUsageStats", "false", "--global.developmentMode", "false",
        "--client.toolbarMode", "viewer", "--theme.base", "light",
    ]  # fmt: skip


def dashboard_env(api_url: str, api_key: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The process environment: the key travels here, never on the command line (`ps` shows that)."""
    env = dict(os.environ if base is None else base)
    env[API_URL_ENV] = api_url.rstrip("/")
    env[API_KEY_ENV] = api_key
    env["STREAMLIT_BROWSER_GATHER_USAGE_STATS"] = "false"
    return env


def start_dashboard(
    api_url: str, api_key: str, port: int = 8501, log_path: Path | None = None, host: str = "127.0.0.1"
) -> subprocess.Popen[bytes]:
    """Start the dashboard in the background and return its process (the caller stops it). Output goes to
    `log_path`, or is discarded. Use `wait_ready` to know when it answers."""
    started = Process.start(
        streamlit_command(port, host), name="the dashboard", env=dashboard_env(api_url, api_key),
        log=log_path if log_path is not None else subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return started.popen


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Poll the dashboard's health endpoint until it answers; raise if the process exits or time runs out."""
    dashboard = Process(proc, name="the dashboard")
    dashboard.wait_ready(f"{url.rstrip('/')}/_stcore/health", timeout_s=timeout_s, interval_s=0.2)


def run_dashboard(api_url: str, api_key: str, port: int = 8501, host: str = "127.0.0.1") -> None:
    """Become the dashboard server (the `spillway dashboard` command): signals reach Streamlit directly."""
    command = streamlit_command(port, host)
    os.execve(command[0], command, dashboard_env(api_url, api_key))  # noqa: S606 - our own fixed command line
