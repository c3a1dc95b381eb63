"""The documented commands run: every Markdown file with blocks marked `run` or `background` is one test that
executes them in order, as a reader would in one terminal.

The markers (an HTML comment on the last non-blank line before a fence; see tests/docs/blocks.py):

- `<!-- check: run -->` before an `sh` block: run, it must exit 0 within `RUN_TIMEOUT_S`.
- `<!-- check: run expect=REGEX -->`: run until its output (stdout and stderr) matches REGEX (a Python regular
  expression, searched; quote it shell-style when it has spaces, e.g. `expect='"variant": 2'`; it cannot hold `>`),
  at most `EXPECT_TIMEOUT_S`, once a second. For steps that become true shortly after (the events a rule writes
  once the control loop has seen the telemetry): a reader re-runs the command, the docs never sleep. The block runs
  in a subshell, so it should only read (its exports, `cd` and jobs are not kept).
- `<!-- check: background URL -->`: started in the background, then the test waits (at most `READY_TIMEOUT_S`) until
  URL answers with any status below 500. A block whose last line ends with `&` backgrounds itself (what a reader
  types: `spillway controlplane serve > controlplane.log 2>&1 &`); any other is backgrounded by the test.
- `<!-- check: run -->` before a `python` block: run with this venv's Python, in the shell's folder and environment.
- `<!-- check: KIND file=NAME -->` before any other block (e.g. `agent-config file=edge.yaml`): the block is written
  to NAME in the shell's current folder when reached, so that later commands can use it.

One bash process runs the file's blocks, as a terminal would: exported variables, the current folder and jobs carry from
block to block (`kill %2 && wait %2` stops the second background job), with job control on, so every background job is a
process group of its own. Each block runs under `set -euo pipefail`: a block that fails ends the shell, and the file's
test, with the block's file and line, its command and the last lines of its output. The shell starts in a fresh scratch
folder with PATH starting with this venv's bin folder and the environment otherwise inherited, less `SPILLWAY_*` and
`OTEL_*` (a developer's settings must not change what the docs show); `XDG_STATE_HOME` is the scratch folder's `state/`.
Before anything runs, every local port the file's commands name must be free. At the end, also on failure, every job's
process group gets SIGTERM, then SIGKILL after `STOP_GRACE_S`; the test checks none is left.

`SPILLWAY_DOCS_RUN_FILES` (paths separated by `os.pathsep`) replaces the list of files: to try a draft copy.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import pytest

from tests.docs.blocks import ROOT, Block, blocks, markdown_files

RUN_TIMEOUT_S = 120.0  # one `run` block
EXPECT_TIMEOUT_S = 60.0  # a `run expect=REGEX` block, all its tries together
READY_TIMEOUT_S = 120.0  # a `background URL` block until URL answers
STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL at the end
TAIL_LINES = 30  # of output in a failure message

KINDS = ("run", "background")
_LOCAL_URL = re.compile(r"https?://(?:127\.0\.0\.1|localhost|\[::1\]):(\d+)")
_LOG_TARGET = re.compile(r"(?:&>|>>?)\s*([\w./-]+)")


def doc_files() -> list[Path]:
    """The files to run: `SPILLWAY_DOCS_RUN_FILES` if set, else every Markdown file with a `run` or `background`
    block."""
    override = os.environ.get("SPILLWAY_DOCS_RUN_FILES")
    paths = [Path(p).resolve() for p in override.split(os.pathsep) if p] if override else markdown_files()
    return [path for path in paths if any(block.check in KINDS for block in blocks(path))]


def where(block: Block) -> str:
    try:
        name = str(block.path.relative_to(ROOT))
    except ValueError:
        name = str(block.path)
    return f"{name}:{block.line}"


def file_id(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def marker_args(block: Block) -> tuple[list[str], dict[str, str]]:
    """A marker's arguments: plain words, and `key=value` pairs (shell quoting)."""
    words: list[str] = []
    pairs: dict[str, str] = {}
    for token in shlex.split(block.args):
        key, eq, value = token.partition("=")
        if eq and re.fullmatch(r"[a-z][a-z0-9_-]*", key):
            pairs[key] = value
        else:
            words.append(token)
    return words, pairs


