"""The audit and degradation timeline: read-only, filtered, newest first, cursor-paginated."""

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from sqlalchemy import select

from controlplane.api.deps import SessionDep, Viewer
from controlplane.api.resources import Cursor, Limit
from controlplane.db import repository as repo
from controlplane.db.models import Event
from controlplane.errors import NotFound, ValidationFailed
from controlplane.rules.loop import LEGACY_DRY_RUN_KINDS
from controlplane.schemas.access import EventRead
from controlplane.schemas.common import Page

router = APIRouter(prefix="/api/v1/events", tags=["events"])
_RENAMED = {new: old for old, new in LEGACY_DRY_RUN_KINDS.items()}
_KIND = ("event kind; 'slo.*' matches a prefix. The dry-run kinds' old names ('rule.would_fired', ...) select their "
         "new ones ('rule.would_fire', ...) until the next release")  # fmt: skip


@router.get("", response_model=Page[EventRead], summary="List events, newest first")
def list_events(
    session: SessionDep,
    _: Viewer,
    agent: Annotated[str | None, Query(max_length=64, description="agent id")] = None,
    rule: Annotated[str | None, Query(max_length=64, description="rule id")] = None,
    kind: Annotated[str | None, Query(max_length=64, description=_KIND)] = None,
    since: Annotated[datetime | None, Query(description="inclusive, ISO 8601 with a zone")] = None,
    until: Annotated[datetime | None, Query(description="exclusive, ISO 8601 with a zone")] = None,
    cursor: Cursor = None,
    limit: Limit = 100,
) -> Any:
    query = select(Event)
    if agent is not None:
        query = query.where(Event.agent_id == agent)
    if rule is not None:
        query = query.where(Event.rule_id == rule)
    if kind is not None and kind.endswith("*"):
        query = query.where(Event.kind.startswith(kind[:-1], autoescape=True))
    elif kind is not None:
        # An old dry-run kind means its new name; either also selects events a replica not yet upgraded wrote.
        new = LEGACY_DRY_RUN_KINDS.get(kind, kind)
        query = query.where(Event.kind.in_([new, _RENAMED[new]]) if new in _RENAMED else Event.kind == new)
    for name, bound in (("since", since), ("until", until)):
        if bound is not None and bound.tzinfo is None:
            raise ValidationFailed.field(name, "needs a time zone, e.g. 2026-11-30T08:00:00Z")
        if bound is not None and not 1970 <= bound.year <= 9000:
            raise ValidationFailed.field(name, "must be between the years 1970 and 9000")
    if since is not None:
        query = query.where(Event.ts >= since)
    if until is not None:
        query = query.where(Event.ts < until)
    rows, next_cursor = repo.page(session, query, key=Event.id, cursor=cursor, limit=limit, descending=True)
    return {"items": rows, "next_cursor": next_cursor}


@router.get("/{event_id}", response_model=EventRead, summary="Read one event")
def get_event(event_id: Annotated[int, Path(ge=1, le=repo.MAX_INT_ID)], session: SessionDep, _: Viewer) -> Any:
    row = session.get(Event, event_id)
    if row is None:
        raise NotFound(f"no event with id {event_id}")
    return row
