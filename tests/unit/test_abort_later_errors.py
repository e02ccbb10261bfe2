"""An abort the gateway sends in the background (a stream's consumer left, a refused hand-off's
offer to free) to a replica that is gone fails; that failure is the replica's loss, which
supervision reports. It reached asyncio as "Task exception was never retrieved" with a
traceback (seen when the deployment under an attached gateway stopped mid-stream)."""
from __future__ import annotations

import asyncio
import gc

from gateway_fakes import EOS, Replica
from hyrax.actors.model.tokenizer import ByteTokenizer
from hyrax.api.client import EngineClient, ModelInfo


class GoneReplica(Replica):
    async def run(self, cmd):
        raise ConnectionError("the replica's coordinator died")


def test_a_background_abort_to_a_gone_replica_leaves_no_unretrieved_task_error(caplog):
    reported: list[dict] = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx))
        replica = GoneReplica()
        client = EngineClient(ModelInfo("m", 2048, ByteTokenizer(264, EOS), None, 264, (EOS,)), [replica])
        client._abort_later(replica, "r1")
        for _ in range(5):
            await asyncio.sleep(0)
        assert not client._background  # done and let go
        gc.collect()  # a task whose exception nobody read reports it when it is collected
        await asyncio.sleep(0)
    asyncio.run(scenario())
    assert [c.get("message") for c in reported] == [], reported
