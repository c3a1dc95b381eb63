"""The agent config's errors as a person reads them: one plain line per problem naming the file, the line (and the
column, for YAML syntax), the key as YAML nests it and the fix; never pydantic's wording, a URL or a traceback.

    AgentConfigError(ValueError)    raised by AgentConfig.load; `lines`, one problem each
      <- read_settings(path)        the file cannot be read, is not YAML, or sets a key twice
      <- describe_validation(...)   pydantic refused values: `agent.yaml:2: port: must be at most 65535 (got 70000)`

Settings given on the command line are named by their option (`--port`); unknown keys get the closest known key of
their level. Secrets (tokens, OTLP headers) are never echoed back.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

MAX_PROBLEMS = 5  # lines about single problems; the rest is counted
_NAMES_ITS_KEY = ("extra_forbidden", "invalid_key")  # errors whose message names the key itself


class AgentConfigError(ValueError):
    """The agent's settings are refused; `lines` say why, one problem each, ready to print after `error: `."""

    def __init__(self, lines: Iterable[str]) -> None:
        self.lines = tuple(lines)
        super().__init__("\n".join(self.lines))


@dataclass(frozen=True)
class SettingsSource:
    """Where the settings came from: the config file (its name as given and its YAML nodes, for line numbers) and
    the command line (`options`: the keys it can set; `given`: those it did set, which win over the file)."""

    name: str | None = None
    document: yaml.Node | None = None
    options: frozenset[str] = field(default_factory=frozenset)
    given: frozenset[str] = field(default_factory=frozenset)


