"""Every fenced block of README.md and docs/ is checked against the code it shows, so the docs cannot drift from it.

A failure names the Markdown file and line. What each language's block is checked with:
- `sh`: split into simple commands (tests/docs/shell.py), each checked by its name:
  `spillway ...` against the real CLI (command path, options, required options, values, as click parses them);
  `curl` by method (-X; -d/--data*/--json/-F: POST; -I: HEAD; -T: PUT) and URL: port 8400 (or `$SPILLWAY_API`) against
  the control plane's routes, port 8000 against the edge agent's (V2, OpenAI `/v1/...`, `/metrics`, jobs); `make X`
  against the Makefile's targets; `pip install 'spillway[x]'` / `'.[x]'` against pyproject's extras; `python
  bench/x.py --flag` against the script's `--help`; `python -m M`: M exists; paths into the repository's folders
  (`bench/`, `tests/`, `.ci/`, ...) must exist; any other command must be one of KNOWN_TOOLS.
- `yaml`: the marker names what it is: `agent-config` (AgentConfig.load, what `spillway agent serve --config`
  reads, with `--model-repository` and SPILLWAY_AGENT_TOKEN where the snippet has none), `model-config` (the
  agent's config.yaml reader), `fleet` (examples/fleet.yaml's shape: each item against the REST API's create
  schema), `openslo` (the control plane's importer), `prometheus-rules` / `prometheus-config` (promtool; skipped
  without it unless CI=true), `alertmanager-config` (a `route` with a `receiver` among the `receivers`), `yaml`
  (parsed only). Marker arguments (`file=NAME`, the runner's) are ignored here.
- `json`: parsed; `<!-- check: rest METHOD PATH -->` validates it against that control-plane operation's request
  schema in the OpenAPI document.
- `pbtxt`: parsed into Triton's ModelConfig with the protobuf text format, as the agent reads config.pbtxt.
- `python`: compiled.
- `text`, `mermaid`, `promql`, `nginx`, `http`, `toml`, `ini`, `console`: not checked (output, synopses, pictures).
Any other language, or none, fails. Every `SPILLWAY_*` name in a page (blocks and prose) must be a control-plane
setting or one of KNOWN_VARIABLES, each of which the code reads (tested, so the list cannot go stale).
`<!-- check: run -->` and `background` blocks are also run, by tests/docs/test_run.py.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from tests.docs.blocks import ROOT, Block, all_blocks, blocks, markdown_files
from tests.docs.shell import Command, ShellSyntaxError, commands

IGNORED_LANGUAGES = frozenset({"text", "mermaid", "promql", "nginx", "http", "toml", "ini", "console"})
CHECKED_LANGUAGES = frozenset({"sh", "yaml", "json", "pbtxt", "python"})
MARKERS: dict[str, set[str | None]] = {
    "sh": {None, "run", "background"},
    "json": {None, "rest"},
    "python": {None, "run"},
    "pbtxt": {None},
}

# Ordinary tools a page may show beside Spillway's own commands.
KNOWN_TOOLS = frozenset({
    "[", "alertmanager", "amtool", "apt", "apt-get", "awk", "base64", "cat", "cd", "chmod", "chown", "cp", "createdb",
    "curl", "date", "diff", "docker", "dropdb", "echo", "export", "false", "find", "git", "grep", "grpcurl", "gzip",
    "head", "hostname", "jq", "jtop", "kill", "ln", "ls", "lsof", "mkdir", "mkdocs", "mv", "mypy", "nc", "nginx",
    "nvidia-smi", "openssl", "pg_dump", "pg_restore", "pgrep", "printf", "prometheus", "promtool", "ps", "psql",
    "read", "rm", "ruff", "sed", "set", "sha256sum", "sleep", "sort", "source", ".", "sqlite3", "ss", "streamlit",
    "systemctl", "tail", "tar", "tee", "tegrastats", "test", "touch", "trtexec", "true", "uname", "unset", "wait",
    "wc", "wget", "xargs", "journalctl", "bash", "sh", "exit",
})  # fmt: skip
# Commands that run the rest of their words as a command: name -> (its options that take a value, how many words
# come before the command: `timeout 5 cmd`).
WRAPPERS: dict[str, tuple[frozenset[str], int]] = {
    "sudo": (frozenset({"-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U"}), 0),
    "env": (frozenset({"-u", "-C", "-S"}), 0),
    "nohup": (frozenset(), 0),
    "exec": (frozenset(), 0),
    "time": (frozenset(), 0),
    "command": (frozenset(), 0),
    "timeout": (frozenset({"-s", "-k", "--signal", "--kill-after"}), 1),
    "flock": (frozenset({"-w", "-E", "-c", "--timeout", "--conflict-exit-code"}), 1),
    "watch": (frozenset({"-n", "--interval", "-d"}), 0),
}
# SPILLWAY_* variables that are not control-plane settings, each read by the code (test_known_variables_are_read).
KNOWN_VARIABLES = frozenset({
    "SPILLWAY_API",  # spillway slo: the control plane's base URL
    "SPILLWAY_API_KEY",  # the CLI's and the dashboard's API key
    "SPILLWAY_API_URL",  # the dashboard app's control plane
    "SPILLWAY_AGENT_TOKEN",  # spillway agent serve --agent-token
    "SPILLWAY_DASHBOARD_REFRESH_S",  # the dashboard's refresh interval
    "SPILLWAY_LLAMA_CPP_PYTHON",  # the llama.cpp gateway test's interpreter
    "SPILLWAY_TEST_POSTGRES_URL",  # the PostgreSQL tests
    "SPILLWAY_UPDATE_SCREENSHOTS",  # the dashboard's browser test rewrites docs/screenshots/
    "SPILLWAY_WORKER_INDEX",  # set by the control plane's worker supervisor
})  # fmt: skip
CODE_FOLDERS = ("spillway", "controlplane", "edge_agent", "dashboards", "bench", "tests", ".ci")
# A path whose first folder is one of these is the repository's: it must exist.
REPOSITORY_FOLDERS = frozenset({
    "bench", "tools", "examples", "tests", ".ci", "docs", "spillway", "controlplane", "edge_agent", "dashboards",
    "migrations",
})  # fmt: skip
CONTROL_PLANE_PORT, AGENT_PORT, AGENT_GRPC_PORT = 8400, 8000, 8001
# The agent's OpenAI-compatible routes (edge_agent/serving/openai_api.py, OpenAIApi.handle); V2's are allowed_methods.
OPENAI_ROUTES = {"/v1/models": ("GET", "HEAD"), "/v1/completions": ("POST",), "/v1/chat/completions": ("POST",)}
_SPILLWAY_NAME = re.compile(r"\bSPILLWAY_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_*])")
_PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
_EXTRAS = re.compile(r"^(?:spillway|\.)\[([^\]]*)\]")

BLOCKS = all_blocks()


# --- the parametrised tests: every block, every page
@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_block(block: Block) -> None:
    problems = check_block(block)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_spillway_variables_are_known(path: Path) -> None:
    problems = unknown_variables(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_fence_is_seen(path: Path) -> None:
    deep = [f"{path.relative_to(ROOT)}:{number}" for number in unseen_fences(path)]
    assert deep == [], f"fenced blocks indented too deep for tests/docs/blocks.py (so never checked): {deep}"


def unseen_fences(path: Path) -> list[int]:
    """Lines of fences blocks.py does not read (indented by more than 4 spaces: a block in an admonition in a tab),
    outside the blocks it reads: such a block would go unchecked, so it is refused; write it shallower."""
    inside = {line for block in blocks(path) for line in range(block.line, block.line + block.code.count("\n") + 2)}
    lines = path.read_text(encoding="utf-8").splitlines()
    return [number for number, line in enumerate(lines, start=1)
            if re.match(r"^\s{5,}(`{3,}|~{3,})", line) and number not in inside]  # fmt: skip


def check_block(block: Block) -> list[str]:
    """What is wrong with one block (empty: nothing), each problem starting with its file and line."""
    if not block.lang:
        return [f"{block.where}: the block declares no language (```sh, ```yaml, ```text, ...)"]
    if block.lang in IGNORED_LANGUAGES:
        return []
    if block.lang not in CHECKED_LANGUAGES:
        known = ", ".join(sorted(CHECKED_LANGUAGES | IGNORED_LANGUAGES))
        return [f"{block.where}: unknown language {block.lang!r} (one of {known})"]
    if block.lang == "yaml":
        return check_yaml(block)
    if block.check not in MARKERS[block.lang]:
        return [f"{block.where}: a {block.lang} block takes no `check: {block.check}` marker"]
    checker: dict[str, Callable[[Block], list[str]]] = {
        "sh": check_sh,
        "json": check_json,
        "pbtxt": check_pbtxt,
        "python": check_python,
    }
    return checker[block.lang](block)


# --- sh
def check_sh(block: Block) -> list[str]:
    try:
        found = commands(block.code)
    except ShellSyntaxError as exc:
        return [f"{block.where}: cannot split the block into commands: {exc}"]
    problems = []
    if block.check == "background":  # the URL the runner waits for must be one of a service's routes
        url = block.args.split()[0] if block.args else ""
        problem = check_curl([url]) if url else "`check: background` needs the URL to wait for"
        problems += [f"{block.where}: {problem}"] if problem else []
    for command in found:
        if not command.words:
            continue  # only assignments: `X=1`
        problem = check_command(command.words)
        if problem is not None:
            problems.append(
                f"{block.path.relative_to(ROOT)}:{block.line + 1 + command.line}: `{command.text}`: {problem}"
            )
    return problems


def check_command(words: Sequence[str]) -> str | None:
    """What is wrong with one simple command (None: nothing)."""
    name, args = words[0], list(words[1:])
    if Command.dynamic(name):
        return None  # `$EDITOR file`: whatever the variable holds
    if "/" in name:
        if (problem := missing_path(name)) is not None:
            return problem
        name = name.rsplit("/", 1)[1]
    if name in WRAPPERS:
        rest = unwrap(name, args)
        return check_command(rest) if rest else None
    if name == "spillway":
        return check_spillway(args)
    if _PYTHON.match(name):
        return check_python_command(args)
    if name in ("pip", "pip3"):
        return check_pip(args)
    if name == "pytest":
        return check_paths(args)
    if name == "make":
        return check_make(args)
    if name == "curl":
        return check_curl(args)
    if name in ("bash", "sh", "source", "."):
        return check_paths(args[:1])
    if name in KNOWN_TOOLS or "/" in words[0]:
        return None
    return f"unknown command {name!r}: neither Spillway's nor an ordinary tool (KNOWN_TOOLS in {Path(__file__).name})"


def unwrap(name: str, args: list[str]) -> list[str]:
    """The command a wrapper (`sudo`, `env X=1`, `timeout 5`, ...) runs."""
    takes_value, leading = WRAPPERS[name]
    i = 0
    while i < len(args) and (args[i].startswith("-") or (name == "env" and "=" in args[i])):
        i += 2 if args[i] in takes_value else 1
    return args[i + leading :]


def missing_path(path: str) -> str | None:
    """A path into the repository's folders that does not exist (None: it exists, or it is not the repository's)."""
    parts = Path(path.split("::")[0]).parts
    if not parts or parts[0] not in REPOSITORY_FOLDERS or Command.dynamic(path):
        return None
    return None if (ROOT / Path(*parts)).exists() else f"{path} does not exist in the repository"


def check_paths(args: Sequence[str]) -> str | None:
    problems = [problem for arg in args if not arg.startswith("-") and (problem := missing_path(arg)) is not None]
    return "; ".join(problems) or None


# spillway
@functools.cache
def cli() -> Any:
    from typer.main import get_command

    from spillway.cli import app

    return get_command(app)


def check_spillway(args: Sequence[str]) -> str | None:
    """The command path must exist and click must accept the options and arguments (values of variables: `1`)."""
    command, path, rest = cli(), ["spillway"], list(args)
    while hasattr(command, "commands"):
        if not rest:
            return f"`{' '.join(path)}` is a group: name one of its commands ({', '.join(command.commands)})"
        if rest[0] == "--help" or rest[0] in ("--install-completion", "--show-completion"):
            return None
        if rest[0] not in command.commands:
            return f"`{' '.join(path)}` has no command {rest[0]!r} (one of {', '.join(command.commands)})"
        path.append(rest[0])
        command = command.commands[rest.pop(0)]
    if "--help" in rest:
        return None
    values = ["1" if Command.dynamic(arg) else arg for arg in rest]
    try:
        command.make_context(" ".join(path), values)
    except Exception as exc:  # click's UsageError and its kinds (typer vendors click: no public class to name)
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        return f"{' '.join(path)}: {message}"
    return None


# python, pip, make
def check_python_command(args: Sequence[str]) -> str | None:
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c"):
        i += 2 if args[i] in ("-X", "-W") else 1
    if i >= len(args):
        return None
    if args[i] == "-c":
        return _compiles(args[i + 1], "python -c") if i + 1 < len(args) and not Command.dynamic(args[i + 1]) else None
    if args[i] == "-m":
        module, rest = (args[i + 1] if i + 1 < len(args) else ""), list(args[i + 2 :])
        if module in ("pip", "pytest", "spillway"):
            return check_command([module, *rest])
        return None if importlib.util.find_spec(module) is not None else f"no module {module!r}"
    script, flags = args[i], [arg for arg in args[i + 1 :] if arg.startswith("-") and arg != "-"]
    if (problem := missing_path(script)) is not None:
        return problem
    if script.endswith(".py") and Path(script).parts[0] in REPOSITORY_FOLDERS:
        return check_script_flags(script, flags)
    return None


def check_script_flags(script: str, flags: Sequence[str]) -> str | None:
    """Each `--flag` must be one the script's argparse `--help` names."""
    if not flags:
        return None
    if "argparse" not in (ROOT / script).read_text(encoding="utf-8"):
        return f"{script} takes no options (no argparse), given {' '.join(flags)}"
    usage = script_help(script)
    unknown = [
        flag
        for flag in (f.split("=", 1)[0] for f in flags)
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", usage)
    ]
    return f"{script} has no option {', '.join(unknown)} (see `{script} --help`)" if unknown else None


