"""(being written)"""

from typing import Any

from fastapi import APIRouter


def openslo_router(kind: Any) -> APIRouter:
    return APIRouter()
