"""Reads and writes of operator-edited resources: optimistic concurrency, unique names, cursors and audit events.

Every change writes an event in the same transaction, so the audit trail and the data never disagree.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel, SecretStr, ValidationError
from sqlalchemy import Insert, Select, Table, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from controlplane.db.models import Base, Event, Resource, utcnow
from controlplane.errors import DuplicateName, NotFound, PreconditionFailed, ValidationFailed
from controlplane.secrets import new_ident

Row = TypeVar("Row", bound=Resource)
MAX_INT_ID = 2**63 - 1


@dataclass(frozen=True)
class Actor:
    """Who made a change and why: written into every event."""

    name: str
    reason: str = ""


@dataclass(frozen=True)
class ResourceKind(Generic[Row]):
    """How one operator-edited resource maps between its schemas and its table."""

    singular: str
    table: type[Row]
    create: type[BaseModel]
    read: Callable[[Row], BaseModel]
    write_only: frozenset[str] = field(default_factory=frozenset)
    check: Callable[[dict[str, Any]], None] | None = None  # rules beyond the schema that need the settings

    @property
    def label(self) -> str:
        """How messages name it: 'SLO', 'rule', 'backend', 'agent'."""
        return "SLO" if self.singular == "slo" else self.singular

    def values(self, body: BaseModel) -> dict[str, Any]:
        """Column values from a validated body; write-only fields the body left out are kept as stored."""
        data = body.model_dump()
        if self.check is not None:
            self.check(data)
        for name in self.write_only:
            if name not in body.model_fields_set:
                data.pop(name, None)
            elif isinstance(data[name], SecretStr):
                data[name] = data[name].get_secret_value()
        return data


# ---- ETags -----------------------------------------------------------------------------------


def etag(row: Any) -> str:
    return f'"{row.id}-{row.version}"'


def check_if_match(if_match: str | None, row: Any) -> None:
    """`If-Match` absent or `*` passes; otherwise one of its tags must be the row's current one."""
    if if_match is None or if_match.strip() == "*":
        return
    tags = {t.strip().removeprefix("W/") for t in if_match.split(",")}
    if etag(row) not in tags:
        raise PreconditionFailed(
            f"{type(row).__name__.lower()} '{row.id}' changed since you read it (now {etag(row)}); "
            "GET it again and reapply your change",
            details={"current_etag": etag(row)},
        )


# ---- cursors ---------------------------------------------------------------------------------


def encode_cursor(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, kind: type) -> Any:
    try:
        value = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        value = None
    if not isinstance(value, kind) or (isinstance(value, str) and "\x00" in value):
        raise ValidationFailed.field("cursor", "not a cursor this API returned; start again without it")
    return value


# ---- events ----------------------------------------------------------------------------------


def record_event(
    session: Session,
    *,
    kind: str,
    actor: Actor,
    subject_type: str,
    subject_id: str | None = None,
    agent_id: str | None = None,
    rule_id: str | None = None,
    data: dict[str, Any] | None = None,
) -> Event:
    event = Event(
        kind=kind,
        actor=actor.name,
        subject_type=subject_type,
        subject_id=subject_id,
        agent_id=agent_id,
        rule_id=rule_id,
        reason=actor.reason,
        data=data or {},
        ts=utcnow(),
    )
    session.add(event)
    return event


