"""nginx as a plain reverse proxy for the benchmarks: Debian's `/usr/sbin/nginx`, run in the foreground with its
own generated configuration in a temporary prefix (one worker, no master, no daemon), keep-alive to the upstream.

It never touches the system's nginx configuration, logs or service; stopping it is stopping the one process.

    with reverse_proxy("127.0.0.1", 8001, Path(tmp)) as url:
        ...  # url is http://127.0.0.1:<port>, proxying every path to 127.0.0.1:8001
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `bench` from the repository
from bench.common import free_port
from spillway.demo.harness import Process

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


@contextlib.contextmanager
def reverse_proxy(upstream_host: str, upstream_port: int, workdir: Path) -> Iterator[tuple[str, int]]:
    """Run nginx proxying to `upstream_host:upstream_port`; yields (its base URL, its pid); stops it on exit."""
    nginx = require_nginx()
    prefix = workdir / "nginx"
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(CONF.format(prefix=prefix, upstream=f"{upstream_host}:{upstream_port}", port=port))
    command = [str(nginx), "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
    # Its own session: a Ctrl-C in the terminal reaches the bench, which stops it (SIGTERM: a fast shutdown).
    with Process.start(command, name="nginx", log=prefix / "stderr.log", append=False, group=True, grace_s=10) as proc:
        proc.wait_listening(port, timeout_s=10)
        yield f"http://127.0.0.1:{port}", proc.pid
