"""An in-process prefill/decode deployment behind the gateway: two engines (roles prefill
and decode, one rank each, no Ray), each in its own EngineLoop, and the EngineClient over
both. Hand-offs run the same protocol as over Ray: the prefill loop offers, the decode loop
imports and acknowledges to it directly, the offer's lease reclaims what nobody took."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

from e2e_harness import ADMIN_TOKEN, DEMO_MODEL, MODEL, Gateway, RecordingClient
from hyrax.actors.engine.config import EngineConfig


@dataclass
class PDStack:
    url: str
    app: object
    client: RecordingClient
    prefill: object  # EngineLoop
    decode: object  # EngineLoop

    @property
    def loops(self) -> tuple:
        return self.prefill, self.decode

    def clean(self) -> bool:
        """No request anywhere, every pool at its baseline."""
        return all(not lp.engine.has_unfinished() and not lp.engine.has_inflight() and lp.engine.is_idle_clean()
                   for lp in self.loops)


@contextlib.contextmanager
def local_pd_gateway(config: EngineConfig, **settings):
    from hyrax.actors.engine.local import load_engine
    from hyrax.actors.engine.loop import EngineLoop
    from hyrax.api.app import GatewaySettings, create_app
    from hyrax.api.client import EngineClient, LocalBackend
    from hyrax.cluster.ray_client import model_info

    info = model_info(DEMO_MODEL, MODEL)
    loops = {}
    for role in ("prefill", "decode"):
        engine = load_engine(DEMO_MODEL, dataclasses.replace(config, role=role), decode=info.tokenizer.decode)
        loops[role] = EngineLoop(engine, f"e2e-{role}")
    client = RecordingClient(EngineClient(info, [LocalBackend(loops["prefill"], "prefill"),
                                                 LocalBackend(loops["decode"], "decode")]))
    settings.setdefault("admin_token", ADMIN_TOKEN)
    app = create_app(client, GatewaySettings(**settings))
    gw = Gateway(app)
    try:
        yield PDStack(gw.url, app, client, loops["prefill"], loops["decode"])
    finally:
        gw.close()
        for lp in loops.values():
            lp.shutdown()
