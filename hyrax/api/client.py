"""The engine client the gateway talks to, injected at construction (STYLE §8).

A client routes requests over role replicas ("backends") and remembers which replica holds
each request, so aborts and admin calls reach the right one. Backends wrap either an
in-process `EngineLoop` (tests, single-process use) or a Ray `RoleCoordinator` handle
(`hyrax.cluster.ray_client`), behind the same two calls.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable


class LocalBackend:
    def __init__(self, loop, role: str = "colocated", index: int = 0):
        self.loop, self.role, self.index = loop, role, index

    async def call(self, name: str, *args, **kwargs):
        return getattr(self.loop, name)(*args, **kwargs)

    def generate(self, request_id: str, prompt_ids: list[int], params: dict) -> AsyncIterator[dict]:
        return self.loop.generate(request_id, prompt_ids, params)

    def generate_imported(self, handoff: dict) -> AsyncIterator[dict]:
        return self.loop.generate_imported(handoff)

    async def health(self) -> dict:
        return {"role": self.role, "replica": self.index, "healthy": self.loop.healthy}


@dataclass
class ModelInfo:
    name: str
    max_model_len: int
    tokenizer: object
    chat_template: str | None
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


def least_loaded(backends: list, inflight: dict[int, int]) -> object:
    return min(backends, key=lambda b: (inflight.get(id(b), 0), b.index))


@dataclass
class EngineClient:
    model: ModelInfo
    backends: list
    router: Callable = least_loaded
    max_inflight: int = 1024
    inflight: dict[int, int] = field(default_factory=dict)
    owner: dict[str, object] = field(default_factory=dict)  # request id -> backend
    draining: set = field(default_factory=set)  # backend ids that take no new requests

    def queue_full(self) -> bool:
        return sum(self.inflight.values()) >= self.max_inflight

    migrate_to: dict[str, object] = field(default_factory=dict)  # request id -> chosen target

    def _pick(self, roles: tuple[str, ...], exclude: object = None):
        cands = [b for b in self.backends if b.role in roles and b is not exclude and id(b) not in self.draining]
        return self.router(cands, self.inflight) if cands else None

    def _own(self, request_id: str, backend) -> None:
        old = self.owner.get(request_id)
        if old is not None:
            self.inflight[id(old)] -= 1
        if backend is not None:
            self.inflight[id(backend)] = self.inflight.get(id(backend), 0) + 1
            self.owner[request_id] = backend
        else:
            self.owner.pop(request_id, None)

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict) -> AsyncIterator[dict]:
        """Stream one request. With prefill replicas, the prompt runs there and the request is
        handed to a decode replica after its first token; a migration hands it between
        decode replicas. The consumer sees one uninterrupted stream of token items."""
        backend = self._pick(("prefill",)) or self._pick(("colocated", "decode"))
        if backend is None:
            yield {"error": "no replica accepts requests (all draining)", "finished": True,
                   "finish_reason": "error", "token_ids": []}
            return
        self._own(request_id, backend)
        stream, source = backend.generate(request_id, prompt_ids, params), None
        try:
            while True:
                handoff = None
                async for item in stream:
                    if "imported" in item:  # the new replica has the state: free it at the source
                        if source is not None:
                            await source.call("release", request_id)
                            source = None
                        continue
                    if "handoff" in item:
                        handoff = item.pop("handoff")
                        if item.get("token_ids"):
                            yield item
                        break
                    yield item
                if handoff is None:
                    return
                target = self.migrate_to.pop(request_id, None) or self._pick(("decode", "colocated"), exclude=backend)
                if target is None:  # nowhere to go: continue where it is
                    target = backend
                source, backend = backend, target
                self._own(request_id, backend)
                stream = backend.generate_imported(handoff)
        finally:
            self._own(request_id, None)
            self.migrate_to.pop(request_id, None)

    def find_backend(self, role: str, replica: int):
        for b in self.backends:
            if b.role == role and b.index == replica:
                return b
        return None

    async def migrate(self, request_id: str, target=None) -> str:
        """Move a running request to `target` (a backend; default: least loaded other replica)."""
        src = self.owner.get(request_id)
        if src is None:
            return "error: unknown request"
        target = target or self._pick(("decode", "colocated"), exclude=src)
        if target is None or target is src:
            return "error: no other replica to migrate to"
        self.migrate_to[request_id] = target
        ok = await src.call("migrate_out", request_id)
        if not ok:
            self.migrate_to.pop(request_id, None)
            return "error: request is not running on its replica"
        return f"migrating to {target.role}/{target.index}"

    async def drain(self, backend, wait_s: float = 30.0) -> dict:
        """Stop admitting to `backend`, migrate its running requests elsewhere, and wait (up
        to `wait_s`) until it holds nothing; `remaining` is what it still holds then."""
        self.draining.add(id(backend))
        reqs = await backend.call("list_requests")
        moved = {}
        for r in reqs:
            if r["state"] == "running" and r["id"] in self.owner:
                moved[r["id"]] = await self.migrate(r["id"])
        remaining = await backend.call("load")
        deadline = asyncio.get_running_loop().time() + wait_s
        while remaining and asyncio.get_running_loop().time() < deadline:  # until the targets took them
            await asyncio.sleep(0.05)
            remaining = await backend.call("load")
        return {"draining": f"{backend.role}/{backend.index}", "migrations": moved, "remaining": remaining}

    async def undrain(self, backend) -> None:
        self.draining.discard(id(backend))

    async def abort(self, request_id: str) -> bool:
        b = self.owner.get(request_id)
        return bool(b and await b.call("abort", request_id))

    async def _each(self, name: str, *args, **kwargs) -> list:
        return list(await asyncio.gather(*(b.call(name, *args, **kwargs) for b in self.backends)))

    async def retract(self, request_ids: list[str] | None, count: int | None, all_: bool,
                      mode: str | None, hold: bool) -> dict:
        out: dict = {}
        if request_ids is not None:
            groups: dict[int, list[str]] = {}
            for rid in request_ids:
                b = self.owner.get(rid)
                if b is None:
                    out[rid] = "error: unknown request"
                else:
                    groups.setdefault(id(b), []).append(rid)
            for b in self.backends:
                if id(b) in groups:
                    out.update(await b.call("retract", groups[id(b)], None, False, mode, hold))
            return out
        remaining = count
        for b in self.backends:
            if remaining is not None and remaining <= 0:
                break
            got = await b.call("retract", None, remaining, all_, mode, hold)
            out.update(got)
            if remaining is not None:
                remaining -= sum(1 for v in got.values() if not str(v).startswith("error"))
        return out

    async def resume(self, request_ids: list[str]) -> dict:
        out: dict = {}
        for rid in request_ids:
            b = self.owner.get(rid)
            out.update(await b.call("resume", [rid]) if b else {rid: "error: unknown request"})
        return out

    async def set_forced_retraction(self, interval: int) -> None:
        await self._each("set_forced_retraction", interval)

    async def list_requests(self) -> list[dict]:
        out = []
        for b, reqs in zip(self.backends, await self._each("list_requests")):
            for r in reqs:
                r.setdefault("role", b.role)
                r.setdefault("replica", b.index)
                out.append(r)
        return out

    async def pools(self) -> list[dict]:
        res = await self._each("pools")
        return [r if "components" in r else {"role": b.role, "replica": b.index, "tp_size": 1, "components": r}
                for b, r in zip(self.backends, res)]

    async def stats(self) -> list[dict]:
        res = await self._each("stats")
        return [dict(s, role=b.role, replica=b.index) for b, s in zip(self.backends, res)]

    async def health(self) -> dict:
        try:
            reps = await asyncio.wait_for(asyncio.gather(*(b.health() for b in self.backends)), timeout=5)
        except Exception as e:  # noqa: BLE001 - an unreachable replica is simply not ready
            return {"ready": False, "replicas": [], "error": f"{type(e).__name__}"}
        return {"ready": all(r.get("healthy") for r in reps), "replicas": reps}