@functools.cache
def script_help(script: str) -> str:
    result = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"{script} --help failed:\n{result.stderr[-2000:]}"
    return result.stdout


@functools.cache
def extras() -> frozenset[str]:
    """pyproject.toml's optional-dependency groups (read as text: tomllib is Python 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return frozenset(re.findall(r"^([A-Za-z0-9_-]+)\s*=", section, flags=re.MULTILINE))


def check_pip(args: Sequence[str]) -> str | None:
    problems = []
    for arg in args:
        if (match := _EXTRAS.match(arg)) is not None:
            unknown = [extra.strip() for extra in match[1].split(",") if extra.strip() not in extras()]
            if unknown:
                problems.append(
                    f"no extra {', '.join(unknown)} in pyproject.toml (one of {', '.join(sorted(extras()))})"
                )
    return "; ".join(problems) or None


@functools.cache
def make_targets() -> frozenset[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        if (match := re.match(r"^([A-Za-z0-9_.%/$() -]+?)\s*::?(?!=)", line)) is not None:
            targets.update(name for name in match[1].split() if not name.startswith((".", "$")))
    return frozenset(targets)


def check_make(args: Sequence[str]) -> str | None:
    wanted = [arg for arg in args if not arg.startswith("-") and "=" not in arg]
    unknown = [target for target in wanted if target not in make_targets()]
    return f"the Makefile has no target {', '.join(unknown)}" if unknown else None


# curl
_CURL_SHORT_VALUES = frozenset("XHdFouwTmAebcKxrEYyzCQDUt")
_CURL_LONG_VALUES = frozenset({
    "--request", "--header", "--data", "--data-raw", "--data-binary", "--data-urlencode", "--data-ascii", "--json",
    "--form", "--form-string", "--output", "--user", "--write-out", "--upload-file", "--max-time", "--connect-timeout",
    "--user-agent", "--referer", "--cookie", "--cookie-jar", "--config", "--proxy", "--range", "--cert", "--key",
    "--cacert", "--capath", "--retry", "--retry-delay", "--retry-max-time", "--resolve", "--oauth2-bearer",
    "--unix-socket", "--url", "--dump-header", "--limit-rate", "--interface", "--cert-type", "--key-type",
    "--noproxy", "--proxy-user", "--variable", "--url-query", "--connect-to", "--stderr", "--trace", "--trace-ascii",
    "--expect100-timeout", "--max-filesize", "--aws-sigv4", "--pinnedpubkey", "--ciphers", "--tls-max",
})  # fmt: skip
_CURL_BODY = ("-d", "-F", "--data", "--json", "--form")


@dataclass(frozen=True)
class CurlRequest:
    method: str
    urls: tuple[str, ...]
    data: tuple[str, ...]  # the values of -d/--data*/--json


def curl_request(args: Sequence[str]) -> CurlRequest:
    """What a curl command line asks for."""
    method, urls, data, form, head, get, upload = None, [], [], False, False, False, False
    i = 0
    while i < len(args):
        arg = args[i]
        value: str | None = None
        option = arg
        if arg.startswith("--"):
            if arg in _CURL_LONG_VALUES:
                value, i = (args[i + 1] if i + 1 < len(args) else ""), i + 1
        elif arg.startswith("-") and len(arg) > 1:
            for j, letter in enumerate(arg[1:], start=1):
                if letter in _CURL_SHORT_VALUES:
                    option = f"-{letter}"
                    if j + 1 < len(arg):
                        value = arg[j + 1 :]
                    else:
                        value, i = (args[i + 1] if i + 1 < len(args) else ""), i + 1
                    break
                head |= letter == "I"
                get |= letter == "G"
        else:
            urls.append(arg)
        if option in ("-X", "--request"):
            method = value
        elif option == "--url" and value is not None:
            urls.append(value)
        elif option in ("-d", "--json") or option.startswith("--data"):
            data.append(value or "")
        elif option in ("-F", "--form", "--form-string"):
            form = True
        elif option in ("-T", "--upload-file"):
            upload = True
        head |= option == "--head"
        get |= option == "--get"
        i += 1
    if method is None:
        posts = bool(data) or form
        method = "HEAD" if head else "GET" if get else "POST" if posts else "PUT" if upload else "GET"
    return CurlRequest(method.upper(), tuple(urls), tuple(data))


def check_curl(args: Sequence[str]) -> str | None:
    request = curl_request(args)
    if not request.urls:
        return "curl without a URL"
    problems = []
    for url in request.urls:
        target = url_target(url)
        if target is None:
            continue
        port, path = target
        if port == CONTROL_PLANE_PORT:
            problem = control_plane_route(request.method, path)
            if problem is None and len(request.data) == 1:
                problem = "; ".join(body_problems(request.method, path, request.data[0])) or None
        elif port == AGENT_PORT:
            problem = agent_route(request.method, path)
        elif port == AGENT_GRPC_PORT:
            problem = f"{url}: port {AGENT_GRPC_PORT} is the agent's gRPC port; its HTTP API is on {AGENT_PORT}"
        else:
            problem = None
        if problem is not None:
            problems.append(problem)
    return "; ".join(problems) or None


def url_target(url: str) -> tuple[int | None, str] | None:
    """(port, path) of a URL (the control plane's port for `$SPILLWAY_API`); None where a variable hides them."""
    variable = re.match(r"^\$(\{SPILLWAY_API\}|SPILLWAY_API)(?![A-Za-z0-9_])", url)
    if variable is not None:
        port: int | None = CONTROL_PLANE_PORT
        path = url[variable.end() :]
    elif url.startswith("$"):
        return None  # a base URL in another variable
    else:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        try:
            port = parts.port
        except ValueError:
            return None  # `:$PORT`
        path = parts.path
    return port, urlsplit(f"http://host{path}").path or "/"


def body_problems(method: str, path: str, data: str) -> list[str]:
    """A literal JSON body sent to a control-plane route that takes one is checked as a `rest` block is."""
    if data.startswith("@") or Command.dynamic(data):
        return []
    try:
        body = json.loads(data)
    except json.JSONDecodeError:
        return []  # form data, or not JSON: the route says what it makes of it
    route = control_plane_operation(method, path)
    if route is None or getattr(route, "body_field", None) is None:
        return []
    return request_problems(method, path, body)


@functools.cache
def control_plane() -> Any:
    """The control plane's app as tests/conftest.py builds it (nothing is opened before its lifespan starts)."""
    from controlplane.app import create_app
    from controlplane.settings import Settings

    with tempfile.TemporaryDirectory() as scratch:
        return create_app(Settings(database_url=f"sqlite:///{scratch}/docs.db", ingest_log_dir=f"{scratch}/log"))


def control_plane_route(method: str, path: str) -> str | None:
    """Which methods the control plane takes on `path`, as its own `OPTIONS` answers (controlplane/api/methods.py)."""
    from controlplane.api.methods import allowed_methods

    methods = allowed_methods(control_plane(), {"path": path})
    if not methods:
        return f"the control plane has no route {method} {path}"
    return None if method in methods else f"the control plane answers {path} with {', '.join(methods)}, not {method}"


def agent_methods(path: str) -> tuple[str, ...] | None:
    """The methods the agent's HTTP port takes on `path` (None: no route)."""
    from edge_agent.serving.app import allowed_methods

    if path.startswith("/v1/"):
        if path in OPENAI_ROUTES:
            return OPENAI_ROUTES[path]
        return ("GET", "HEAD") if re.fullmatch(r"/v1/models/[^/]+", path) else None
    return allowed_methods(path)


def agent_route(method: str, path: str) -> str | None:
    methods = agent_methods(path)
    if methods is None:
        return f"the edge agent has no route {path}"
    return None if method in methods else f"the edge agent answers {path} with {', '.join(methods)}, not {method}"


# --- yaml
YAML_KINDS: dict[str, Callable[[Block], list[str]]] = {}


def yaml_kind(name: str) -> Callable[[Callable[[Block], list[str]]], Callable[[Block], list[str]]]:
    def register(check: Callable[[Block], list[str]]) -> Callable[[Block], list[str]]:
        YAML_KINDS[name] = check
        return check

    return register


def check_yaml(block: Block) -> list[str]:
    if block.check is None:
        kinds = ", ".join(YAML_KINDS)
        return [f"{block.where}: a yaml block needs a marker naming its kind: <!-- check: KIND --> ({kinds})"]
    if block.check not in YAML_KINDS:
        return [f"{block.where}: unknown yaml kind {block.check!r} (one of {', '.join(YAML_KINDS)})"]
    try:
        list(yaml.safe_load_all(block.code))
    except yaml.YAMLError as exc:
        return [f"{block.where}: not valid YAML: {exc}"]
    return YAML_KINDS[block.check](block)


@yaml_kind("yaml")
def _plain_yaml(block: Block) -> list[str]:
    return []


# What `spillway agent serve --config FILE` adds to a file that lacks it, as the docs run it: `--model-repository`
# and the agent's token from SPILLWAY_AGENT_TOKEN (a secret stays out of the file).
COMMAND_LINE: dict[str, Any] = {"model_repository": Path("models"), "agent_token": "agent-token-from-the-environment"}


@yaml_kind("agent-config")
def _agent_config(block: Block) -> list[str]:
    from edge_agent.config import AgentConfig
    from edge_agent.config_errors import AgentConfigError

    data = yaml.safe_load(block.code)
    keys = set(data) if isinstance(data, dict) else set()
    given = {key: value for key, value in COMMAND_LINE.items() if key not in keys}
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "agent.yaml"
        path.write_text(block.code, encoding="utf-8")
        try:
            AgentConfig.load(path, **given)
        except AgentConfigError as exc:
            lines = [line.replace(str(path), "the block") for line in exc.lines]
            return [f"{block.where}: not a valid agent config: {line}" for line in lines]
    return []


def _model_config_file(block: Block, name: str) -> list[str]:
    from edge_agent.runtime.config import ModelConfigError, parse_config_file

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / name
        path.write_text(block.code, encoding="utf-8")
        try:
            parse_config_file(path)
        except ModelConfigError as exc:
            return [f"{block.where}: not a valid model config: {str(exc).replace(str(path), 'the block')}"]
    return []


@yaml_kind("model-config")
def _model_config(block: Block) -> list[str]:
    return _model_config_file(block, "config.yaml")


@yaml_kind("fleet")
def _fleet(block: Block) -> list[str]:
    from spillway.demo.run import SEED_ORDER

    fleet = yaml.safe_load(block.code)
    if not isinstance(fleet, dict):
        return [f"{block.where}: a fleet is a mapping of {', '.join(SEED_ORDER)}"]
    problems = [
        f"{block.where}: {kind!r} is not a kind the demo seeds ({', '.join(SEED_ORDER)})"
        for kind in fleet
        if kind not in SEED_ORDER
    ]
    for kind in SEED_ORDER:
        for index, item in enumerate(fleet.get(kind) or []):
            problems += [
                f"{block.where}: {kind}[{index}]: {problem}"
                for problem in request_problems("POST", f"/api/v1/{kind}", item)
            ]
    return problems


@yaml_kind("openslo")
def _openslo(block: Block) -> list[str]:
    from controlplane.errors import ValidationFailed
    from controlplane.slo.openslo import parse

    try:
        parse(block.code)
    except ValidationFailed as exc:
        details = "; ".join(f"{d.get('field')}: {d.get('message')}" for d in exc.details)
        return [f"{block.where}: the OpenSLO importer refuses it: {exc}" + (f" ({details})" if details else "")]
    return []


def _promtool(block: Block, what: str, *options: str) -> list[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but promtool is missing: install Debian's prometheus package (.ci/run does)")
        pytest.skip(f"{block.where}: promtool is not installed (Debian's prometheus package): not checked")
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "block.yml"
        path.write_text(block.code, encoding="utf-8")
        result = subprocess.run(
            [promtool, "check", what, *options, str(path)], capture_output=True, text=True, timeout=60, check=False
        )
    if result.returncode != 0:
        output = (result.stdout + result.stderr).replace(str(path), "the block").strip()
        return [f"{block.where}: promtool check {what} fails:\n{output}"]
    return []


@yaml_kind("prometheus-rules")
def _prometheus_rules(block: Block) -> list[str]:
    return _promtool(block, "rules")


@yaml_kind("prometheus-config")
def _prometheus_config(block: Block) -> list[str]:
    return _promtool(block, "config", "--syntax-only")  # files it names (rules, keys) are the reader's machine's


@yaml_kind("alertmanager-config")
def _alertmanager_config(block: Block) -> list[str]:
    config = yaml.safe_load(block.code)
    route = config.get("route") if isinstance(config, dict) else None
    if not isinstance(route, dict) or not route.get("receiver"):
        return [f"{block.where}: an Alertmanager config needs a `route` with a default `receiver`"]
    receivers = {r.get("name") for r in config.get("receivers") or [] if isinstance(r, dict)}
    if route["receiver"] not in receivers:
        return [f"{block.where}: the route's receiver {route['receiver']!r} is not among `receivers`"]
    return []


# --- json, pbtxt, python
def check_json(block: Block) -> list[str]:
    try:
        document = json.loads(block.code)
    except json.JSONDecodeError as exc:
        return [f"{block.path.relative_to(ROOT)}:{block.line + exc.lineno}: not valid JSON: {exc.msg}"]
    if block.check != "rest":
        return []
    method, _, path = block.args.partition(" ")
    return [f"{block.where}: {problem}" for problem in request_problems(method.upper(), path.strip(), document)]


@functools.cache
def openapi() -> dict[str, Any]:
    return dict(control_plane().openapi())


def control_plane_operation(method: str, path: str) -> Any | None:
    """The route of the control plane that serves `method path`, found as its router finds it (None: none)."""
    from starlette.routing import Match

    from controlplane.api.methods import _leaf_routes

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}
    return next((route for route in _leaf_routes(control_plane()) if route.matches(scope)[0] is Match.FULL), None)


def request_problems(method: str, path: str, body: Any) -> list[str]:
    """Why the control plane would refuse `body` on `method path` (empty: it takes it): checked against the request
    schema of its OpenAPI document (what the REST reference shows) and against the route's own body model."""
    route = control_plane_operation(method, path)
    if route is None:
        return [f"the control plane has no operation {method} {path}"]
    where = f"{method} {route.path_format}"
    operation = openapi()["paths"].get(route.path_format, {}).get(method.lower(), {})
    schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if schema is None or getattr(route, "body_field", None) is None:
        return [f"{where} takes no JSON body"]
    validator = jsonschema.Draft202012Validator({**schema, "components": openapi().get("components", {})})
    errors = sorted(validator.iter_errors(body), key=lambda error: list(error.absolute_path))
    problems = [f"{where}: {error.json_path}: {error.message} (the OpenAPI schema)" for error in errors]
    _, refused = route.body_field.validate(body, {}, loc=("body",))
    for error in refused or []:
        field = ".".join(str(part) for part in error["loc"][1:]) or "the body"
        problems.append(f"{where}: {field}: {error['msg']} (the route's model)")
    return problems


def check_pbtxt(block: Block) -> list[str]:
    return _model_config_file(block, "config.pbtxt")


def check_python(block: Block) -> list[str]:
    problem = _compiles(block.code, block.where)
    return [f"{block.where}: {problem}"] if problem else []


def _compiles(code: str, where: str) -> str | None:
    try:
        compile(code, where, "exec")
    except SyntaxError as exc:
        return f"not valid Python (line {exc.lineno}): {exc.msg}"
    return None


# --- SPILLWAY_* names
@functools.cache
def known_variables() -> frozenset[str]:
    from controlplane.settings import Settings

    return frozenset(f"SPILLWAY_{name.upper()}" for name in Settings.model_fields) | KNOWN_VARIABLES


def unknown_variables(text: str, where: str) -> list[str]:
    """The `SPILLWAY_*` names of a page (`where`: its path) that nothing reads, each with its line."""
    problems = []
    for number, line in enumerate(text.splitlines(), start=1):
        for name in _SPILLWAY_NAME.findall(line):
            if name not in known_variables():
                problems.append(
                    f"{where}:{number}: {name} is neither a control-plane setting "
                    "(controlplane/settings.py) nor a variable the code reads (KNOWN_VARIABLES)"
                )
    return problems


# --- the checks can fail: small blocks of each kind
def _block(lang: str, code: str, check: str | None = None, args: str = "") -> Block:
    return Block(ROOT / "docs" / "example.md", 10, lang, code, check, args)


def _fails(block: Block, *expected: str) -> None:
    problems = check_block(block)
    assert problems, f"expected a failure for:\n{block.code}"
    assert all(problem.startswith("docs/example.md:") for problem in problems)
    text = "\n".join(problems)
    for part in expected:
        assert part in text, text


def _passes(block: Block) -> None:
    assert check_block(block) == []


def test_every_block_declares_a_known_language() -> None:
    _fails(_block("", "spillway version\n"), "docs/example.md:10: the block declares no language")
    _fails(_block("bash", "spillway version\n"), "unknown language 'bash'")
    _passes(_block("text", "spillway slo rules ID|NAME [-o FILE]\n"))


def test_shell_splitting() -> None:
    script = (
        "export SPILLWAY_API_KEY=$(spillway controlplane create-key --role admin --name ops)  # the key\n"
        "curl -s -H 'A: b' \\\n  -d '{\"a\":\n 1}' http://127.0.0.1:8400/api/v1/slos | jq . && echo \"ok `date`\"\n"
        "cat > agent.yaml <<'EOF'\nport: 8000\nEOF\n"
        "X=1 Y=2 spillway version 2>&1 >/dev/null; (cd docs || exit)\n"
    )
    found = [(c.line, c.env, c.words) for c in commands(script)]
    assert found == [
        (0, (), ("spillway", "controlplane", "create-key", "--role", "admin", "--name", "ops")),
        (0, (), ("export", "SPILLWAY_API_KEY=$(spillway controlplane create-key --role admin --name ops)")),
        (1, (), ("curl", "-s", "-H", "A: b", "-d", '{"a":\n 1}', "http://127.0.0.1:8400/api/v1/slos")),
        (3, (), ("jq", ".")),
        (3, (), ("date",)),
        (3, (), ("echo", "ok `date`")),
        (4, (), ("cat",)),
        (7, (("X", "1"), ("Y", "2")), ("spillway", "version")),
        (7, (), ("cd", "docs")),
        (7, (), ("exit",)),
    ]
    with pytest.raises(ShellSyntaxError):
        commands("echo 'open\n")


def test_spillway_commands_are_checked_against_the_cli() -> None:
    _passes(
        _block(
            "sh",
            "spillway controlplane create-key --role admin --name ops\nspillway slo export --all\n"
            "spillway agent serve --model-repository models --port $PORT --config agent.yaml\n",
        )
    )
    _fails(_block("sh", "\nspillway controlplane serve --bogus\n"), "docs/example.md:12:", "No such option: --bogus")
    _fails(_block("sh", "spillway controlplane create-key --role admin\n"), "Missing option '--name'")
    _fails(_block("sh", "spillway agent burst --requests many\n"), "'--requests'")
    _fails(_block("sh", "spillway controlplane frobnicate\n"), "has no command 'frobnicate'")
    _fails(_block("sh", "spillway slo\n"), "is a group")
    _fails(_block("sh", "export K=$(spillway controlplane create-key --nme ops)\n"), "No such option: --nme")


def test_curl_is_checked_against_the_routes() -> None:
    _passes(
        _block(
            "sh",
            'curl -H "Authorization: Bearer $SPILLWAY_API_KEY" http://127.0.0.1:8400/api/v1/slos/$SLO_ID\n'
            "curl -sf -d @slo.json http://127.0.0.1:8400/api/v1/slos\ncurl -sI http://127.0.0.1:8000/v2/health/ready\n"
            "curl http://127.0.0.1:8000/v2/models/mlp/versions/2/infer -d @body.json\n"
            "curl -X POST localhost:8000/v1/chat/completions --json '{}'\n"
            "curl $SPILLWAY_API/api/v1/rules/{id}/status\ncurl http://127.0.0.1:9090/api/v1/query\n",
        )
    )
    _passes(_block("sh", "spillway agent serve --model-repository models\n", "background", "http://127.0.0.1:8000/v2"))
    _fails(_block("sh", "spillway agent serve\n", "background", "http://127.0.0.1:8000/v2/ready"), "no route /v2/ready")
    _fails(_block("sh", "curl http://127.0.0.1:8400/api/v1/slo\n"), "the control plane has no route GET /api/v1/slo")
    _fails(_block("sh", "curl -X DELETE http://127.0.0.1:8400/api/v1/slos\n"), "with GET, POST, OPTIONS, not DELETE")
    _fails(_block("sh", "curl -d '{}' http://127.0.0.1:8400/metrics\n"), "not POST")
    _fails(_block("sh", "curl -I http://127.0.0.1:8400/healthz\n"), "not HEAD")
    _fails(_block("sh", "curl http://127.0.0.1:8000/v2/models/mlp/infer\n"), "with POST, not GET")
    _fails(_block("sh", "curl http://127.0.0.1:8000/v2/repository\n"), "the edge agent has no route /v2/repository")
    _fails(_block("sh", "curl -X POST http://127.0.0.1:8000/v1/embeddings\n"), "no route /v1/embeddings")
    assert curl_request(["-sSX", "put", "-d", "x", "u"]) == CurlRequest("PUT", ("u",), ("x",))
    assert curl_request(["-G", "--data-urlencode", "a=1", "u"]).method == "GET"
    assert curl_request(["-F", "a=@f", "--url", "u"]) == CurlRequest("POST", ("u",), ())
    slo = '{"name": "x", "sli_kind": "latency", "threshold_ms": 50, "objective": 99, "window": "28d"}'
    _passes(_block("sh", f"curl -H 'Content-Type: application/json' -d '{slo}' http://127.0.0.1:8400/api/v1/slos\n"))
    bad = slo.replace("99", "140")
    _fails(
        _block("sh", f"curl -d '{bad}' http://127.0.0.1:8400/api/v1/slos\n"), "objective: Input should be less than 100"
    )


def test_the_openai_route_table_is_the_agents() -> None:
    import inspect

    from edge_agent.serving.openai_api import OpenAIApi

    handler = inspect.getsource(OpenAIApi.handle)
    assert all(f'"{path}"' in handler for path in OPENAI_ROUTES), "OPENAI_ROUTES differs from OpenAIApi.handle"
    assert '"/v1/models/"' in handler  # one model: GET /v1/models/{name}


def test_make_pip_python_and_paths_are_checked() -> None:
    _passes(
        _block(
            "sh",
            "make demo\npip install 'spillway[controlplane,dashboard]'\n.venv/bin/pip install -e '.[dev]'\n"
            "python -m venv .venv\n.venv/bin/pytest tests/docs/test_snippets.py -k curl\n",
        )
    )
    _fails(_block("sh", "make demo-all\n"), "no target demo-all")
    _fails(_block("sh", "pip install 'spillway[controlplane,cloud]'\n"), "no extra cloud")
    _fails(_block("sh", "python3 -m pip install 'spillway[gpus]'\n"), "no extra gpus")
    _fails(_block("sh", ".venv/bin/pytest tests/docs/test_nothing.py\n"), "does not exist")
    _fails(_block("sh", "python bench/nothing.py\n"), "bench/nothing.py does not exist")
    _fails(_block("sh", "python -m spillway_nothing\n"), "no module 'spillway_nothing'")
    _fails(_block("sh", "python -c 'print(1'\n"), "not valid Python")


def test_bench_flags_are_checked_against_the_script() -> None:
    _passes(_block("sh", ".venv/bin/python bench/load.py --help\n"))
    usage = script_help("bench/load.py")
    flag = re.search(r"--[a-z][a-z-]+", usage.replace("--help", ""))
    assert flag is not None
    _passes(_block("sh", f"python bench/load.py {flag.group()} 1\n"))
    _fails(_block("sh", "python bench/load.py --no-such-flag 1\n"), "bench/load.py has no option --no-such-flag")


def test_unknown_commands_fail() -> None:
    _passes(_block("sh", "sudo -E apt-get install -y prometheus\ntimeout 5 spillway version\ncd /tmp && ls | wc -l\n"))
    _fails(_block("sh", "frobnicate --all\n"), "unknown command 'frobnicate'")
    _fails(_block("sh", "sudo frobnicate\n"), "unknown command 'frobnicate'")
    _fails(_block("sh", "spillway slo rules ID|NAME\n"), "unknown command 'NAME'")


def test_spillway_variables_must_be_known() -> None:
    page = (
        "Set `SPILLWAY_DATABASE_URL` and `SPILLWAY_API_KEY`, not `SPILLWAY_DATABASE`.\n"
        "```sh\nexport SPILLWAY_NO_SUCH=1\n```\nThe `SPILLWAY_GATEWAY_*` settings.\n"
    )
    problems = unknown_variables(page, "docs/example.md")
    assert [problem.split(" is neither")[0] for problem in problems] == [
        "docs/example.md:1: SPILLWAY_DATABASE",
        "docs/example.md:3: SPILLWAY_NO_SUCH",
    ]


def test_known_variables_are_read() -> None:
    files = [ROOT / "Makefile", ROOT / ".ci" / "run"]
    for folder in CODE_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            inside = path.relative_to(ROOT / folder).parts
            if path.suffix in (".py", ".sh") and not any(part.startswith(".") for part in inside):  # no venvs
                files += [path] if path.parent != Path(__file__).parent else []
    text = "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in files if path.is_file())
    unread = [name for name in sorted(KNOWN_VARIABLES) if not re.search(rf"\b{name}\b", text)]
    assert unread == [], f"KNOWN_VARIABLES names variables no code reads any more: {unread}"


def test_fences_too_deep_for_blocks_py_are_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        '```text\n      ```sh\n```\n\n=== "Tab"\n\n    !!! note\n\n        ```sh\n        ls\n        ```\n'
    )
    assert unseen_fences(page) == [9, 11]


