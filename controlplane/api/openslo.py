"""SLOs in and out as OpenSLO v1 YAML: `POST /api/v1/slos/import` (upsert by name, all or nothing),
`GET /api/v1/slos/{id}/openslo` and `GET /api/v1/slos/openslo` (every SLO). The conversion is
`controlplane.slo.openslo`; this module reads the body, writes through the repository and answers.

No `from __future__ import annotations` here: FastAPI reads the parameter types from the closures' annotations.
"""

from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, Depends, Query, Request, Response, status
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.api.deps import Editor, Reason, SessionDep, Viewer, actor_of
from controlplane.db import repository as repo
from controlplane.errors import UnsupportedMediaType, ValidationFailed
from controlplane.schemas.common import ErrorBody
from controlplane.schemas.slos import SloCreate
from controlplane.slo import openslo

YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml")
_DOCUMENTS = {"type": "object", "description": "OpenSLO v1 documents (apiVersion, kind, metadata, spec), '---' between"}
_YAML_CONTENT = {media: {"schema": _DOCUMENTS} for media in YAML_TYPES}
_EXPORT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "OpenSLO v1 YAML, one document per SLO", "content": {"application/yaml": {}}},
    409: {
        "model": ErrorBody,
        "description": "an SLO OpenSLO cannot express (a window that is not whole minutes, "
        "agent labels that are not Prometheus label matchers)",
    },
}


class ImportedSloResult(BaseModel):
    id: str | None = Field(description="the SLO's id; null for one a dry run would create")
    name: str
    result: Literal["created", "updated", "unchanged"]


class ImportAnswer(BaseModel):
    slos: list[ImportedSloResult]
    dry_run: bool = False


async def yaml_body(request: Request) -> str:
    """The request body as text, if it says it is YAML (415 otherwise); the size limit is BodyLimit's."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in YAML_TYPES:
        raise UnsupportedMediaType(
            f"send the OpenSLO document as YAML: Content-Type {', '.join(YAML_TYPES)} (got '{media or 'none'}')"
        )
    try:
        return (await request.body()).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationFailed.field("body", "not UTF-8 text") from exc


def _repathed(exc: ValidationFailed, item: openslo.ImportedSlo) -> list[dict[str, Any]]:
    """The resource check's errors (`body.threshold_ms`) named where the YAML said it."""
    return [{"field": item.field(str(d.get("field", "")).removeprefix("body.")), "message": d.get("message", "")}
            for d in (exc.details or [{"field": "body", "message": exc.message}])]  # fmt: skip


def import_slos(
    session: Session, kind: repo.ResourceKind[Any], items: list[openslo.ImportedSlo], actor: repo.Actor
) -> list[ImportedSloResult]:
    """Create or replace each SLO by name in `session` (the caller commits or rolls back): all pass the same checks
    as `POST /api/v1/slos` first, so one refusal writes nothing."""
    problems: list[dict[str, Any]] = []
    for item in items:
        try:
            if kind.check is not None:
                kind.check(item.slo.model_dump())
        except ValidationFailed as exc:
            problems.extend(_repathed(exc, item))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValidationFailed(f"{problems[0]['field']}: {problems[0]['message']}{more}", details=problems)
    results = []
    fields = set(SloCreate.model_fields)
    for item in items:
        row = session.scalar(select(kind.table).where(kind.table.name == item.slo.name))
        if row is None:
            row = repo.create_row(session, kind, item.slo, actor)
            results.append(ImportedSloResult(id=row.id, name=row.name, result="created"))
        elif kind.read(row).model_dump(include=fields) == item.slo.model_dump():
            results.append(ImportedSloResult(id=row.id, name=row.name, result="unchanged"))
        else:
            repo.replace_row(session, kind, row.id, item.slo, None, actor)
            results.append(ImportedSloResult(id=row.id, name=row.name, result="updated"))
    return results


def _yaml(text: str) -> Response:
    return Response(text, media_type="application/yaml")


def openslo_router(kind: repo.ResourceKind[Any]) -> APIRouter:
    router = APIRouter(prefix="/api/v1/slos", tags=["slos"])

    @router.post(
        "/import", response_model=ImportAnswer, status_code=status.HTTP_200_OK,
        summary="Import SLOs from OpenSLO v1 YAML (create or replace by name, all or nothing)",
        responses={201: {"model": ImportAnswer, "description": "imported; at least one SLO was created"},
                   200: {"description": "imported (or checked, with dry_run); none was created"},
                   415: {"model": ErrorBody, "description": "not application/yaml, application/x-yaml or text/yaml"}},
        openapi_extra={"requestBody": {"required": True, "content": _YAML_CONTENT}},
    )  # fmt: skip
    def import_openslo(
        who: Editor,  # first: dependencies resolve in order, and a caller without the role learns nothing of the body
        text: Annotated[str, Depends(yaml_body)],
        session: SessionDep,
        response: Response,
        dry_run: Annotated[bool, Query(description="check everything, write nothing")] = False,
        reason: Reason = None,
    ) -> Any:
        """One or more documents: `SLO`s with their `SLI`, `AlertPolicy` and `AlertCondition` inline or as documents
        of the same file. What Spillway cannot store is refused with 422 naming `documents[<i>].<path>`."""
        items = openslo.parse(text)
        results = import_slos(session, kind, items, actor_of(who, reason or "OpenSLO import"))
        if dry_run:
            session.rollback()
            results = [r.model_copy(update={"id": None}) if r.result == "created" else r for r in results]
        else:
            session.commit()
        if not dry_run and any(r.result == "created" for r in results):
            response.status_code = status.HTTP_201_CREATED
        return ImportAnswer(slos=results, dry_run=dry_run)

    @router.get("/openslo", response_class=Response, responses=_EXPORT_RESPONSES,
                summary="Every SLO as OpenSLO v1 YAML (one document each)")  # fmt: skip
    def export_all(session: SessionDep, _: Viewer) -> Response:
        rows = session.scalars(select(kind.table).order_by(kind.table.name, kind.table.id)).all()
        return _yaml(openslo.dump_all([cast(SloCreate, kind.read(r)) for r in rows], ids=[r.id for r in rows]))

    @router.get("/{item_id}/openslo", response_class=Response, responses=_EXPORT_RESPONSES,
                summary="An SLO as OpenSLO v1 YAML, which the import reads back to the same SLO")  # fmt: skip
    def export_one(item_id: str, session: SessionDep, _: Viewer) -> Response:
        row = repo.get_row(session, kind, item_id)
        return _yaml(openslo.dump(cast(SloCreate, kind.read(row))))

    return router


__all__ = ["ImportAnswer", "ImportedSloResult", "import_slos", "openslo_router"]