def event_values(
    *,
    kind: str,
    actor: Actor,
    subject_type: str,
    subject_id: str | None = None,
    agent_id: str | None = None,
    rule_id: str | None = None,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The row `record_event` would write, stamped now, for `insert_events` (many events at once)."""
    return {"kind": kind, "actor": actor.name, "subject_type": subject_type, "subject_id": subject_id,
            "agent_id": agent_id, "rule_id": rule_id, "reason": actor.reason, "data": data or {},
            "ts": utcnow()}  # fmt: skip


def insert_events(session: Session, rows: list[dict[str, Any]]) -> None:
    """Write `event_values` rows in one statement (executemany), in list order: ids grow in that order, as they
    would have with one `record_event` after another."""
    if rows:
        session.execute(insert(cast(Table, Event.__table__)), rows)


def upsert(session: Session, table: Table, keys: Sequence[str], where: Callable[[Any], Any] | None = None) -> Insert:
    """`INSERT ... ON CONFLICT (keys) DO UPDATE SET <every other column> = excluded.<column> [WHERE ...]` in the
    session's dialect (SQLite and PostgreSQL spell it alike, but each has its own construct). `where`, given the
    `excluded` columns, limits which stored rows the update may change (a conflicting row it refuses stays as it
    is and returns nothing to a `RETURNING`)."""
    dialect = session.get_bind().dialect.name
    stmt: Any = postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
    columns = {c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys}
    guard = None if where is None else where(stmt.excluded)
    return stmt.on_conflict_do_update(index_elements=list(keys), set_=columns, where=guard)


def _event_links(kind: ResourceKind[Any], row: Any) -> dict[str, str]:
    if kind.singular == "agent":
        return {"agent_id": row.id}
    if kind.singular == "rule":
        return {"rule_id": row.id}
    return {}


def _changes(kind: ResourceKind[Any], before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    changed = {}
    for key, new in after.items():
        old = before.get(key)
        if old != new:
            hidden = key in kind.write_only
            changed[key] = {"from": "(secret)" if hidden else old, "to": "(secret)" if hidden else new}
    return changed


# ---- versioned resources ---------------------------------------------------------------------


def get_row(session: Session, kind: ResourceKind[Row], ident: str) -> Row:
    row = session.get(kind.table, ident)
    if row is None:
        raise NotFound(f"no {kind.label} with id '{ident}'")
    return row


def page(
    session: Session, query: Select[Any], *, key: Any, cursor: str | None, limit: int, descending: bool = False
) -> tuple[Sequence[Any], str | None]:
    """One page of `query` ordered by the unique column `key`; the cursor is the last key of the previous page."""
    if cursor is not None:
        after = decode_cursor(cursor, int if descending else str)
        if descending and (isinstance(after, bool) or not 0 < after <= MAX_INT_ID):
            raise ValidationFailed.field("cursor", "not a cursor this API returned; start again without it")
        query = query.where(key < after if descending else key > after)
    rows = session.scalars(query.order_by(key.desc() if descending else key).limit(limit + 1)).all()
    if len(rows) <= limit:
        return rows, None
    return rows[:limit], encode_cursor(getattr(rows[limit - 1], key.key))


def list_rows(
    session: Session, kind: ResourceKind[Row], *, cursor: str | None, limit: int
) -> tuple[Sequence[Row], str | None]:
    """A page of a resource, alphabetical by name."""
    return page(session, select(kind.table), key=kind.table.name, cursor=cursor, limit=limit)


def _ensure_unique_name(session: Session, kind: ResourceKind[Any], name: str, ident: str | None) -> None:
    clash = session.scalar(select(kind.table.id).where(kind.table.name == name))
    if clash is not None and clash != ident:
        raise DuplicateName(
            f"{kind.label} named '{name}' already exists",
            details=[{"field": "name", "message": f"'{name}' is taken by {kind.label} '{clash}'"}],
        )


def flush(session: Session, label: str, name: str | None = None) -> None:
    """Write pending changes; a lost race becomes the answer the caller would have got a moment later."""
    try:
        session.flush()
    except IntegrityError as exc:  # a concurrent create or rename won the race for the name
        session.rollback()
        raise DuplicateName(
            f"{label} named '{name}' already exists", details=[{"field": "name", "message": "taken"}]
        ) from exc
    except StaleDataError as exc:  # a concurrent writer changed the row between our read and our write
        session.rollback()
        raise PreconditionFailed(f"this {label} changed while you wrote it; GET it again and retry") from exc


def create_row(
    session: Session, kind: ResourceKind[Row], body: BaseModel, actor: Actor, ident: str | None = None, **extra: Any
) -> Row:
    values = kind.values(body)
    _ensure_unique_name(session, kind, values["name"], None)
    row = kind.table(id=ident or new_ident(), version=1, **values, **extra)
    session.add(row)
    flush(session, kind.label, values["name"])
    shown = kind.read(row).model_dump(mode="json", by_alias=True)
    record_event(
        session, kind=f"{kind.singular}.created", actor=actor, subject_type=kind.singular, subject_id=row.id,
        data={"name": values["name"], "spec": shown}, **_event_links(kind, row),
    )  # fmt: skip
    return row


def replace_row(
    session: Session, kind: ResourceKind[Row], ident: str, body: BaseModel, if_match: str | None, actor: Actor
) -> Row:
    row = get_row(session, kind, ident)
    check_if_match(if_match, row)
    values = kind.values(body)
    _ensure_unique_name(session, kind, values["name"], ident)
    before = {key: getattr(row, key) for key in values}
    for key, value in values.items():
        setattr(row, key, value)
    row.updated_at = utcnow()
    flush(session, kind.label, values["name"])
    record_event(
        session, kind=f"{kind.singular}.updated", actor=actor, subject_type=kind.singular, subject_id=row.id,
        data={"name": values["name"], "changes": _changes(kind, before, values)}, **_event_links(kind, row),
    )  # fmt: skip
    return row


def patch_row(
    session: Session, kind: ResourceKind[Row], ident: str, patch: BaseModel, if_match: str | None, actor: Actor
) -> Row:
    """Apply the fields the patch sets on top of the stored resource, then validate the whole as a create."""
    row = get_row(session, kind, ident)
    check_if_match(if_match, row)
    current = kind.read(row).model_dump(include=set(kind.create.model_fields), by_alias=True)
    changes = patch.model_dump(exclude_unset=True, by_alias=True)
    for name in kind.write_only:
        if name in changes and isinstance(changes[name], SecretStr):
            changes[name] = changes[name].get_secret_value()
    body = _validate_as(kind.create, {**current, **changes})
    return replace_row(session, kind, ident, body, None, actor)


def _validate_as(model: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    """Named as the request's own validation names them: `body.<field>`, and the first one in the message."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ValidationFailed.of(
            exc.errors(), lead="the resource would be invalid after this change: ", under=("body",)
        ) from exc


def delete_row(session: Session, kind: ResourceKind[Row], ident: str, if_match: str | None, actor: Actor) -> None:
    row = get_row(session, kind, ident)
    check_if_match(if_match, row)
    name = row.name
    session.delete(row)
    flush(session, kind.label, name)
    record_event(
        session, kind=f"{kind.singular}.deleted", actor=actor, subject_type=kind.singular, subject_id=ident,
        data={"name": name}, **_event_links(kind, row),
    )  # fmt: skip
    session.flush()


def count(session: Session, table: type[Base], *where: Any) -> int:
    return int(session.scalar(select(func.count()).select_from(table).where(*where)) or 0)
