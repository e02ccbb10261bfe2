"""Admin API (bearer token from HYRAX_ADMIN_TOKEN): inspect, retract, resume requests."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import Field, field_validator, model_validator

from hyrax.actors.engine.commands import Resume, Retract
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.selection import Selection
from hyrax.api.auth import require_admin
from hyrax.api.deployment_events import ControllerSilent, fetch
from hyrax.api.errors import APIError
from hyrax.api.json_body import JSONRoute
from hyrax.api.schemas import Body, Text

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], route_class=JSONRoute)
# a migration's answer when no replica had taken the request over within the client's wait
NOT_ARRIVED = ("no other replica had taken it over when this answered (it ended, or is still on its way: "
               "GET /admin/requests shows where it is)")


class SelectBody(Body):
    """Which requests: ids (each named once), a count, or all (hyrax/actors/engine/selection.py)."""
    request_ids: list[Text] | None = Field(default=None, min_length=1)
    count: int | None = Field(default=None, ge=1)
    all: bool = False

    @field_validator("request_ids")
    @classmethod
    def _each_once(cls, ids):
        seen = set()
        twice = [i for i in ids or () if i in seen or seen.add(i)]
        if twice:
            raise ValueError(f"request {twice[0]!r} is named twice; name each request once")
        return ids

    @model_validator(mode="after")
    def _one_selector(self):
        if sum([self.request_ids is not None, self.count is not None, bool(self.all)]) != 1:
            raise ValueError("give exactly one of request_ids, count, all")
        return self


class RetractBody(SelectBody):
    mode: str | None = Field(default=None, pattern="^(cpu_tensor|host_pool|recompute)$")
    hold: bool = False


class ResumeBody(SelectBody):
    """The same selectors as retract."""


def _selection(body) -> Selection:
    return Selection(ids=tuple(body.request_ids or ()), count=body.count, all=bool(body.all))


def _answer(body, res: dict, done: str) -> dict:
    """Per-request results. Ids the body names that no replica knows are listed under `unknown`;
    when it names only unknown ids the answer is a 404, as for migrate."""
    results = {k: Outcome(v) for k, v in res.items()}
    unknown = [k for k in body.request_ids or () if results.get(k, Outcome.UNKNOWN) == Outcome.UNKNOWN]
    if body.request_ids and len(unknown) == len(body.request_ids):
        raise APIError(404, f"unknown request{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}",
                       param="request_ids", code="request_not_found")
    return {"results": {k: v.value for k, v in results.items()}, done: [k for k, v in results.items() if v.ok],
            "unknown": unknown}


class ForcedBody(Body):
    interval: int = Field(ge=0, le=2**31 - 1,
                          description="retract a running request every this many steps; 0 turns it off")


@router.get("/requests")
async def requests_(request: Request):
    return {"requests": await request.app.state.client.list_requests()}


@router.get("/pools")
async def pools(request: Request):
    return {"replicas": await request.app.state.client.pools()}


@router.get("/events")
async def events(request: Request):
    """The deployment controller's event log (hyrax/cluster/event_log.py): replicas lost, hung or
    down and replaced, added, retired, removed; newest last, with times."""
    source = request.app.state.deployment_events
    if source is None:
        raise APIError(404, "this gateway serves an in-process engine: there is no deployment controller and "
                            "no event log", code="not_found")
    try:
        page = await fetch(source)
    except ControllerSilent:
        raise APIError(503, "the deployment controller did not answer; try again", code="unavailable",
                       headers={"Retry-After": "1"}) from None
    return page.as_dict()


@router.get("/health")
async def health(request: Request):
    """A health round with each replica's own answer (its last error, its stuck reason) and the
    reasons quoting them: what GET /health leaves out. 200 whether the gateway is ready or not."""
    h = await request.app.state.client.health()
    request.app.state.ready, request.app.state.health = h.ready, h
    return h.detail()


@router.post("/retract")
async def retract(body: RetractBody, request: Request):
    res = await request.app.state.client.retract(Retract(_selection(body), body.mode, body.hold))
    return _answer(body, res, "retracted")


@router.post("/resume")
async def resume(body: ResumeBody, request: Request):
    res = await request.app.state.client.resume(Resume(_selection(body)))
    return _answer(body, res, "resumed")


@router.post("/forced-retraction")
async def forced(body: ForcedBody, request: Request):
    return {"interval": body.interval, "replicas": await request.app.state.client.set_forced_retraction(body.interval)}


class FlushBody(Body):
    """No fields: the body may be left out, or be {} (an unknown field is an error)."""


@router.post("/flush-cache")
async def flush_cache(request: Request, body: FlushBody | None = None):
    """Evict every cached prefix that no request is using, on every replica."""
    return {"replicas": await request.app.state.client.flush_cache()}


class ReplicaRef(Body):
    role: Text
    replica: int = Field(ge=0)


class MigrateBody(Body):
    request_id: Text
    to: ReplicaRef | None = None


class DrainBody(ReplicaRef):
    undrain: bool = False


def _backend(request: Request, ref: ReplicaRef):
    b = request.app.state.client.find_backend(ref.role, ref.replica)
    if b is None:
        raise APIError(404, f"no replica {ref.role}/{ref.replica}", param="replica", code="replica_not_found")
    return b


@router.post("/migrate")
async def migrate(body: MigrateBody, request: Request):
    client = request.app.state.client
    target = _backend(request, body.to) if body.to else None
    refusal = target and client.migration_refusal(target)
    if refusal:
        status, message = refusal
        raise APIError(status, message, param="to.role" if status == 400 else "to",
                       code="invalid_value" if status == 400 else "replica_unavailable")
    outcome, to = await client.migrate(body.request_id, target)
    if outcome == Outcome.UNKNOWN:
        raise APIError(404, f"unknown request: {body.request_id}", param="request_id", code="request_not_found")
    if outcome == Outcome.ALREADY_THERE:
        raise APIError(409, f"request {body.request_id} is already on {body.to.role}/{body.to.replica}",
                       param="to", code=outcome.value)
    if not outcome.ok:
        raise APIError(409, f"request {body.request_id}: {outcome.message}", param="request_id", code=outcome.value)
    if outcome == Outcome.TAKEN_BACK:  # exported, but no replica could take it: it runs on where it was
        raise APIError(409, f"request {body.request_id} did not move: no other replica took it over, and it runs on "
                            f"at {to.role}/{to.index}", param="to" if body.to else "request_id", code=outcome.value)
    if to is None:  # exported, and no replica had taken it over by the time the answer came
        return {"request_id": body.request_id, "result": f"{outcome.value}; {NOT_ARRIVED}"}
    return {"request_id": body.request_id, "result": f"{outcome.value} to {to.role}/{to.index}"}


@router.post("/drain")
async def drain(body: DrainBody, request: Request):
    b = _backend(request, body)
    client = request.app.state.client
    if body.undrain:
        await client.undrain(b)
        out = {"undrained": f"{body.role}/{body.replica}"}
    else:
        out = await client.drain(b)
    # readiness follows at once (not at the next health poll): a request right after an
    # undrain is served, not refused with a 503 by a readiness read while the replica was out
    h = await client.health()
    request.app.state.ready, request.app.state.health = h.ready, h
    return out
