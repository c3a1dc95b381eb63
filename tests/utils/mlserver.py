"""MLServer serving the demo model `mlp`, as a real third-party Open Inference Protocol backend for tests.

MLServer runs from `bench/.mlserver-venv` (made on first use by bench/mlserver_venv.py, a minute or two) with
the small onnxruntime runtime of `bench/mlserver/`, on free loopback ports, without adaptive batching.
Without that environment a test is skipped, except under CI=true, where it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bench.mlserver_venv import VenvError, ensure_mlserver_venv
from spillway.demo.models import MODEL_NAME
from tests.utils.server import free_port

RUNTIME = Path(__file__).resolve().parents[2] / "bench" / "mlserver"
_PORT_ATTEMPTS = 3  # a free port may be taken by someone else before MLServer binds it


def mlserver_executable() -> Path:
    """The `mlserver` command, making its environment if needed; skips the test if that fails, unless CI=true."""
    try:
        return ensure_mlserver_venv()
    except VenvError as exc:
        reason = f"MLServer's environment (bench/.mlserver-venv) could not be made; it needs PyPI: {exc}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {reason}")
        pytest.skip(reason)


@contextmanager
def running_mlserver(
    model_dir: Path, workdir: Path, *, version: int = 1, ready_timeout_s: float = 120
) -> Iterator[str]:
    """Serve `mlp` version `version` of a demo repository with MLServer; yield its base URL, stop it on exit.

    Args:
        model_dir: a repository made by `spillway models build-demo` (holding `mlp/<version>/model.onnx`).
        workdir: where MLServer's folder `mlp/` (settings, runtime) and its log `mlserver.log` go.
        version: the demo model's version to serve; MLServer answers `/v2/models/mlp/infer` with it.
        ready_timeout_s: how long MLServer may take to answer `GET /v2/models/mlp/ready` with 200.
    """
    model = (model_dir / MODEL_NAME / str(version) / "model.onnx").resolve()
    if not model.is_file():
        raise FileNotFoundError(f"{model}: build the demo repository first (spillway models build-demo)")
    mlserver = mlserver_executable()
    folder = workdir / MODEL_NAME  # MLServer warns when a model's folder is named otherwise
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(RUNTIME / "runtime.py", folder / "runtime.py")
    model_settings = json.loads((RUNTIME / "model-settings.json").read_text())
    for key in ("max_batch_size", "max_batch_time"):  # one request, one predict: no adaptive batching
        model_settings.pop(key, None)
    model_settings["parameters"].update(version=str(version), uri=str(model), extra={"intra_op_threads": 1})
    (folder / "model-settings.json").write_text(json.dumps(model_settings, indent=2))
    log = workdir / "mlserver.log"

    for attempt in range(1, _PORT_ATTEMPTS + 1):
        port = free_port()
        settings = json.loads((RUNTIME / "settings.json").read_text())
        # gRPC cannot be turned off, so it gets a free port too; the metrics server is off (no endpoint).
        settings.update(http_port=port, grpc_port=free_port(), metrics_port=free_port(), metrics_endpoint=None)
        (folder / "settings.json").write_text(json.dumps(settings, indent=2))
        proc = _start(mlserver, folder, log)
        try:
            url = f"http://127.0.0.1:{port}"
            if _wait_ready(proc, f"{url}/v2/models/{MODEL_NAME}/ready", log, ready_timeout_s):
                break
        except BaseException:
            _stop(proc)
            raise
        if attempt == _PORT_ATTEMPTS:
            raise RuntimeError(f"MLServer could not bind free ports {_PORT_ATTEMPTS} times:\n{_tail(log)}")
    try:
        yield url
    finally:
        _stop(proc)


def _start(mlserver: Path, folder: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH") and not k.startswith("MLSERVER")
    }
    env["PATH"] = f"{mlserver.parent}{os.pathsep}{env.get('PATH', '')}"
    with log.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(  # its own process group, so stopping it reaches any worker it forks
            [str(mlserver), "start", str(folder)],
            cwd=folder,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> bool:
    """Poll until `url` answers 200; False if MLServer exited because a port was taken (try again)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                if "address already in use" in log.read_text(errors="replace").lower():
                    return False
                raise RuntimeError(f"MLServer exited (status {proc.returncode}) before it was ready:\n{_tail(log)}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(url).status_code == 200:
                    return True
            time.sleep(0.1)
    raise RuntimeError(f"MLServer did not answer {url} with 200 within {timeout_s:.0f} s:\n{_tail(log)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group, then SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"