def test_yaml_needs_a_marker() -> None:
    _fails(_block("yaml", "a: 1\n"), "a yaml block needs a marker")
    _fails(_block("yaml", "a: 1\n", "configuration"), "unknown yaml kind 'configuration'")
    _fails(_block("yaml", "a: [1\n", "yaml"), "not valid YAML")
    _passes(_block("yaml", "a: 1\n---\nb: 2\n", "yaml"))


def test_agent_configs_are_loaded_as_the_agent_does() -> None:
    _passes(_block("yaml", "overflow:\n  max_in_flight: 64\n", "agent-config", "file=agent.yaml"))
    _fails(
        _block("yaml", "overflow:\n  max_in_flight: -1\n", "agent-config"), "not a valid agent config", "max_in_flight"
    )
    _fails(_block("yaml", "prot: 8000\n", "agent-config"), "prot")
    _fails(_block("yaml", "host: 0.0.0.0\n", "agent-config"), "beyond loopback")
    _passes(_block("yaml", "control_plane: http://127.0.0.1:8400\n", "agent-config"))  # its token: from the variable
    _fails(_block("yaml", "control_plane: http://127.0.0.1:8400\nagent_token: [1]\n", "agent-config"), "agent_token")


def test_model_configs_are_parsed_as_the_agent_does() -> None:
    config = 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 500 }\n'
    _passes(_block("pbtxt", config))
    _fails(
        _block("pbtxt", "dynamic_batching { max_queue_delay: 500 }\n"), "not a valid model config", "max_queue_delay"
    )
    _passes(
        _block("yaml", "max_batch_size: 8\ndynamic_batching: {max_queue_delay_microseconds: 500}\n", "model-config")
    )
    _fails(_block("yaml", "max_batch: 8\n", "model-config"), "not a valid model config", "max_batch")


