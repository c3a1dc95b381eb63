"""Which methods a path really has, read from the app's own routes: what `OPTIONS` answers and what a 405 lists.

A router that finds a path but not the method answers with the first route it tried (Starlette's way), so `Allow`
named that one route's methods only (`GET` on `/api/v1/slos/{id}`, which also has PUT, PATCH and DELETE). Here every
route is asked, by the router's own matching, whether it would take the path with each method.
"""

from __future__ import annotations

from starlette.routing import Match
from starlette.types import ASGIApp, Scope

_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(app: ASGIApp, scope: Scope) -> list[str]:
    """The methods some route of `app` serves at `scope`'s path, `OPTIONS` included when there is any."""
    routes = getattr(getattr(app, "router", None), "routes", [])
    allowed = []
    for method in _METHODS:
        probe: Scope = {"type": "http", "method": method, "path": scope["path"],
                        "root_path": scope.get("root_path", ""), "headers": scope.get("headers", [])}  # fmt: skip
        if any(route.matches(probe)[0] is Match.FULL for route in routes):
            allowed.append(method)
    return [*allowed, "OPTIONS"] if allowed else []
