"""Real processes on loopback: `spillway controlplane serve` migrates at start, replicas take turns, and the demo."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from spillway.demo.harness import Process, stop_all
from tests.conftest import make_keys
from tests.utils.server import free_ports

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")}
    return {**env, **extra}


def _serve(url: str, port: int, log: Path, *args: str, **env: str) -> Process:
    """`spillway controlplane serve` on `port`, its output in `log` (a file, not a pipe: a chatty replica must
    never block on a full pipe)."""
    command = [sys.executable, "-m", "spillway.cli", "controlplane", "serve", "--port", str(port), *args]
    return Process.start(command, name=f"the control plane on port {port}", log=log,
                         env=_env(SPILLWAY_DATABASE_URL=url, **env), grace_s=15)  # fmt: skip


def _wait(port: int, proc: Process, want: int) -> httpx.Response:
    """Until /readyz answers `want`; fails, with the end of the log, if the process exits or time runs out."""
    return proc.wait_ready(f"http://127.0.0.1:{port}/readyz", want, timeout_s=60)


def test_serve_migrates_at_start_unless_told_not_to(sqlite_url: str, tmp_path: Path) -> None:
    unmigrated = f"sqlite:///{tmp_path / 'other.db'}"
    port_a, port_b = free_ports(2)
    a = _serve(sqlite_url, port_a, tmp_path / "a.log")
    b = _serve(unmigrated, port_b, tmp_path / "b.log", "--no-migrate")
    try:
        assert _wait(port_a, a, 200).json() == {"status": "ready"}
        # each revision applied at start is said in the log, with its duration (controlplane/db/migrate.py)
        started = (tmp_path / "a.log").read_text()
        assert re.search(r"^INFO: +migrating base -> 0001_initial: \d+\.\d\d s$", started, re.MULTILINE), started
        not_ready = _wait(port_b, b, 503)
        assert not_ready.json()["error"] == "not_ready"
        assert httpx.get(f"http://127.0.0.1:{port_b}/healthz").status_code == 200
    finally:
        stop_all([a, b])


@pytest.mark.postgres
def test_replicas_starting_together_on_postgres_take_turns_to_migrate(postgres_url: str, tmp_path: Path) -> None:
    ports = free_ports(3)
    procs = [_serve(postgres_url, port, tmp_path / f"replica{i}.log") for i, port in enumerate(ports)]
    try:
        for port, proc in zip(ports, procs, strict=True):
            assert _wait(port, proc, 200).status_code == 200
    finally:
        stop_all(procs)


@pytest.mark.postgres
def test_exactly_one_replica_runs_the_control_loop_and_another_takes_over(postgres_url: str, tmp_path: Path) -> None:
    key = make_keys(postgres_url)["viewer"]
    ports = free_ports(2)
    logs = [tmp_path / f"replica{i}.log" for i in range(2)]
    procs = [_serve(postgres_url, port, log, SPILLWAY_CONTROL_LOOP_INTERVAL_S="0.3")
             for port, log in zip(ports, logs, strict=True)]  # fmt: skip

    def loops() -> list[dict]:
        return [httpx.get(f"http://127.0.0.1:{port}/api/v1/status", headers={"Authorization": f"Bearer {key}"},
                          timeout=5).json()["control_loop"] for port in ports]  # fmt: skip

    def settle(deadline_s: float = 30) -> list[dict]:
        deadline = time.monotonic() + deadline_s
        while True:
            states = loops()
            leaders = [s for s in states if s["leader"] and s["last_cycle_at"]]
            if len(leaders) == 1 or time.monotonic() > deadline:
                return states
            time.sleep(0.2)

    def loops_of(index: int) -> dict:
        response = httpx.get(f"http://127.0.0.1:{ports[index]}/api/v1/status",
                             headers={"Authorization": f"Bearer {key}"}, timeout=5)  # fmt: skip
        return response.json()["control_loop"]

    try:
        for port, proc in zip(ports, procs, strict=True):
            assert _wait(port, proc, 200).status_code == 200
        states = settle()
        assert sorted(s["leader"] for s in states) == [False, True], states  # exactly one leads
        for _ in range(10):  # and it stays that way: the other never starts a cycle
            time.sleep(0.3)
            states = loops()
            assert sorted(s["leader"] for s in states) == [False, True], states
            assert [s["last_cycle_at"] is None for s in states].count(True) == 1, states
        leader = next(i for i, s in enumerate(states) if s["leader"])
        follower = 1 - leader
        procs[leader].kill()  # dies without letting go: its connection, and the lock, go with the process
        procs[leader].wait(timeout=15)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = loops_of(follower)
            if state["leader"] and state["last_cycle_at"]:
                break
            time.sleep(0.2)
        assert state["leader"] and state["last_cycle_at"], (state, logs[follower].read_text())
        first = state["last_cycle_at"]
        time.sleep(1.0)
        assert loops_of(follower)["last_cycle_at"] > first  # it keeps cycling
    finally:
        stop_all(procs)


def _children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name: state, ppid, ...
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _listening(port: int) -> bool:
    """Whether anything still accepts connections on the loopback `port`."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _gone(pids: list[int], deadline_s: float = 5.0) -> list[int]:
    """The pids of `pids` still there after `deadline_s` (an orphan's reaping may take a moment)."""
    deadline = time.monotonic() + deadline_s
    while True:
        left = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def test_demo_seeds_the_example_fleet_through_the_api_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """The whole demo, serving at its end as a user runs it (no --once): its output, the backends it registered
    (every one real: the gateway counts each healthy), its progress lines on stderr, and Ctrl-C (SIGINT to the demo
    alone): it ends within a bound with a line saying so, and leaves no process or port behind."""
    port, agent_port, dashboard_port = free_ports(3)
    args = ["demo", "--port", str(port), "--agent-port", str(agent_port), "--data-dir", str(tmp_path / "demo"),
            "--dashboard-port", str(dashboard_port)]  # fmt: skip
    out_path, err_path = tmp_path / "demo.out", tmp_path / "demo.err"
    with out_path.open("wb") as out_file, err_path.open("wb") as err_file:
        demo = subprocess.Popen([sys.executable, "-m", "spillway.cli", *args], env=_env(), cwd=REPO,
                                stdout=out_file, stderr=err_file, stdin=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 480
        while "Serving until Ctrl-C" not in out_path.read_text():
            assert demo.poll() is None, out_path.read_text() + err_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text() + err_path.read_text()
            time.sleep(0.5)
        key = re.search(r"Admin API key \(shown once\): (spk_\S+)", out_path.read_text())
        assert key, out_path.read_text()
        _assert_every_backend_is_real(f"http://127.0.0.1:{port}", key.group(1))
        children = _children(demo.pid)
        assert len(children) >= 6, children  # the control plane, the dashboard, three agents, two clouds
        demo.send_signal(signal.SIGINT)
        code = demo.wait(timeout=60)  # a hang guard only: it ends (the line below says how fast), whatever CI's load
    finally:
        if demo.poll() is None:  # a failure above: the demo stops its processes on SIGTERM
            demo.terminate()
            try:
                demo.wait(timeout=30)
            except subprocess.TimeoutExpired:
                demo.kill()
    stdout, stderr = out_path.read_text(), err_path.read_text()
    assert code == 128 + signal.SIGINT, stdout + stderr  # the shell's convention for a program stopped by Ctrl-C
    assert re.search(r"^demo stopped \(Ctrl-C\): control plane, agents and dashboard shut down in [\d.]+ s$", stdout,
                     re.MULTILINE), stdout[-2000:] + stderr[-2000:]  # fmt: skip
    assert _gone(children) == [], children
    assert [p for p in (port, agent_port, dashboard_port) if _listening(p)] == []
    assert "Traceback" not in stderr, stderr
    # Progress on stderr (not a terminal: plain lines): the models built, each wait named with its duration.
    built = re.findall(r"^built (mlp|tiny-lm) v(\d)\b.*\((\d) of 4, [\d.]+ s\)$", stderr, re.MULTILINE)
    assert [(m, v, n) for m, v, n in built] == [("mlp", "1", "1"), ("mlp", "2", "2"), ("tiny-lm", "1", "3"),
                                                 ("tiny-lm", "2", "4")], stderr  # fmt: skip
    for what in ("the control plane", "the edge agent to load its models", "the dashboard",
                 "the control plane to count the burst", "the overflow act's edge agent",
                 "the generative act's edge agent"):  # fmt: skip
        assert f"waiting for {what}" in stderr, (what, stderr)
        assert re.search(rf"^waited for {re.escape(what)}.*: [\d.]+ s$", stderr, re.MULTILINE), (what, stderr)
    out = subprocess.CompletedProcess(args, code, stdout, stderr)
    assert "seeded 2 agents: jetson-berlin-01, desktop-gpu-lab" in out.stdout
    assert "seeded 2 slos: mlp-latency, mlp-availability" in out.stdout
    assert "seeded 3 rules" in out.stdout
    assert "backends: none seeded; the overflow acts below start real ones" in out.stdout
    assert "Fleet status: 2 agents, 2 SLOs, 3 rules (3 enabled), 0 backends" in out.stdout
    assert "demo-backend-secret" not in out.stdout
    assert f"http://127.0.0.1:{port}" in out.stdout
    # The agent part: a burst with a row per priority, every request counted with an outcome.
    assert f"Edge agent: http://127.0.0.1:{agent_port}" in out.stdout
    rows = re.findall(r"^\| ([123]) \| [^|]+ \| (\d+) \| ([^|]+) \|", out.stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["1", "2", "3"], out.stdout
    assert sum(int(r[1]) for r in rows) == 1000
    assert re.search(r"^answered by version 1: \d+$", out.stdout, re.MULTILINE), out.stdout  # the burst names v1
    for _, sent, outcomes in rows:
        counted = sum(int(n) for n in re.findall(r"(\d+)(?:,|\s*$)", outcomes.strip()))
        assert counted == int(sent), outcomes
        assert "transport error" not in outcomes
    # The control plane's view of the same burst, from the agent's OpenTelemetry export: every request counted.
    assert "it plays jetson-berlin-01" in out.stdout
    assert "counted by the control plane: 1000 requests" in out.stdout, out.stdout
    seen = re.findall(r"^\| mlp \| ([123]) \| (\d+) \|", out.stdout, re.MULTILINE)
    assert [p for p, _ in seen] == ["1", "2", "3"] and sum(int(n) for _, n in seen) == 1000
    assert [int(n) for _, n in seen] == [int(r[1]) for r in rows]  # per priority, as many as the clients sent
    for slo in ("mlp-latency", "mlp-availability"):
        line = re.search(rf"^  {slo}: SLI ([\d.]+) % \(objective [\d.]+ % over 28d\), budget left (-?\d+) %$",
                         out.stdout, re.MULTILINE)  # fmt: skip
        assert line, out.stdout
    assert len(re.findall(r"burn rate over 56m: [\d.]+x, over 5m: [\d.]+x \(fires at 14.4x, page\)", out.stdout)) == 2
    assert f"Dashboard: http://127.0.0.1:{dashboard_port}" in out.stdout
    # The control loop under a ramp: the rule fires, the agent serves the lite variant, then it recovers.
    assert re.search(r"surge  answers/s: .*v2 \d+ .*agent: policy v2, serving v2", out.stdout), out.stdout
    loop_events = out.stdout.split("Events from the control loop (GET /api/v1/events):\n", 1)[1].split("\n\n", 1)[0]
    events = re.findall(r"^  \d\d:\d\d:\d\d  (\S+)", loop_events, re.MULTILINE)
    assert events == ["rule.fired", "policy.published", "rule.recovered", "policy.published"], out.stdout
    assert re.search(r"calm   answers/s: v1 \d+ +agent: policy v3, serving v1\n\nEvents", out.stdout), out.stdout
    # Overflow: a table of outcomes per phase, every request answered, the cloud used in the burst, the fallback
    # chain answering while the cloud is down.
    header = re.search(r"^\| phase \| rps \| sent \| (.+) \| lost \|", out.stdout, re.MULTILINE)
    assert header, out.stdout
    columns = ["sent", *[c.strip() for c in header.group(1).split("|")], "lost"]
    table, local_share = {}, {}
    for name in ("normal (0.5x)", "burst (3x)", "cloud down (3x)", "cloud back (3x)", "calm (0.5x)"):
        row = re.search(rf"^\| {re.escape(name)} \| \d+ \| (.+?) \| \d+% \| (\d+)% \| (\d+)% \|", out.stdout,
                        re.MULTILINE)  # fmt: skip
        assert row, out.stdout
        table[name] = dict(zip(columns, (int(v) for v in row.group(1).split(" | ")), strict=True))
        local_share[name] = (int(row.group(2)), int(row.group(3)))  # % of priority 1 and 2 served locally
    assert all(row["lost"] == 0 for row in table.values()), table
    assert all(sum(v for k, v in row.items() if k not in ("sent", "lost")) == row["sent"] for row in table.values())
    assert table["burst (3x)"].get("overflow", 0) > 0, table
    down = table["cloud down (3x)"]
    assert down.get("fallback_cache", 0) + down.get("queued_async", 0) > 0, table
    assert table["normal (0.5x)"]["local"] >= 0.9 * table["normal (0.5x)"]["sent"], table
    assert local_share["burst (3x)"][0] > local_share["burst (3x)"][1], local_share  # priority 1 stays local
    assert table["cloud back (3x)"].get("overflow", 0) > 0, table  # the cloud is used again once it is back
    assert table["calm (0.5x)"]["local"] >= 0.9 * table["calm (0.5x)"]["sent"], table
    _assert_generative_overflow_act(out.stdout)


def _assert_every_backend_is_real(base: str, key: str, deadline_s: float = 30.0) -> None:
    """Every backend registered (the Backends page's list) is one the gateway counts healthy: nothing seeded that
    does not exist. Polled: a cloud restarted at the end of an act may still be coming back."""
    headers = {"Authorization": f"Bearer {key}"}
    names = {b["name"] for b in httpx.get(f"{base}/api/v1/backends", headers=headers, timeout=10).json()["items"]}
    assert names == {"cloud-1", "cloud-genai"}, names
    deadline = time.monotonic() + deadline_s
    while True:
        gateway = httpx.get(f"{base}/api/v1/status", headers=headers, timeout=10).json()["gateway"]
        healthy = {b["name"] for b in gateway["backends"] if b.get("healthy")}
        if healthy >= names or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert healthy >= names, gateway


def _assert_generative_overflow_act(stdout: str) -> None:
    """The generative act (spillway/demo/generative_overflow_story.py): streams through the whole system. Every
    stream ends exactly once and none is lost; the control plane's counts (the agent's telemetry) equal the clients';
    the SLO burns, the cap rule fires and then the overflow rule; overflow, the fallbacks and the cloud's return show
    in their phases. Behaviour is checked relative to what the run itself measured, never against a time."""
    assert "Generative overflow: an edge agent" in stdout, stdout
    act = stdout[stdout.index("Generative overflow: an edge agent") :]
    header = re.search(r"^\| phase \| clients P1/P2/P3 \| s \| streams \| (.+) \| lost \| capped \| TTFT p99 P1 ms",
                       act, re.MULTILINE)  # fmt: skip
    assert header, act
    columns = [c.strip() for c in header.group(1).split("|")]
    rows: dict[str, dict[str, Any]] = {}
    for name in ("normal", "burst", "cloud down", "cloud back", "calm"):
        row = re.search(rf"^\| {name} \| \d+/\d+/\d+ \| \d+ \| (\d+) \| (.+?) \| (\d+) \| (\d+) \| ([\d-]+) \| "
                        r"([\d-]+) \| ([\d-]+) \| ([\d.-]+)x?/([\d.-]+)x? \|$", act, re.MULTILINE)  # fmt: skip
        assert row, (name, act)
        counts = dict(zip(columns, (int(v) for v in row.group(2).split(" | ")), strict=True))
        rows[name] = {"streams": int(row.group(1)), **counts, "lost": int(row.group(3)), "capped": int(row.group(4)),
                      "p99": [None if v == "-" else int(v) for v in row.group(5, 6, 7)],
                      "burn_short": None if row.group(9) == "-" else float(row.group(9))}  # fmt: skip
        assert rows[name]["lost"] == 0, (name, act)  # none lost
        assert sum(counts.values()) == rows[name]["streams"], (name, act)  # each stream one outcome
    assert set(columns) <= {"local", "overflow", "fallback_cache", "fallback_default", "queued_async", "rejected",
                            "error"}, columns  # fmt: skip
    # Each stream ended exactly once: [DONE], an error event, or an HTTP answer before any token; none lost.
    ended = re.search(r"^Every stream ended once: (\d+) with \[DONE\], (\d+) with an error event, (\d+) with an HTTP "
                      r"answer \(refused before a token\); lost (\d+)$", act, re.MULTILINE)  # fmt: skip
    assert ended, act
    assert int(ended.group(4)) == 0, act
    marks = re.search(r"^Overflowed streams: (\d+), of which (\d+) said so", act, re.MULTILINE)
    assert marks and int(marks.group(1)) > 0 and marks.group(1) == marks.group(2), act
    # The control plane's counts, from the agent's telemetry, equal the clients', outcome by outcome.
    sent = re.search(r"^The clients counted (\d+) streams: (.+)$", act, re.MULTILINE)
    seen = re.search(r"^The control plane counted (\d+) from the edge agent's telemetry: (.+)$", act, re.MULTILINE)
    assert sent and seen, act
    assert sum(int(n) for n in ended.group(1, 2, 3)) == int(sent.group(1)), act
    assert _counts(seen.group(2)) == _counts(sent.group(2)), act
    # The story's behaviour, relative to itself: served locally while normal; in the burst the SLO burns, a cap and
    # then overflow come, and priority 1 waits less than priority 3; the fallbacks answer while the cloud is down;
    # overflow again once it is back.
    assert rows["normal"]["local"] >= 0.9 * rows["normal"]["streams"], rows
    burst = rows["burst"]
    assert burst["overflow"] > 0 and burst["capped"] > 0, rows
    assert burst["burn_short"] is not None and burst["burn_short"] >= 2, rows
    assert burst["p99"][0] is not None and burst["p99"][2] is not None and burst["p99"][0] < burst["p99"][2], rows
    down = rows["cloud down"]
    assert sum(down.get(k, 0) for k in ("fallback_cache", "fallback_default", "queued_async")) > 0, rows
    assert rows["cloud back"]["overflow"] > 0, rows
    # The events in order: the cap rule fires on the SLO's burn, then the overflow rule; the gateway loses the cloud
    # and takes it back after that.
    section = act.split("Events from the control loop and the gateway (GET /api/v1/events):\n", 1)[1].split("\nEvery")[
        0
    ]
    events = re.findall(r"^  \d\d:\d\d:\d\d  (\S+) +(\S*)", section, re.MULTILINE)
    fired = [name.rstrip(":") for kind, name in events if kind == "rule.fired"]
    assert fired[:2] == ["cap-tokens-on-ttft-burn", "overflow-p3-on-ttft-burn"], section
    cap = re.search(r"rule\.fired +cap-tokens-on-ttft-burn: long_burn_rate ([\d.]+), short_burn_rate ([\d.]+)", section)
    assert cap and float(cap.group(1)) >= 2 and float(cap.group(2)) >= 2, section
    kinds = [kind for kind, _ in events]
    overflow_at = next(
        i for i, (kind, name) in enumerate(events) if kind == "rule.fired" and name.startswith("overflow")
    )
    lost_at = next(
        i for i, kind in enumerate(kinds) if i > overflow_at and kind in ("backend.unhealthy", "backend.ejected")
    )
    assert "backend.healthy" in kinds[lost_at:], section


def _counts(words: str) -> dict[str, int]:
    """'local 3, overflow 2' -> {'local': 3, 'overflow': 2}."""
    return {name: int(n) for name, n in re.findall(r"(\w+) (\d+)", words)}
