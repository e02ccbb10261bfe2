"""A gateway shutting down aborts every stream it has open (EngineClient.end_streams). A replica
that is gone fails its abort; that failure used to stay unread, and asyncio printed it with a
traceback ("Task exception was never retrieved") on the terminal of a gateway whose cluster had
just gone away. It is read now, and only logged at debug."""
from __future__ import annotations

import asyncio
import gc

from gateway_fakes import EOS, Replica
from hyrax.actors.model.tokenizer import ByteTokenizer
from hyrax.api.client import EngineClient, ModelInfo


class GoneReplica(Replica):
    """Streams tokens until asked to abort, and fails that call: the replica is gone."""

    async def generate(self, request_id, prompt_ids, params):
        while True:
            await asyncio.sleep(0.01)
            yield {"token_ids": [65], "finished": False, "finish_reason": None}

    async def run(self, cmd):
        raise ConnectionError("the replica is gone")


def test_a_shutdown_whose_aborts_fail_leaves_no_unread_error_behind():
    async def run() -> tuple[int, list[str]]:
        unread: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unread.append(ctx["message"]))
        client = EngineClient(ModelInfo("m", 2048, ByteTokenizer(264, EOS), None, 264, (EOS,)), [GoneReplica()])
        stream = client.generate("r1", [65, 66], {"max_tokens": 100})
        await stream.__anext__()  # under way
        ended = await client.end_streams(1.0)
        await stream.aclose()
        del stream
        gc.collect()  # an unread task error is reported when the task is collected
        await asyncio.sleep(0)
        return ended, unread

    ended, unread = asyncio.run(run())
    assert ended == 1
    assert unread == [], unread