def ports_of(path: Path) -> list[int]:
    """The local ports the file's executed blocks name (URLs of `run` and `background` blocks and markers)."""
    found: set[int] = set()
    for block in blocks(path):
        if block.check in KINDS:
            found.update(int(port) for port in _LOCAL_URL.findall(block.code + " " + block.args))
    return sorted(found)


def port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


def answers(url: str) -> bool:
    """Whether `url` answers with a status below 500."""
    try:
        with _DIRECT.open(url, timeout=2) as response:
            return int(response.status) < 500
    except urllib.error.HTTPError as exc:
        return exc.code < 500
    except (OSError, ValueError):
        return False


def live_processes() -> list[tuple[int, int]]:
    """(process group, session) of every process that is not a zombie (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and fields[0] not in ("Z", "X"):
            found.append((int(fields[2]), int(fields[3])))
    return found


def session_groups(sid: int) -> set[int]:
    """The process groups of session `sid` with a live process."""
    return {pgrp for pgrp, session in live_processes() if session == sid}


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is alive (a zombie is not: it only waits to be reaped)."""
    return any(pgrp == pgid for pgrp, _ in live_processes())


@dataclass
class Terminal:
    """One bash process fed block after block, as a reader's terminal."""

    folder: Path
    work: Path  # where the test keeps the blocks, their output and exit codes (outside what the docs see)
    proc: subprocess.Popen[bytes] | None = None
    groups: set[int] = field(default_factory=set)  # every background job's process group seen (`jobs -p`)
    count: int = 0
    here: Path | None = None  # the shell's current folder after the last block
    log: BinaryIO | None = None  # the shell's own stderr (job notices)

    def cwd(self) -> Path:
        return self.here or self.folder

    def start(self) -> None:
        venv_bin = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPILLWAY_", "OTEL_"))}
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        env["XDG_STATE_HOME"] = str(self.folder / "state")
        env.pop("VIRTUAL_ENV", None)
        for name in ("NO_PROXY", "no_proxy"):  # the docs' curl talks to loopback, never through a proxy
            env[name] = ",".join(filter(None, [env.get(name), "127.0.0.1", "localhost"]))
        self.log = (self.work / "shell.log").open("wb")
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self.log,
            cwd=self.folder, env=env, start_new_session=True,  # the shell leads a session: every process it starts
        )  # fmt: skip
        self.send("set -m")  # job control: each background job in a process group of its own

    def send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run(self, block: Block, *, subshell: bool = False, timeout_s: float | None = None) -> tuple[int, str]:
        """Run the block's text; (exit status, output). A failing block outside a subshell ends the shell (as
        `set -e` does): the status is then the shell's."""
        self.count += 1
        script, out, rc = (self.work / f"{self.count}.{name}" for name in ("sh", "out", "rc"))
        script.write_text(block.code)
        body = f"set -euo pipefail; source {shlex.quote(str(script))}; set +euo pipefail"
        body = f"( {body} )" if subshell else f"{{ {body}; }}"
        self.send(f"{body} > {shlex.quote(str(out))} 2>&1 < /dev/null; echo $? > {shlex.quote(str(rc))}")
        self.send(f"jobs -p > {shlex.quote(str(self.work / 'jobs'))}; pwd > {shlex.quote(str(self.work / 'cwd'))}")
        timeout_s = RUN_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        status: int | None = None
        while time.monotonic() < deadline:
            if rc.exists() and rc.read_text().strip():
                status = int(rc.read_text())
                break
            if not self.alive():
                assert self.proc is not None
                status = self.proc.returncode
                break
            time.sleep(0.05)
        output = out.read_text(errors="replace") if out.exists() else ""
        if status is None:
            return -1, output + f"\n(still running after {timeout_s:.0f} s)"
        if self.alive():
            self.sync()
        return status, output

    def sync(self) -> None:
        """Wait for the bookkeeping line after a block: note the background jobs' process groups and the current
        folder."""
        jobs, cwd = self.work / "jobs", self.work / "cwd"
        deadline = time.monotonic() + 5
        while self.alive() and time.monotonic() < deadline and not (cwd.exists() and cwd.read_text().endswith("\n")):
            time.sleep(0.02)
        if jobs.exists():
            self.groups.update(int(pid) for pid in jobs.read_text().split())
        if cwd.exists() and cwd.read_text().strip():
            self.here = Path(cwd.read_text().strip())
        for path in (jobs, cwd):
            path.unlink(missing_ok=True)

    def groups_left(self) -> set[int]:
        """The process groups of the terminal's session with a live process: its background jobs, and a command
        still in the foreground when a block timed out (a group of its own under job control). Only the session's:
        a group id seen earlier may belong to someone else once its processes are gone."""
        return session_groups(self.proc.pid) if self.proc is not None else set()

    def stop(self) -> list[int]:
        """SIGTERM every process group of the terminal (the shell's too), SIGKILL what is left after `STOP_GRACE_S`;
        returns the groups still alive after that (none, normally)."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and self.groups_left():
            if self.proc is not None:
                self.proc.poll()  # reap the shell
            time.sleep(0.1)
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
        if self.log is not None:
            self.log.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and self.groups_left():  # SIGKILLed processes vanish once reaped
            time.sleep(0.1)
        return sorted(self.groups_left())

    def signal(self, signum: int) -> None:
        for pgid in self.groups_left():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signum)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Terminal]:
    folder, work = tmp_path / "scratch", tmp_path / "blocks"
    folder.mkdir()
    work.mkdir()
    term = Terminal(folder, work)
    term.start()
    try:
        yield term
    finally:
        left = term.stop()
        assert left == [], f"process groups still alive after SIGKILL: {left}"


def _fail(block: Block, what: str, output: str, logs: str = "") -> None:
    command = tail(block.code, 8)
    pytest.fail(f"{where(block)}: {what}\n--- command\n{command}\n--- output (last lines)\n{tail(output)}{logs}")


def _log_tails(block: Block, folder: Path) -> str:
    """The last lines of the log files a block's commands write to (`> controlplane.log`)."""
    parts = []
    for name in dict.fromkeys(_LOG_TARGET.findall(block.code)):
        path = folder / name
        if name != "/dev/null" and path.is_file():
            parts.append(f"\n--- {name} (last lines)\n{tail(path.read_text(errors='replace'))}")
    return "".join(parts)


