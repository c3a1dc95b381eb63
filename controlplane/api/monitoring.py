"""`GET /metrics`: the control plane's own metrics in Prometheus' text format, for a viewer API key."""

from fastapi import APIRouter, Request, Response

from controlplane.api.deps import Viewer
from controlplane.monitoring import CONTENT_TYPE, ControlPlaneMetrics

router = APIRouter(tags=["monitoring"])

_RESPONSES: dict[int | str, dict[str, object]] = {
    200: {"description": "Prometheus text exposition format 0.0.4",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
}  # fmt: skip


@router.get("/metrics", summary="The control plane's metrics for Prometheus", response_class=Response,
            responses=_RESPONSES)  # fmt: skip
def metrics(request: Request, _: Viewer) -> Response:
    monitoring: ControlPlaneMetrics = request.app.state.monitoring
    return Response(monitoring.exposition(), media_type=CONTENT_TYPE)
