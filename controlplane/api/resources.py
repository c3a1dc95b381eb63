"""CRUD routes for the operator-edited resources (SLOs, rules, backends, agents), one factory for all.

No `from __future__ import annotations` here: FastAPI reads the body types from the closures' annotations.
"""

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response, status
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from controlplane.api.auth import Principal
from controlplane.api.deps import IfMatch, Reason, SessionDep, actor_of
from controlplane.api.methods import literal_paths
from controlplane.db import repository as repo
from controlplane.schemas.common import Page

Cursor = Annotated[str | None, Query(max_length=512, description="next_cursor from the previous page")]
Limit = Annotated[int, Query(ge=1, le=500, description="page size")]


def not_a_literal_path(request: Request) -> None:
    """An item route reached at another route's literal path (`DELETE /api/v1/slos/import`, which the router hands
    to `/slos/{item_id}`): 405, listing the methods that path has, never a lookup of an SLO called "import"."""
    if "item_id" not in request.path_params:
        return
    literal = getattr(request.app.state, "literal_paths", None)
    if literal is None:
        literal = request.app.state.literal_paths = literal_paths(request.app)
    if request.scope["path"] in literal:
        raise StarletteHTTPException(status.HTTP_405_METHOD_NOT_ALLOWED)


def resource_router(
    kind: repo.ResourceKind[Any],
    *,
    plural: str,
    read_model: type[BaseModel],
    patch_model: type[BaseModel],
    reader: Any,
    writer: Any,
    with_create: bool = True,
    on_change: Callable[[], None] | None = None,
) -> APIRouter:
    """GET list, POST, GET one, PUT, PATCH and DELETE for `kind`, with ETags and audit events; `on_change` is
    called after each committed change (the gateway reloads its backends before its next request)."""
    router = APIRouter(prefix=f"/api/v1/{plural}", tags=[plural], dependencies=[Depends(not_a_literal_path)])
    create_model = kind.create
    singular = kind.singular

    def changed() -> None:
        if on_change is not None:
            on_change()

    def _send(row: Any, response: Response) -> BaseModel:
        response.headers["ETag"] = repo.etag(row)
        return kind.read(row)

    @router.get("", response_model=Page[read_model], summary=f"List {plural}")  # type: ignore[valid-type]
    def list_items(
        session: SessionDep, _: Annotated[Principal, Depends(reader)], cursor: Cursor = None, limit: Limit = 100
    ) -> Any:
        rows, next_cursor = repo.list_rows(session, kind, cursor=cursor, limit=limit)
        return {"items": [kind.read(r) for r in rows], "next_cursor": next_cursor}

    if with_create:

        @router.post("", response_model=read_model, status_code=status.HTTP_201_CREATED, summary=f"Create a {singular}")
        def create_item(
            body: create_model,  # type: ignore[valid-type]
            session: SessionDep,
            who: Annotated[Principal, Depends(writer)],
            response: Response,
            reason: Reason = None,
        ) -> Any:
            row = repo.create_row(session, kind, body, actor_of(who, reason))
            session.commit()
            changed()
            response.headers["Location"] = f"/api/v1/{plural}/{row.id}"
            return _send(row, response)

    @router.get("/{item_id}", response_model=read_model, summary=f"Read a {singular}")
    def get_item(
        item_id: str, session: SessionDep, _: Annotated[Principal, Depends(reader)], response: Response
    ) -> Any:
        return _send(repo.get_row(session, kind, item_id), response)

    @router.put("/{item_id}", response_model=read_model, summary=f"Replace a {singular}")
    def replace_item(
        item_id: str,
        body: create_model,  # type: ignore[valid-type]
        session: SessionDep,
        who: Annotated[Principal, Depends(writer)],
        response: Response,
        if_match: IfMatch = None,
        reason: Reason = None,
    ) -> Any:
        row = repo.replace_row(session, kind, item_id, body, if_match, actor_of(who, reason))
        session.commit()
        changed()
        return _send(row, response)

    @router.patch("/{item_id}", response_model=read_model, summary=f"Change some fields of a {singular}")
    def patch_item(
        item_id: str,
        body: patch_model,  # type: ignore[valid-type]
        session: SessionDep,
        who: Annotated[Principal, Depends(writer)],
        response: Response,
        if_match: IfMatch = None,
        reason: Reason = None,
    ) -> Any:
        row = repo.patch_row(session, kind, item_id, body, if_match, actor_of(who, reason))
        session.commit()
        changed()
        return _send(row, response)

    @router.delete("/{item_id}", status_code=status.HTTP_204_NO_CONTENT, summary=f"Delete a {singular}")
    def delete_item(
        item_id: str,
        session: SessionDep,
        who: Annotated[Principal, Depends(writer)],
        if_match: IfMatch = None,
        reason: Reason = None,
    ) -> Response:
        repo.delete_row(session, kind, item_id, if_match, actor_of(who, reason))
        session.commit()
        changed()
        return Response(status_code=status.HTTP_204_NO_CONTENT)

    return router
