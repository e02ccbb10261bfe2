"""A gateway served in process (FastAPI's TestClient) over one scripted replica, for tests of
what the routes answer: no engine, no Ray."""
from __future__ import annotations

from fastapi.testclient import TestClient

from hyrax.actors.model.tokenizer import ByteTokenizer
from hyrax.api.app import GatewaySettings, create_app
from hyrax.api.client import EngineClient, ModelInfo

EOS = 256


class Replica:
    """A healthy colocated replica; a test overrides what it is asked (`generate`, `run`). By
    default a call reaching it fails the test."""

    role, index = "colocated", 0

    def generate(self, request_id, prompt_ids, params):
        raise AssertionError("a refused call reached the replica")

    async def run(self, cmd):
        raise AssertionError(f"a refused call reached the replica: {cmd}")

    async def health(self) -> dict:
        return {"role": self.role, "replica": self.index, "healthy": True, "stuck": None}


def gateway(replica=None, tokenizer=None, chat_template=None, replicas: list | None = None,
            **settings) -> TestClient:
    """The gateway of model "m" (context 2048, a byte tokenizer by default) over `replica` (or
    the list `replicas`), ready; `settings`: GatewaySettings' (admin token "t" unless given)."""
    info = ModelInfo("m", 2048, tokenizer or ByteTokenizer(264, EOS), chat_template, 264, (EOS,))
    backends = replicas or [replica or Replica()]
    app = create_app(EngineClient(info, backends), GatewaySettings(**{"admin_token": "t", **settings}))
    app.state.ready = True
    return TestClient(app)
