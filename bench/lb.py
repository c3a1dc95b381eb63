"""A load balancer for the benchmarks: round robin over several upstreams, per request, no stickiness, with Debian's
nginx (`/usr/sbin/nginx`) or HAProxy (`/usr/sbin/haproxy`), run in the foreground with a generated configuration in
a temporary folder (like `bench/nginx.py`); it never touches the system's configuration, logs or services.

Each request goes to the next upstream in turn (nginx's default `upstream` balancing; HAProxy's `balance
roundrobin` in HTTP mode), whatever connection it came on: two control-plane replicas behind it see every agent.
An upstream that refuses connections (a replica killed) is skipped: the request goes to the next one (nginx's
`proxy_next_upstream error`, HAProxy's `retries` with `option redispatch`) and the dead one is left out for a
second or two before it is tried again.

    with balancer([("127.0.0.1", 8001), ("127.0.0.1", 8002)], Path(tmp), kind="nginx") as lb:
        ...  # lb.url is http://127.0.0.1:<port>; lb.pid its process
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `bench` from the repository
from bench.common import free_port
from spillway.demo.harness import Process

BINARIES = {"nginx": Path("/usr/sbin/nginx"), "haproxy": Path("/usr/sbin/haproxy")}
MAX_CONNECTIONS = 9_000  # client and upstream connections within the 20,000 descriptors a process may open here

NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;

events {{
    worker_connections {connections};
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

    upstream replicas {{
{servers}
        keepalive 512;
        keepalive_requests 1000000;
    }}

    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_buffers 16 64k;
            proxy_buffer_size 64k;
            proxy_read_timeout 60s;
            proxy_connect_timeout 2s;
            proxy_next_upstream error timeout;
            proxy_next_upstream_tries 0;
        }}
    }}
}}
"""

HAPROXY_CONF = """\
global
    maxconn {connections}
    nbthread 1

defaults
    mode http
    timeout connect 2s
    timeout client 75s
    timeout server 60s
    timeout http-keep-alive 75s
    option http-keep-alive
    retries 3
    option redispatch

frontend fleet
    bind 127.0.0.1:{port}
    default_backend replicas

backend replicas
    balance roundrobin
    http-reuse safe
{servers}
"""


@dataclass(frozen=True)
class Balancer:
    kind: str
    url: str
    pid: int


def require(kind: str) -> Path:
    """The binary of `kind` ('nginx' or 'haproxy'), or SystemExit with how to install it."""
    binary = BINARIES[kind]
    if not binary.exists():
        raise SystemExit(f"{kind} is not installed ({binary} is missing): `apt-get install -y {kind}` as root")
    return binary


def version(kind: str) -> str:
    flag = "-v"
    out = subprocess.run([str(require(kind)), flag], capture_output=True, text=True, check=False)
    return (out.stderr or out.stdout).strip().splitlines()[0].removeprefix("nginx version: ")


def config(kind: str, upstreams: Sequence[tuple[str, int]], port: int, prefix: Path) -> str:
    if kind == "nginx":
        servers = "\n".join(f"        server {h}:{p} max_fails=1 fail_timeout=2s;" for h, p in upstreams)
        return NGINX_CONF.format(prefix=prefix, servers=servers, port=port, connections=MAX_CONNECTIONS,
                                 nofile=2 * MAX_CONNECTIONS + 1000)  # fmt: skip
    servers = "\n".join(f"    server r{i} {h}:{p} check inter 1s fall 1 rise 2" for i, (h, p) in enumerate(upstreams))
    return HAPROXY_CONF.format(servers=servers, port=port, connections=MAX_CONNECTIONS)


@contextlib.contextmanager
def balancer(upstreams: Sequence[tuple[str, int]], workdir: Path, kind: str = "nginx") -> Iterator[Balancer]:
    """Run `kind` in front of `upstreams` (host, port), round robin; yields its URL and pid; stops it on exit."""
    if kind not in BINARIES:
        raise ValueError(f"unknown load balancer {kind!r}: nginx or haproxy")
    binary = require(kind)
    prefix = workdir / f"lb-{kind}"
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / f"{kind}.conf"
    conf.write_text(config(kind, upstreams, port, prefix))
    if kind == "nginx":
        command = [str(binary), "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
    else:
        command = [str(binary), "-db", "-f", str(conf)]  # -db: foreground, no daemon
    # Its own session: a Ctrl-C in the terminal reaches the bench, which stops it.
    with Process.start(command, name=kind, log=prefix / "stderr.log", append=False, group=True, grace_s=5) as proc:
        proc.wait_listening(port, timeout_s=10)
        yield Balancer(kind, f"http://127.0.0.1:{port}", proc.pid)


__all__ = ["Balancer", "balancer", "config", "require", "version"]