def run_background(term: Terminal, block: Block, url: str) -> None:
    before = set(term.groups)
    lines = [line for line in block.code.strip().splitlines() if line.strip()]
    self_backgrounds = bool(lines) and lines[-1].rstrip().endswith("&") and not lines[-1].rstrip().endswith("&&")
    if self_backgrounds:
        status, output = term.run(block)
    else:
        log = term.work / f"background-{block.line}.log"
        code = f"( {block.code.strip()}\n) > {shlex.quote(str(log))} 2>&1 &\n"
        status, output = term.run(Block(block.path, block.line, block.lang, code, block.check, block.args))
    folder = term.cwd()
    if status != 0:
        _fail(block, f"starting it failed (exit {status})", output, _log_tails(block, folder))
    started = term.groups - before
    if not started:
        _fail(block, "it left no background job running (did it end at once?)", output, _log_tails(block, folder))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not answers(url):
        logs = _log_tails(block, folder)
        if not self_backgrounds:
            logs += f"\n--- its output (last lines)\n{tail(log.read_text(errors='replace'))}" if log.exists() else ""
        if not any(group_alive(g) for g in started):
            _fail(block, f"it ended before {url} answered", output, logs)
        if time.monotonic() > deadline:
            _fail(block, f"{url} did not answer within {READY_TIMEOUT_S:.0f} s", output, logs)
        time.sleep(0.2)


def run_expect(term: Terminal, block: Block, pattern: str) -> None:
    regex = re.compile(pattern)
    deadline = time.monotonic() + EXPECT_TIMEOUT_S
    tries = 0
    while True:
        tries += 1
        status, output = term.run(block, subshell=True, timeout_s=max(1.0, deadline - time.monotonic()))
        if status == 0 and regex.search(output):
            return
        if time.monotonic() > deadline - 1:
            what = f"exit {status}" if status else f"no match for expect={pattern!r}"
            _fail(block, f"{what} after {tries} tries in {EXPECT_TIMEOUT_S:.0f} s", output)
        time.sleep(1.0)