def test_fleets_openslo_and_alertmanager_are_checked() -> None:
    fleet = (ROOT / "examples" / "fleet.yaml").read_text(encoding="utf-8")
    _passes(_block("yaml", fleet, "fleet"))
    _fails(
        _block("yaml", "slos:\n  - {name: x, sli_kind: latency, objective: 140}\n", "fleet"),
        "slos[0]: POST /api/v1/slos",
    )
    _fails(_block("yaml", "widgets: []\n", "fleet"), "'widgets' is not a kind")
    _passes(_block("yaml", (ROOT / "examples" / "openslo.yaml").read_text(encoding="utf-8"), "openslo"))
    _fails(
        _block("yaml", "apiVersion: openslo/v1\nkind: SLO\nmetadata: {name: x}\nspec: {}\n", "openslo"),
        "the OpenSLO importer refuses it",
    )
    _passes(_block("yaml", "route: {receiver: ops}\nreceivers: [{name: ops}]\n", "alertmanager-config"))
    _fails(_block("yaml", "receivers: [{name: ops}]\n", "alertmanager-config"), "needs a `route`")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_prometheus_files_are_checked_with_promtool() -> None:
    rules = "groups:\n  - name: g\n    rules:\n      - record: a:b\n        expr: sum(up)\n"
    _passes(_block("yaml", rules, "prometheus-rules"))
    _fails(_block("yaml", rules.replace("sum(up)", "sum(up"), "prometheus-rules"), "promtool check rules fails")
    _passes(_block("yaml", "rule_files: [/etc/prometheus/x.yml]\nscrape_configs: []\n", "prometheus-config"))
    _fails(_block("yaml", "scrape_configs: [{job_name: a, scrape_interval: soon}]\n", "prometheus-config"), "promtool")


