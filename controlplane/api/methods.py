"""Which methods a path really has, read from the app's own routes: what `OPTIONS` answers and what a 405 lists.

A router that finds a path but not the method answers with the first route it tried (Starlette's way), so `Allow`
named that one route's methods only (`GET` on `/api/v1/slos/{id}`, which also has PUT, PATCH and DELETE). Here every
route is asked, by the router's own matching, whether it would take the path with each method.
"""

from __future__ import annotations

from typing import Any

from starlette.routing import Match
from starlette.types import ASGIApp, Scope

_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(app: ASGIApp, scope: Scope) -> list[str]:
    """The methods some route of `app` serves at `scope`'s path, `OPTIONS` included when there is any. A literal
    path beside parametrised ones (`/api/v1/slos/import` beside `/api/v1/slos/{item_id}`) has its own routes'
    methods only: it is not an item (`reserved_ids` keeps the item routes off it)."""
    routes = _leaf_routes(app)
    literal, any_route = [], []
    literal_path = False
    for method in _METHODS:
        probe: Scope = {"type": "http", "method": method, "path": scope["path"],
                        "root_path": scope.get("root_path", ""), "headers": scope.get("headers", [])}  # fmt: skip
        for route in routes:
            match, child = route.matches(probe)
            if match is Match.NONE:
                continue
            plain = not child.get("path_params")
            literal_path = literal_path or plain
            if match is Match.FULL:
                any_route.append(method)
                if plain:
                    literal.append(method)
    allowed = sorted(set(literal if literal_path else any_route), key=_METHODS.index)
    return [*allowed, "OPTIONS"] if allowed else []


def literal_paths(app: ASGIApp) -> frozenset[str]:
    """Every path a route of `app` serves without path parameters."""
    return frozenset(path for route in _leaf_routes(app) if (path := getattr(route, "path", "")) and "{" not in path)


def _leaf_routes(app: ASGIApp) -> list[Any]:
    """The routes of `app`, those of included routers included (FastAPI >= 0.160 keeps those as branches)."""
    found: list[Any] = []

    def walk(items: Any) -> None:
        for route in items:
            if hasattr(route, "effective_candidates"):
                walk(route.effective_candidates())
            elif hasattr(route, "routes"):
                walk(route.routes)
            else:
                found.append(route)

    walk(getattr(getattr(app, "router", None), "routes", []))
    return found