def write_file(term: Terminal, block: Block, name: str) -> None:
    target = term.cwd() / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(block.code)


def check_ports(path: Path) -> None:
    taken = [port for port in ports_of(path) if port_taken(port)]
    if taken:
        pytest.fail(f"{file_id(path)}: " + "; ".join(f"port {p} is taken: stop what listens there" for p in taken))


def run_page(path: Path, terminal: Terminal) -> None:
    """Every block of one Markdown file, in order, in `terminal`."""
    check_ports(path)
    for block in blocks(path):
        words, pairs = marker_args(block)
        if block.lang == "python" and block.check == "run":
            script = terminal.work / f"{block.line}.py"
            script.write_text(block.code)
            block = Block(block.path, block.line, "sh", f"python {shlex.quote(str(script))}\n", "run", block.args)
        elif block.lang != "sh":
            if "file" in pairs:
                write_file(terminal, block, pairs["file"])
            continue
        if block.check == "background":
            if not words:
                pytest.fail(f"{where(block)}: `background` needs the URL to wait for")
            run_background(terminal, block, words[0])
        elif block.check == "run" and "expect" in pairs:
            run_expect(terminal, block, pairs["expect"])
        elif block.check == "run":
            status, output = terminal.run(block)
            if status != 0:
                what = "timed out" if status == -1 else f"exit {status}"
                _fail(block, what, output, _log_tails(block, terminal.cwd()))


@pytest.mark.slow
@pytest.mark.parametrize("path", doc_files(), ids=file_id)
def test_documented_commands_run(path: Path, terminal: Terminal) -> None:
    run_page(path, terminal)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_PAGE = """# A page

<!-- check: background http://127.0.0.1:{port}/ -->
```sh
python -m http.server {port} --bind 127.0.0.1 > web.log 2>&1 &
```

<!-- check: yaml file=conf/settings.yaml -->
```yaml
greeting: hello
```

<!-- check: run -->
```python
from pathlib import Path

Path("conf/from-python.txt").write_text("written")
```

<!-- check: run -->
```sh
export GREETING=$(python -c 'import yaml; print(yaml.safe_load(open("conf/settings.yaml"))["greeting"])')
cd conf
```

<!-- check: run expect='^hello from conf$' -->
```sh
echo "$GREETING from $(basename "$PWD")"
```

<!-- check: background http://127.0.0.1:{other}/ -->
```sh
python -m http.server {other} --bind 127.0.0.1
```

<!-- check: run -->
```sh
kill %1 && wait %1 || true
curl -fsS http://127.0.0.1:{other}/ > /dev/null
sleep 300 &
false
echo never
```
"""


def test_the_runner_carries_state_and_reports_a_failing_block(tmp_path: Path, terminal: Terminal) -> None:
    """The runner itself, on a page of its own (seconds): a self-backgrounding job and one it backgrounds, a file block
    written where the shell is, a Python block run, an export and a `cd` carried to the next block, `expect=`, job
    control (`kill %1`), then a failing block reported with its file, line, command and output; the fixture then checks
    that nothing of the page is left running (the `sleep 300 &` of the failing block included)."""
    page = tmp_path / "page.md"
    page.write_text(_PAGE.format(port=_free_port(), other=_free_port()))
    with pytest.raises(pytest.fail.Exception) as failed:
        run_page(page, terminal)
    message = str(failed.value)
    line = next(block.line for block in blocks(page) if "false" in block.code)
    assert f"{page}:{line}: exit 1" in message, message
    assert "--- command" in message and "false" in message
    assert "never" not in message.split("--- output")[1]
    assert (terminal.folder / "conf" / "settings.yaml").read_text() == "greeting: hello\n"
    assert (terminal.folder / "web.log").exists()
    assert (terminal.folder / "conf" / "from-python.txt").read_text() == "written"


def test_a_taken_port_is_named(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        page = tmp_path / "page.md"
        page.write_text(f"<!-- check: run -->\n```sh\ncurl http://127.0.0.1:{port}/\n```\n")
        with pytest.raises(pytest.fail.Exception, match=f"port {port} is taken: stop what listens there"):
            check_ports(page)
