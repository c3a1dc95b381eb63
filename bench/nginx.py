"""nginx as a plain reverse proxy for the benchmarks: Debian's `/usr/sbin/nginx`, run in the foreground with its
own generated configuration in a temporary prefix (one worker, no master, no daemon), keep-alive to the upstream.

It never touches the system's nginx configuration, logs or service; stopping it is stopping the one process.

    with reverse_proxy("127.0.0.1", 8001, Path(tmp)) as url:
        ...  # url is http://127.0.0.1:<port>, proxying every path to 127.0.0.1:8001
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

NGINX = Path("/usr/sbin/nginx")
INSTALL_HINT = (
    f"nginx is not installed ({NGINX} is missing). Install Debian's package as root: "
    "`apt-get install -y nginx` (the benchmark runs its own foreground instance with a generated configuration "
    "in a temporary folder; the system's service need not run)."
)

# Every path nginx would otherwise take from its build (Debian's are under /var/lib/nginx and /var/log/nginx) is
# set inside the prefix, so that a run needs nothing outside it.
CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;

events {{
    worker_connections 4096;
    multi_accept on;
}}

http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    keepalive_requests 1000000;
    keepalive_timeout 75s;

    upstream backend {{
        server {upstream};
        keepalive 256;
        keepalive_requests 1000000;
    }}

    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_buffers 16 64k;
            proxy_buffer_size 64k;
            proxy_read_timeout 60s;
        }}
    }}
}}
"""


def require_nginx() -> Path:
    """The nginx binary, or SystemExit with how to install it."""
    if not NGINX.exists():
        raise SystemExit(INSTALL_HINT)
    return NGINX


def nginx_version() -> str:
    out = subprocess.run([str(require_nginx()), "-v"], capture_output=True, text=True, check=False)
    return (out.stderr or out.stdout).strip().removeprefix("nginx version: ")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited with code {proc.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nginx did not listen on port {port} within {timeout_s:g} s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def reverse_proxy(upstream_host: str, upstream_port: int, workdir: Path) -> Iterator[tuple[str, int]]:
    """Run nginx proxying to `upstream_host:upstream_port`; yields (its base URL, its pid); stops it on exit."""
    nginx = require_nginx()
    prefix = workdir / "nginx"
    prefix.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(CONF.format(prefix=prefix, upstream=f"{upstream_host}:{upstream_port}", port=port))
    log = prefix / "stderr.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(  # its own session: a Ctrl-C in the terminal reaches the bench, which stops it
            [str(nginx), "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        _wait_listening(port, proc, log)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)  # fast shutdown
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
