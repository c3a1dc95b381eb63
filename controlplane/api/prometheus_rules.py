"""`GET /api/v1/slos/prometheus-rules` and `GET /api/v1/slos/{id}/prometheus-rules`: the SLOs as a Prometheus rule
file (recording rules and burn-rate alerts, `controlplane.slo.prometheus_rules`), for `rule_files` in prometheus.yml.
"""

from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy import select

from controlplane.api.deps import SessionDep, Viewer
from controlplane.db.models import Slo
from controlplane.errors import Conflict, NotFound
from controlplane.schemas.slos import SloRead
from controlplane.slo.prometheus_rules import rule_file
from controlplane.slo.promql import UnexpressibleSelector

YAML = "application/yaml"

# The rule file's shape (clients and schemathesis read the YAML against it). `response_class=Response` (no media type
# of its own) so that only the 200 is YAML: the errors stay documented as the JSON they are.
_RULE = {"type": "object", "description": "a recording rule (`record`) or an alerting rule (`alert`)",
         "required": ["expr"], "properties": {"record": {"type": "string"}, "alert": {"type": "string"},
                                              "expr": {"type": "string"}, "for": {"type": "string"},
                                              "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                              "annotations": {"type": "object",
                                                              "additionalProperties": {"type": "string"}}}}  # fmt: skip
_GROUP = {"type": "object", "required": ["name", "rules"],
          "properties": {"name": {"type": "string"}, "interval": {"type": "string"},
                         "rules": {"type": "array", "items": _RULE}}}  # fmt: skip
_RULE_FILE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "a Prometheus rule file, one group per SLO: `promtool check rules` accepts it",
        "content": {YAML: {"schema": {"type": "object", "required": ["groups"],
                                      "properties": {"groups": {"type": "array", "items": _GROUP}}}}},
    }
}  # fmt: skip

router = APIRouter(prefix="/api/v1/slos", tags=["slos"])


@router.get("/prometheus-rules", response_class=Response, responses=_RULE_FILE,
            summary="Every SLO as Prometheus recording rules and multiwindow burn-rate alerts")  # fmt: skip
def every_slo(session: SessionDep, _: Viewer) -> Response:
    rows = session.scalars(select(Slo).order_by(Slo.name)).all()
    return Response(rule_file((SloRead.model_validate(row) for row in rows), every=True), media_type=YAML)


@router.get("/{item_id}/prometheus-rules", response_class=Response, responses=_RULE_FILE,
            summary="One SLO as Prometheus recording rules and multiwindow burn-rate alerts")  # fmt: skip
def one_slo(item_id: str, session: SessionDep, _: Viewer) -> Response:
    row = session.get(Slo, item_id)
    if row is None:
        raise NotFound(f"no SLO with id '{item_id}'")
    try:
        return Response(rule_file([SloRead.model_validate(row)]), media_type=YAML)
    except UnexpressibleSelector as exc:
        raise Conflict(f"SLO '{item_id}' cannot be written as Prometheus rules: {exc}") from None
