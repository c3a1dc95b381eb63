"""Types every resource shares: names, durations, label selectors, pages, and partial (PATCH) models."""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Annotated, Any, Generic, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StringConstraints,
    WithJsonSchema,
    create_model,
    model_validator,
)

Name = Annotated[
    str,
    StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$"),
    Field(description="Unique name: letters, digits, '.', '_' and '-', starting with a letter or digit."),
]

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$")


def parse_duration(value: Any) -> Any:
    """'28d', '90s', '1.5h' or a number of seconds -> whole seconds; anything else is left to fail."""
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise ValueError(f"'{value}' is not a duration: use a number of seconds or e.g. '30s', '5m', '1h', '28d'")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
        if seconds != int(seconds):
            raise ValueError(f"'{value}' is not a whole number of seconds")
        return int(seconds)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def format_duration(seconds: int) -> str:
    for unit in ("d", "h", "m"):
        size = int(_UNITS[unit])
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


_DURATION_SCHEMA = {
    "anyOf": [
        {"type": "integer", "minimum": 0, "description": "seconds"},
        {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d|w)\s*$", "examples": ["30s", "5m", "28d"]},
    ]
}

Duration = Annotated[
    int,
    BeforeValidator(parse_duration),
    Field(ge=0, le=10 * 365 * 86400),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
    WithJsonSchema(_DURATION_SCHEMA, mode="validation"),
    WithJsonSchema({"type": "string", "examples": ["28d"]}, mode="serialization"),
]
"""Seconds in Python and the database, '28d'-style strings on the wire."""

PositiveDuration = Annotated[Duration, Field(gt=0)]

_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.\-/]{0,61}[A-Za-z0-9])?$")


def parse_labels(value: Any) -> Any:
    """`"region=eu,class=jetson"` or a mapping -> a checked dict of label key -> value."""
    if isinstance(value, str):
        pairs: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            key, sep, val = part.partition("=")
            if not sep:
                raise ValueError(f"'{part}' is not a key=value label; write labels as 'key=value,key2=value2'")
            pairs[key.strip()] = val.strip()
        value = pairs
    if not isinstance(value, dict):
        raise ValueError("labels must be 'key=value,...' or an object of string keys and values")
    for key, val in value.items():
        if not isinstance(key, str) or not _LABEL.match(key):
            raise ValueError(f"label key '{key}' must be 1-63 letters, digits, '-', '_', '.', '/'")
        if not isinstance(val, str) or (val and not _LABEL.match(val)):
            raise ValueError(
                f"label value '{val}' of '{key}' must be a string of up to 63 letters, digits, '-', '_', '.'"
            )
    return value


Labels = Annotated[
    dict[str, str],
    BeforeValidator(parse_labels),
    Field(max_length=64, description="key=value labels, as an object or as 'key=value,key2=value2'."),
    # The schema says both forms the validator takes (pydantic's would say the object only), at most 64 labels.
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "object", "additionalProperties": {"type": "string"}, "maxProperties": 64},
                {"type": "string"},
            ],
            "description": "key=value labels, as an object or as 'key=value,key2=value2' (at most 64).",
        }
    ),
]


def _storable(value: Any, path: str = "") -> None:
    """Refuse what a database cannot store faithfully: NUL characters (PostgreSQL text) and NaN/Infinity (JSON)."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{path or 'value'}: NUL characters are not allowed")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path or 'value'}: NaN and Infinity are not allowed")
    elif isinstance(value, dict):
        for key, item in value.items():
            _storable(key, path)
            _storable(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _storable(item, f"{path}.{i}" if path else str(i))


class Strict(BaseModel):
    """Request bodies refuse fields they do not know (a typo is an error, not a silent no-op) and values that
    no database stores faithfully."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unstorable(cls, data: Any) -> Any:
        _storable(data)
        return data


class AgentSelector(Strict):
    """Which agents something applies to: those with all of these labels (no labels: every agent)."""

    labels: Labels = Field(default_factory=dict)

    def selects(self, agent_labels: dict[str, str]) -> bool:
        return all(agent_labels.get(k) == v for k, v in self.labels.items())


class Selector(AgentSelector):
    """Which agents (all of these labels) and which model (any when absent) something applies to."""

    model: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None

    def matches(self, agent_labels: dict[str, str], model: str | None = None) -> bool:
        if not self.selects(agent_labels):
            return False
        return self.model is None or model is None or self.model == model


class Stored(BaseModel):
    """Fields the server owns on every versioned resource."""

    model_config = ConfigDict(from_attributes=True, populate_by_name=True)

    id: str
    version: int
    created_at: datetime
    updated_at: datetime


T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    """One page of a list, newest or alphabetical first; pass `next_cursor` back as `cursor` for the next."""

    items: list[T]
    next_cursor: str | None = None


def partial(model: type[BaseModel]) -> type[BaseModel]:
    """The PATCH twin of a create schema: same fields and constraints, every one optional.

    A field's constraints and validators stay on its type, inside the `| None`: put on the optional field they
    would apply to a null as well (`"window": null` raised a TypeError in a `ge` check, a 500). A null passes
    here and is judged with the rest of the merged resource, which is validated as a create.
    """
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        copy = info._copy()  # keeps alias, description, discriminator
        constraints, copy.metadata = copy.metadata, []
        copy.default = None
        copy.default_factory = None
        annotation: Any = info.annotation
        for constraint in constraints:  # Annotated[Annotated[T, a], b] is Annotated[T, a, b]
            annotation = Annotated[annotation, constraint]
        fields[name] = (annotation | None, copy)
    patch: type[BaseModel] = create_model(
        f"{model.__name__.removesuffix('Create')}Patch", __config__=model.model_config, **fields
    )
    return patch


class ErrorBody(BaseModel):
    """Every error: a stable machine code, a human message, and details (e.g. the fields at fault)."""

    error: str
    message: str
    details: Any = None


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in (
        (400, "malformed request, e.g. a body that is not UTF-8 JSON"),
        (401, "missing, invalid or revoked credentials"),
        (403, "valid credentials without the needed role"),
        (404, "no such resource"),
        (409, "conflicts with the current state"),
        (412, "If-Match does not match the current version"),
        (413, "body over the size limit"),
        (422, "invalid input: details name each field"),
    )
}
"""Documented on every API route, so clients (and schemathesis) know the shape of each error."""
