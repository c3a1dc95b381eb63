"""MLServer in a virtual environment of its own (`bench/.mlserver-venv`): its FastAPI pin clashes with Spillway's.

Made on first use (a minute or two) and remade when the packages change, which a stamp file records; shared
by bench/batching.py and the tests that run MLServer as a third-party V2 backend (tests/utils/mlserver.py).
A lock file inside the environment keeps two processes from installing at once.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `bench` from the repository
from bench.common import log

BENCH = Path(__file__).resolve().parent
MLSERVER_VENV = BENCH / ".mlserver-venv"
MLSERVER_VERSION = "1.7.1"
_STAMP = ".bench-packages"


class VenvError(RuntimeError):
    """The environment could not be made (no network, no venv module, a package that would not install)."""


def mlserver_packages() -> list[str]:
    """MLServer, the project's onnxruntime version (so both servers run the same kernels), numpy and uvloop."""
    ort_version = importlib.metadata.version("onnxruntime")
    # uvloop 0.22 broke MLServer 1.7.1's inference workers (SeldonIO/MLServer#2286): keep the one before it.
    return [f"mlserver=={MLSERVER_VERSION}", f"onnxruntime=={ort_version}", "numpy", "uvloop<0.22"]


def ensure_mlserver_venv(venv: Path = MLSERVER_VENV) -> Path:
    """Make or update the environment if its packages changed; return its `mlserver` executable.

    Raises:
        VenvError: a step failed; the message has the command and the end of its output.
    """
    mlserver = venv / "bin" / "mlserver"
    packages = " ".join(mlserver_packages())
    if _installed(venv, packages):
        return mlserver
    venv.mkdir(parents=True, exist_ok=True)
    # Like virtualenv (and Python >= 3.13's venv): git and ruff leave the environment alone.
    (venv / ".gitignore").write_text("*\n")
    with (venv / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing: wait, then look again
        if _installed(venv, packages):
            return mlserver
        log(f"installing {packages} into {venv} (a minute or two, once)")
        started = time.monotonic()
        if not (venv / "bin" / "python").exists():
            _run([sys.executable, "-m", "venv", str(venv)])
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *packages.split()])
        (venv / _STAMP).write_text(packages)
        log(f"{venv} ready in {time.monotonic() - started:.0f} s")
    return mlserver


def _installed(venv: Path, packages: str) -> bool:
    stamp = venv / _STAMP
    return (venv / "bin" / "mlserver").exists() and stamp.exists() and stamp.read_text() == packages


def _run(cmd: list[str]) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise VenvError(f"{cmd[0]}: {exc}") from exc
    if done.returncode:
        tail = (done.stdout + done.stderr).strip()[-2000:]
        raise VenvError(f"`{' '.join(cmd)}` exited with {done.returncode}:\n{tail}")


if __name__ == "__main__":
    print(ensure_mlserver_venv())