def test_json_is_validated_against_the_request_schema() -> None:
    slo = '{"name": "mlp-latency", "sli_kind": "latency", "threshold_ms": 50, "objective": 99, "window": "28d"}'
    _passes(_block("json", slo, "rest", "POST /api/v1/slos"))
    _passes(_block("json", '{"a": [1, 2]}'))
    _fails(_block("json", '{"a": [1, 2,]}'), "not valid JSON")
    _fails(
        _block("json", slo.replace("99", '"high"'), "rest", "POST /api/v1/slos"),
        "POST /api/v1/slos: $.objective: 'high' is not of type 'number' (the OpenAPI schema)",
        "POST /api/v1/slos: objective: Input should be a valid number",
    )
    _fails(_block("json", slo.replace("99", "140"), "rest", "POST /api/v1/slos"), "less than 100")
    _fails(_block("json", slo, "rest", "POST /api/v1/nothing"), "no operation POST /api/v1/nothing")
    _fails(_block("json", slo, "rest", "GET /api/v1/slos"), "GET /api/v1/slos takes no JSON body")
    _passes(_block("json", '{"objective": 99.5}', "rest", "PATCH /api/v1/slos/mlp-latency"))


def test_python_is_compiled() -> None:
    _passes(_block("python", "import json\nprint(json.dumps({}))\n"))
    _fails(_block("python", "def f(:\n"), "not valid Python")
    _fails(_block("python", "x = 1\n", "rest"), "takes no `check: rest` marker")