def read_settings(path: Path) -> tuple[dict[str, Any], yaml.Node | None]:
    """The settings a YAML file holds and its node tree; AgentConfigError when it cannot be read or parsed, is not
    a mapping, or sets one key twice (YAML would keep the last silently)."""
    name = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise AgentConfigError([f"{name}: no such file"]) from None
    except IsADirectoryError:
        raise AgentConfigError([f"{name}: is a folder (give the config file)"]) from None
    except PermissionError:
        raise AgentConfigError([f"{name}: permission denied (make the file readable by this user)"]) from None
    except OSError as exc:
        raise AgentConfigError([f"{name}: cannot be read: {exc.strerror or exc}"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise AgentConfigError([f"{name}:{line}: not UTF-8 text (save the file as UTF-8)"]) from None
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)  # checks the characters first
        document = loader.get_single_node()
        data = loader.construct_document(document) if document is not None else None
    except yaml.MarkedYAMLError as exc:
        raise AgentConfigError([_yaml_syntax(name, text, exc)]) from None
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        raise AgentConfigError(
            [f"{name}:{line}: character #x{exc.character:04x} is not allowed in YAML (remove it)"]
        ) from None
    except yaml.YAMLError as exc:  # not raised by the safe loader today; a plain line all the same
        raise AgentConfigError([f"{name}: {exc}"]) from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        return {}, None
    if not isinstance(data, dict):
        line = document.start_mark.line + 1 if document is not None else 1
        raise AgentConfigError([f"{name}:{line}: expected a mapping of settings (`key: value` lines), not "
                                f"{_kind(data)}"])  # fmt: skip
    twice = list(_keys_set_twice(document, ()))
    if twice:
        raise AgentConfigError(
            [f"{name}:{second}: {_path(path_)} is set twice (also on line {first}; remove one)"
             for path_, first, second in twice]
        )  # fmt: skip
    return data, document


def describe_validation(exc: ValidationError, model: type[BaseModel], source: SettingsSource) -> AgentConfigError:
    """pydantic's errors about `model`'s settings as plain lines, in the file's order, at most MAX_PROBLEMS."""
    problems = _drop_other_union_members([_Problem.of(error, model) for error in exc.errors()])
    located = [(_where(problem, model, source), problem) for problem in problems]
    located.sort(key=lambda item: item[0][1] if item[0][1] is not None else 1 << 30)
    lines = []
    for (where, _line, named_by_option), problem in located[:MAX_PROBLEMS]:
        names_its_key = named_by_option or not problem.path or problem.type in _NAMES_ITS_KEY
        key = "" if names_its_key else f"{_path(problem.path)}: "
        lines.append(f"{where}: {key}{problem.message(source)}" if where else f"{key}{problem.message(source)}")
    if len(located) > MAX_PROBLEMS:
        lines.append(f"and {len(located) - MAX_PROBLEMS} more problems")
    return AgentConfigError(lines)


def plain_message(error: Mapping[str, Any], model: type[BaseModel]) -> str:
    """One pydantic error about `model` in plain words (no "Input should", "Value error, " or URL), for settings
    read from elsewhere than a file (the control plane's environment)."""
    return _Problem.of(error, model).message(SettingsSource())


# ---- YAML syntax ----


def _yaml_syntax(name: str, text: str, exc: yaml.MarkedYAMLError) -> str:
    """`agent.yaml:3:7: <what> (<fix>)` from PyYAML's problem and its marks (0-based; ours are 1-based)."""
    problem = exc.problem or exc.context or "not valid YAML"
    context = exc.context or ""
    mark = exc.problem_mark or exc.context_mark
    fix = ""
    if problem == "mapping values are not allowed here" and mark is not None:
        line = text.splitlines()[mark.line] if mark.line < len(text.splitlines()) else ""
        if ": " in line[: mark.column]:
            fix = "a value that contains ': ' needs quotes"
        else:
            fix = "check the indentation: this line is indented more than the key above it"
    elif problem.startswith(("expected <block end>", "expected '<document start>'", "did not find expected key")):
        problem = "this line does not line up with the keys above it"
        fix = "the keys of one mapping, and the `- ` items of one list, start in the same column"
    elif problem == "could not find expected ':'" and exc.context_mark is not None:
        mark = exc.context_mark  # the key without a colon, not the line after it
        problem = "a setting without ':'"
        fix = "write `key: value`, with a space after the colon"
    elif problem.startswith("found character '\\t'"):
        problem = "a tab"
        fix = "YAML indents with spaces, never tabs"
    elif problem.startswith("found character") and "cannot start any token" in problem:
        fix = "put the value in quotes"
    elif problem == "found unexpected end of stream" and "quoted scalar" in context and exc.context_mark:
        mark = exc.context_mark
        problem = "a quote that is never closed"
        fix = "close it on the same line"
    elif context.startswith("while parsing a flow") and exc.context_mark is not None:
        bracket = "[" if "sequence" in context else "{"
        fix = f"close the `{bracket}` opened on line {exc.context_mark.line + 1}, or separate its items with ', '"
    elif context == "expected a single document in the stream":
        problem = "a second YAML document"
        fix = "one agent config per file: remove the `---` and what follows"
    elif problem.startswith("found undefined alias"):
        fix = "define the anchor (&name) before its alias (*name), or quote a value that starts with '*'"
    elif problem.startswith("could not determine a constructor for the tag"):
        fix = "remove the tag: settings are plain YAML"
    elif context and exc.problem:
        problem = f"{problem} ({context})"
    place = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
    return f"{place}: {problem} ({fix})" if fix else f"{place}: {problem}"


def _keys_set_twice(
    node: yaml.Node | None, path: tuple[str | int, ...]
) -> Iterable[tuple[tuple[str | int, ...], int, int]]:
    """(key path, first line, second line) of every key a mapping sets twice, at any depth."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in seen:
                    yield (*path, key.value), seen[key.value], key.start_mark.line + 1
                seen.setdefault(key.value, key.start_mark.line + 1)
            yield from _keys_set_twice(value, (*path, key.value if isinstance(key, yaml.ScalarNode) else "?"))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            yield from _keys_set_twice(item, (*path, index))


# ---- pydantic's errors ----

_MAPPING_HINT = "write indented `key: value` lines under the key"
# What a value of each kind must be, by pydantic's error type.
_MUST_BE = {
    "int_type": "a whole number", "int_parsing": "a whole number", "int_from_float": "a whole number",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "string_type": "a string", "bytes_type": "a string",
    "list_type": "a list", "tuple_type": "a list", "set_type": "a list",
    "dict_type": "a mapping", "mapping_type": "a mapping",
    "model_type": "a mapping of settings", "model_attributes_type": "a mapping of settings",
    "path_type": "a path", "none_required": "null",
}  # fmt: skip
_BOUNDS = {"less_than_equal": ("le", "at most"), "less_than": ("lt", "less than"),
           "greater_than_equal": ("ge", "at least"), "greater_than": ("gt", "more than")}  # fmt: skip
_SECRET_KEY = re.compile(r"(^|_)(token|headers|secret|password|api_key)$", re.IGNORECASE)


@dataclass(frozen=True)
class _Problem:
    """One pydantic error, its location turned into the keys YAML nests (a union's member names left out)."""

    error: Mapping[str, Any]
    path: tuple[str | int, ...]
    annotation: Any  # the type the value had to be (None: not known)
    owner: type[BaseModel] | None  # the model whose key is the path's last
    union_at: int | None  # len(path) where pydantic named the union member it tried
    secret: bool

    @classmethod
    def of(cls, error: Mapping[str, Any], model: type[BaseModel]) -> _Problem:
        annotation: Any = model
        owner: type[BaseModel] | None = None
        path: list[str | int] = []
        union_at: int | None = None
        secret = False
        for item in error["loc"]:
            annotation = _unwrap_optional(annotation)
            origin = typing.get_origin(annotation)
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                owner = annotation
                known = annotation.model_fields.get(str(item))
                annotation = known.annotation if known is not None else None
                path.append(item)
            elif origin in (typing.Union, types.UnionType):
                union_at = len(path)
                members = typing.get_args(annotation)
                annotation = next((m for m in members if getattr(m, "__name__", None) == item), None)
            elif origin is dict or origin is Mapping:
                if item == "[key]":
                    continue
                annotation = typing.get_args(annotation)[1] if typing.get_args(annotation) else None
                path.append(item)
            elif origin in (list, tuple, set, frozenset) or origin is Sequence:
                annotation = typing.get_args(annotation)[0] if typing.get_args(annotation) else None
                path.append(item)
            else:
                annotation = None
                path.append(item)
            secret = secret or _is_secret(annotation) or bool(_SECRET_KEY.search(str(item)))
        return cls(error, tuple(path), annotation, owner, union_at, secret)

    @property
    def type(self) -> str:
        return str(self.error["type"])

    def message(self, source: SettingsSource) -> str:
        """What is wrong and the fix, in words; the value given only when it is not a secret."""
        error, kind = self.error, self.type
        ctx = error.get("ctx") or {}
        got = "" if self.secret else f" (got {_shown(error.get('input'))})"
        if kind == "extra_forbidden":
            return _unknown_key(self.path, self.owner)
        if kind == "invalid_key":
            return f"`{_shown(error.get('input'))}` is not a setting's name (names are text)"
        if kind == "missing":
            key = self.path[-1] if self.path else "?"
            if len(self.path) == 1 and key in source.options:
                return f"required (add `{key}: ...` to the config file, or pass --{str(key).replace('_', '-')})"
            return f"required (add `{key}: ...`)" if source.name is not None or source.options else "required"
        if kind in ("value_error", "assertion_error") and "error" in ctx:
            return str(ctx["error"])
        if kind in _BOUNDS:
            name, words = _BOUNDS[kind]
            return f"must be {words} {_number(ctx.get(name))}{got}"
        if kind == "literal_error":
            return f"must be {ctx.get('expected', 'one of the allowed values')}{got}{self._closest_choice()}"
        if kind in ("too_short", "too_long", "string_too_short", "string_too_long"):
            return _length(kind, ctx)
        if kind == "list_type" and not isinstance(error.get("input"), (list, dict)):
            return f"must be a list{got}: write [value], or `- value` lines"
        if kind == "string_type" and isinstance(error.get("input"), (int, float, bool)):
            return f"must be a string{got}: put it in quotes"
        if kind in _MUST_BE:
            hint = (
                f": {_MAPPING_HINT}" if "mapping" in _MUST_BE[kind] and not isinstance(error.get("input"), dict) else ""
            )
            return f"must be {_MUST_BE[kind]}{got}{hint}"
        text = str(error.get("msg", "not valid"))
        text = re.sub(r"^Value error, |^Assertion failed, ", "", text).replace("Input should be", "must be")
        return text[:1].lower() + text[1:] + got

    def _closest_choice(self) -> str:
        given = self.error.get("input")
        choices = [str(c) for c in typing.get_args(_unwrap_optional(self.annotation))]
        if not isinstance(given, str) or not choices:
            return ""
        close = difflib.get_close_matches(given, choices, n=1)
        return f"; did you mean `{close[0]}`?" if close else ""


def _drop_other_union_members(problems: list[_Problem]) -> list[_Problem]:
    """A value a union refused gets an error per member (`str`, then `OtlpEndpoint`): keep the member errors about
    the value's insides when there are any (the member it was meant for), else merge "must be a string or ..."."""
    by_value: dict[tuple[str | int, ...], list[_Problem]] = {}
    for problem in problems:
        if problem.union_at is not None:
            by_value.setdefault(problem.path[: problem.union_at], []).append(problem)
    kept: list[_Problem] = []
    merged: set[tuple[str | int, ...]] = set()
    for problem in problems:
        if problem.union_at is None:
            kept.append(problem)
            continue
        at = problem.path[: problem.union_at]
        siblings = by_value[at]
        whole_value = [p for p in siblings if len(p.path) == p.union_at and p.type in _MUST_BE]
        if len(whole_value) < len(siblings):  # some member looked inside: those errors are the useful ones
            if problem not in whole_value:
                kept.append(problem)
        elif at not in merged:
            merged.add(at)
            kinds = dict.fromkeys(_MUST_BE[p.type] for p in whole_value)
            expected = {
                "type": "union_type",
                "msg": f"must be {' or '.join(kinds)}",
                "input": problem.error.get("input"),
            }
            kept.append(_Problem(expected, at, None, problem.owner, None, problem.secret))
    return kept


def _where(problem: _Problem, model: type[BaseModel], source: SettingsSource) -> tuple[str, int | None, bool]:
    """(what names the problem's place: `agent.yaml:2`, `--port` or the file alone; its line; whether an option)."""
    path = problem.path
    if problem.type in ("value_error", "assertion_error"):  # a model's validator: place it at a key it names
        path = path + _mentioned_key(problem, model, source)
    if path and isinstance(path[0], str) and path[0] in source.given:
        return f"--{path[0].replace('_', '-')}", None, len(path) == 1
    line = _line_of(source.document, path) if source.document is not None else None
    if source.name is None:
        return "", None, False
    return (f"{source.name}:{line}" if line is not None else source.name), line, False


def _mentioned_key(problem: _Problem, model: type[BaseModel], source: SettingsSource) -> tuple[str, ...]:
    """The first of the refusing model's keys that its message names and the file or the command line sets."""
    validated = problem.annotation if problem.path else model
    if not (isinstance(validated, type) and issubclass(validated, BaseModel)):
        return ()
    text = str(problem.message(source))
    named = sorted((m.start(), key) for key in validated.model_fields
                   for m in [re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", text)] if m)  # fmt: skip
    for _, key in named:
        if not problem.path and key in source.given:
            return (key,)
        if _line_of(source.document, (*problem.path, key), exact=True) is not None:
            return (key,)
    return ()


def _line_of(document: yaml.Node | None, path: Sequence[str | int], *, exact: bool = False) -> int | None:
    """The 1-based line of the key at `path` (a list item: the item's); without it, that of its deepest parent that
    the file has (none for a top-level key the file lacks, or with `exact`)."""
    node, line = document, None
    for item in path:
        found: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == str(item):
                    found, line = value, key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(item, int) and 0 <= item < len(node.value):
            found = node.value[item]
            line = found.start_mark.line + 1
        if found is None:
            return None if exact else line
        node = found
    return line


def _unknown_key(path: Sequence[str | int], owner: type[BaseModel] | None) -> str:
    """`unknown setting `overflow.gatway` (did you mean `gateway`?)`: the closest key of the same mapping."""
    known = list(owner.model_fields) if owner is not None else []
    key = str(path[-1]) if path else "?"
    close = difflib.get_close_matches(key.replace("-", "_").lower(), known, n=1, cutoff=0.6)
    if close:
        return f"unknown setting `{_path(path)}` (did you mean `{close[0]}`?)"
    if known and len(known) <= 12:
        return f"unknown setting `{_path(path)}` (the settings here: {', '.join(known)})"
    return f"unknown setting `{_path(path)}` (remove it)"


def _length(kind: str, ctx: Mapping[str, Any]) -> str:
    if kind == "too_short":
        n = ctx.get("min_length")
        return f"needs at least {n} item{'s' if n != 1 else ''}"
    if kind == "too_long":
        return f"takes at most {ctx.get('max_length')} items"
    if kind == "string_too_short":
        n = ctx.get("min_length")
        return "must not be empty" if n == 1 else f"must be at least {n} characters"
    return f"must be at most {ctx.get('max_length')} characters"


def _unwrap_optional(annotation: Any) -> Any:
    """`X | None` as X (pydantic names no member for it); other unions as they are."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(annotation) if m is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _is_secret(annotation: Any) -> bool:
    annotation = _unwrap_optional(annotation)
    return isinstance(annotation, type) and issubclass(annotation, SecretStr)


def _path(path: Sequence[str | int]) -> str:
    """`overflow.breaker.open_s`, `otlp_endpoints[1].protocol`."""
    text = ""
    for item in path:
        text += f"[{item}]" if isinstance(item, int) else (f".{item}" if text else str(item))
    return text


def _shown(value: Any) -> str:
    """A value as YAML would spell it, short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return _kind(value)
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return _shown(value)


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
