"""Admin API (bearer token from HYRAX_ADMIN_TOKEN): inspect, retract, resume requests."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from hyrax.api.auth import require_admin
from hyrax.api.errors import APIError

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


class RetractBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_ids: list[str] | None = None
    count: int | None = Field(default=None, ge=1)
    all: bool = False
    mode: str | None = Field(default=None, pattern="^(cpu_tensor|host_pool|recompute)$")
    hold: bool = False

    @model_validator(mode="after")
    def _one_selector(self):
        n = sum([self.request_ids is not None, self.count is not None, bool(self.all)])
        if n != 1:
            raise ValueError("give exactly one of request_ids, count, all")
        return self


class ResumeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_ids: list[str] = Field(min_length=1)


class ForcedBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    interval: int = Field(ge=0)


@router.get("/requests")
async def requests_(request: Request):
    return {"requests": await request.app.state.client.list_requests()}


@router.get("/pools")
async def pools(request: Request):
    return {"replicas": await request.app.state.client.pools()}


@router.post("/retract")
async def retract(body: RetractBody, request: Request):
    res = await request.app.state.client.retract(body.request_ids, body.count, body.all, body.mode, body.hold)
    return {"results": res, "retracted": [k for k, v in res.items() if not str(v).startswith("error")]}


@router.post("/resume")
async def resume(body: ResumeBody, request: Request):
    return {"results": await request.app.state.client.resume(body.request_ids)}


@router.post("/forced-retraction")
async def forced(body: ForcedBody, request: Request):
    await request.app.state.client.set_forced_retraction(body.interval)
    return {"interval": body.interval}


@router.post("/migrate")
async def migrate(request: Request):
    raise APIError(501, "migration between decode replicas is not available in this build", code="not_implemented")


@router.post("/drain")
async def drain(request: Request):
    raise APIError(501, "draining a replica is not available in this build", code="not_implemented")
