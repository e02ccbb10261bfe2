"""Engine-client backends over Ray RoleCoordinator handles."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.tokenizer import chat_template, load_tokenizer
from hyrax.api.client import EngineClient, ModelInfo


class RayBackend:
    def __init__(self, handle, role: str, index: int, timeout_s: float = 60.0):
        self.handle, self.role, self.index = handle, role, index
        self.timeout_s = timeout_s

    async def call(self, name: str, *args, **kwargs):
        return await asyncio.wait_for(getattr(self.handle, name).remote(*args, **kwargs), self.timeout_s)

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict) -> AsyncIterator[dict]:
        finished = False
        try:
            async for ref in self.handle.generate.remote(request_id, prompt_ids, params):
                item = await ref
                finished = bool(item.get("finished")) or "handoff" in item
                yield item
        finally:
            if not finished:  # the consumer went away: free the request on the replica now
                asyncio.ensure_future(self.handle.abort.remote(request_id))

    async def generate_imported(self, handoff: dict) -> AsyncIterator[dict]:
        rid = handoff["request"]["id"]
        finished = False
        try:
            async for ref in self.handle.generate_imported.remote(handoff):
                item = await ref
                finished = bool(item.get("finished")) or "handoff" in item
                yield item
        finally:
            if not finished:
                asyncio.ensure_future(self.handle.abort.remote(rid))

    async def health(self) -> dict:
        try:
            return await asyncio.wait_for(self.handle.health.remote(), 5.0)
        except Exception as e:  # noqa: BLE001 - unreachable counts as unhealthy
            return {"role": self.role, "replica": self.index, "healthy": False, "last_error": type(e).__name__}


def model_info(model_dir: str, name: str) -> ModelInfo:
    cfg = ModelConfig.from_dir(model_dir)
    return ModelInfo(name=name, max_model_len=cfg.max_position_embeddings,
                     tokenizer=load_tokenizer(model_dir, cfg.vocab_size), chat_template=chat_template(model_dir),
                     vocab_size=cfg.vocab_size, eos_token_ids=cfg.eos_token_id)


def client_for(deployment, model_name: str, max_inflight: int = 1024) -> EngineClient:
    backends = [RayBackend(r.coordinator, r.role, r.index) for r in deployment.replicas]
    return EngineClient(model_info(deployment.model_dir, model_name), backends, max_inflight=max_inflight)
