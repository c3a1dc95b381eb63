"""Agent and API key schemas; secrets appear only in the one response that creates them."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from controlplane.schemas.common import Labels, Name, Stored, Strict, partial

Role = Literal["viewer", "editor", "admin"]
DeviceClass = Literal["jetson", "gpu", "cpu", "cloud"]


class AgentCreate(Strict):
    name: Name
    labels: Labels = Field(default_factory=dict)
    device_class: DeviceClass = "cpu"


AgentPatch = partial(AgentCreate)


class AgentRead(AgentCreate, Stored):
    last_seen: datetime | None = None
    status: Literal["healthy", "stale", "never_seen"] = Field(description="from last_seen and the stale timeout")


class AgentCreated(BaseModel):
    agent: AgentRead
    token: str = Field(description="the agent's bearer token; shown only in this response")


class ApiKeyCreate(Strict):
    name: Name
    role: Role


class ApiKeyPatch(Strict):
    name: Name | None = None
    role: Role | None = None


class ApiKeyRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    role: Role
    version: int
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class ApiKeyCreated(BaseModel):
    api_key: ApiKeyRead
    key: str = Field(description="the bearer key; shown only in this response")


class EventRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    ts: datetime
    kind: str
    actor: str
    subject_type: str
    subject_id: str | None
    agent_id: str | None
    rule_id: str | None
    reason: str
    data: dict[str, object]
