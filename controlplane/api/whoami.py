"""`GET /api/v1/whoami`: who the caller is (an operator API key and its role, or an agent token), so that a client
can adapt to its rights without probing them."""

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from controlplane.api.deps import Caller

router = APIRouter(prefix="/api/v1", tags=["access"])


class WhoAmI(BaseModel):
    kind: Literal["key", "agent"] = Field(description="an operator API key, or an agent's token")
    id: str = Field(description="the key's id, or the agent's")
    name: str
    role: Literal["viewer", "editor", "admin", "agent"] = Field(description="a key's role; `agent` for an agent")


@router.get("/whoami", response_model=WhoAmI, summary="The caller: its kind, id, name and role")
def whoami(principal: Caller) -> Any:
    role = principal.role if principal.kind == "key" else "agent"
    return {"kind": principal.kind, "id": principal.id, "name": principal.name, "role": role}
