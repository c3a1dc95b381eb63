"""MLServer serving the demo model `mlp`, as a real third-party Open Inference Protocol backend for tests.

MLServer runs from `bench/.mlserver-venv` (made on first use by bench/mlserver_venv.py, a minute or two) with
the small onnxruntime runtime of `bench/mlserver/`, on free loopback ports, without adaptive batching.
Without that environment a test is skipped, except under CI=true, where it fails.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.mlserver_venv import VenvError, ensure_mlserver_venv
from spillway.demo.harness import Process, ProcessExited
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
        url = f"http://127.0.0.1:{port}"
        try:
            proc.wait_ready(f"{url}/v2/models/{MODEL_NAME}/ready", timeout_s=ready_timeout_s)
            break
        except ProcessExited:
            if "address already in use" not in log.read_text(errors="replace").lower():
                raise
        except BaseException:
            proc.stop()
            raise
        if attempt == _PORT_ATTEMPTS:
            raise RuntimeError(f"MLServer could not bind free ports {_PORT_ATTEMPTS} times:\n{proc.log_tail()}")
    with proc:
        yield url


def _start(mlserver: Path, folder: Path, log: Path) -> Process:
    """`mlserver start FOLDER`, its log written afresh; in its own process group, so that stopping it (SIGTERM,
    SIGKILL after 20 s) reaches any worker it forks."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH") and not k.startswith("MLSERVER")
    }
    env["PATH"] = f"{mlserver.parent}{os.pathsep}{env.get('PATH', '')}"
    return Process.start([str(mlserver), "start", str(folder)], name="MLServer", log=log, append=False, env=env,
                         cwd=folder, group=True, grace_s=20)  # fmt: skip
