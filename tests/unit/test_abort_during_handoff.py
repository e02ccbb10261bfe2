"""An abort that meets its request between two replicas is not lost.

A migration (or a PD hand-off) moves a request in three moves: the source offers it (its
stream to the gateway ends with the hand-off), the gateway points the request at the target,
the target imports it. An abort sent to the source after it offered the request freed the
offer there, and the gateway still carried the request to the target, where it went on to
max_tokens (found by the chaos test over Ray: a request aborted during a drain ended with
"length"). An abort sent to the target before it imported the request was refused there
when the import came, but the client answered that it did not know the request and the
source kept its offer until the offer's lease ran out. Both windows are opened here on
purpose, with real engines and the gateway's client: the stream ends with "abort", the
client says it took the abort, both replicas are idle-clean at once."""
from __future__ import annotations

import asyncio

import pytest

from engine_helpers import HYBRID, make_engine, tiny_model
from hyrax.actors.engine.loop import EngineLoop
from hyrax.api.client import EngineClient, LocalBackend, ModelInfo

PARAMS = {"max_tokens": 400, "ignore_eos": True}


class AbortAtHandoff(LocalBackend):
    """The source: the moment its stream hands the request off, the client aborts it (the
    gateway has not moved it yet: the abort goes to this replica, which has only offered it)."""

    client: EngineClient
    answers: list

    def generate(self, request_id, prompt_ids, params):
        async def stream():
            async for item in self.loop.generate(request_id, prompt_ids, params):
                if "handoff" in item:
                    self.answers.append(await self.client.abort(request_id))
                yield item
        return stream()


class AbortBeforeImport(LocalBackend):
    """The target: the client aborts the request as the gateway hands it over, before this
    replica has imported it (the abort reaches a replica that does not know it yet)."""

    client: EngineClient
    answers: list

    def generate_imported(self, handoff):
        async def stream():
            self.answers.append(await self.client.abort(handoff["request"]["id"]))
            async for item in self.loop.generate_imported(handoff):
                yield item
        return stream()


def _idle_clean(loops) -> bool:
    for _ in range(300):
        if all(lp.is_idle_clean() for lp in loops):
            return True
        asyncio.run(asyncio.sleep(0.02))
    return False


@pytest.mark.parametrize("where", ["at_handoff", "before_import"])
def test_an_abort_between_two_replicas_ends_the_request(where):
    model = tiny_model(HYBRID)
    loops = [EngineLoop(make_engine(model, deterministic=False, prefix_cache=False), f"r{k}") for k in range(2)]
    try:
        answers: list = []
        source = (AbortAtHandoff if where == "at_handoff" else LocalBackend)(loops[0], "colocated", 0)
        target = (AbortBeforeImport if where == "before_import" else LocalBackend)(loops[1], "colocated", 1)
        client = EngineClient(ModelInfo("t", 4096, None, None, 96), [source, target], cache_route_margin=None)
        for b in (source, target):
            b.client, b.answers = client, answers

        async def scenario():
            items = []

            async def consume():
                async for item in client.generate("r1", [5, 6, 7, 8], dict(PARAMS)):
                    items.append(item)

            task = asyncio.ensure_future(consume())
            while sum(len(i.get("token_ids", [])) for i in items) < 3:
                await asyncio.sleep(0.005)
            assert client.owner["r1"] is source
            outcome, _ = await client.migrate("r1", target)
            assert outcome.value == "migrating", outcome
            await asyncio.wait_for(task, 60)
            return items

        items = asyncio.run(scenario())
        assert answers == [True], answers  # the client took the abort: it streams the request
        last = items[-1]
        assert last["finished"] and last["finish_reason"] == "abort", last
        assert sum(len(i.get("token_ids", [])) for i in items) < PARAMS["max_tokens"]
        assert not client.owner and not client.aborting
        assert _idle_clean(loops), [lp.is_idle_clean() for lp in loops]
    finally:
        for lp in loops:
            lp.shutdown()


@pytest.mark.parametrize("reason", [None, "its gateway stopped renewing its lease"])
def test_a_request_aborted_after_its_stream_ended_with_the_hand_off_leaves_nothing_behind(reason):
    """A prefill replica's stream of a request ends with the hand-off; an abort that comes while
    it is offered (the client left, the gateway's lease ran out) ends it there with no stream to
    tell. Its finished request (prompt, outputs, text) and the abort's reason were kept for a
    stream that would never come: one of each per such abort, for the replica's life."""
    loop = EngineLoop(make_engine(tiny_model(HYBRID), role="prefill"), "prefill")
    try:
        async def until_handoff():
            async for item in loop.generate("r1", [5, 6, 7, 8], dict(PARAMS)):
                if "handoff" in item:
                    return item
        assert "handoff" in asyncio.run(until_handoff())
        assert loop.abort("r1", reason=reason)
        assert "r1" not in loop.engine.requests
        assert "r1" not in loop.engine.finished_requests and "r1" not in loop._abort_reasons
        assert loop.is_idle_clean()
    finally:
        loop.shutdown()
