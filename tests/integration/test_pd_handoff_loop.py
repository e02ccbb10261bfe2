"""The step loop (EngineLoop) around a hand-off, in-process over the local engine (no Ray,
seconds): a migrated stream delivers every token the exported state holds, and a replica
whose only request awaits the importer's acknowledgement sleeps instead of stepping."""
from __future__ import annotations

import asyncio
import time

import pytest

from hyrax.actors.engine.config import EngineConfig
from ray_harness import DEMO_MODEL, prompt

pytestmark = pytest.mark.timeout(120)


def test_prefill_loop_idles_while_handoff_awaits_acknowledgement():
    from hyrax.actors.engine.local import load_engine
    from hyrax.actors.engine.loop import EngineLoop

    loop = EngineLoop(load_engine(DEMO_MODEL, EngineConfig(deterministic=True, role="prefill")), "pd-idle")

    async def scenario() -> int:
        handoff = None
        async for item in loop.generate("h0", prompt(20, seed=1), {"max_tokens": 8}):
            if "handoff" in item:
                handoff = item["handoff"]
                break
        assert handoff is not None and handoff["manifest"].num_tokens == 20
        s0 = loop.stats()["steps"]
        await asyncio.sleep(0.5)  # the importer has not acknowledged yet
        spun = loop.stats()["steps"] - s0
        assert loop.release("h0")
        return spun

    try:
        spun = asyncio.run(scenario())
        deadline = time.monotonic() + 5
        while not loop.is_idle_clean() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.is_idle_clean() and loop.check_invariants()
    finally:
        loop.shutdown()
    assert spun <= 5, f"{spun} empty steps in 0.5 s while the only request was handed off"


@pytest.mark.parametrize("overlap", [
    False,
    True,
], ids=["sync", "overlap"])
def test_migrated_stream_delivers_every_token_of_the_exported_state(overlap):
    from hyrax.actors.engine.local import load_engine
    from hyrax.actors.engine.loop import EngineLoop

    loop = EngineLoop(load_engine(DEMO_MODEL, EngineConfig(deterministic=True, overlap=overlap)), "pd-mig")

    async def scenario() -> tuple[list[int], list[int]]:
        seen, asked = [], False
        async for item in loop.generate("m0", prompt(30, seed=3), {"max_tokens": 200, "ignore_eos": True}):
            seen += item["token_ids"]
            if "handoff" in item:
                assert loop.release("m0")
                return seen, item["handoff"]["request"]["output_ids"]
            if len(seen) >= 5 and not asked:
                asked = loop.migrate_out("m0")
                assert asked
        raise AssertionError("the stream ended without a hand-off")

    try:
        seen, exported = asyncio.run(scenario())
        assert loop.is_idle_clean() and loop.check_invariants()
    finally:
        loop.shutdown()
    # the importer resumes after `exported`: the client must have seen exactly those tokens
    assert seen == exported, f"stream delivered {len(seen)} tokens, the exported state holds {len(exported)}"


def test_an_abort_that_overtakes_its_start_or_import_refuses_them():
    """Over Ray an async actor may run a caller's abort before the start (or import) sent
    earlier. The late start must not run a request nobody reads (the soak saw such orphans
    running on a decode replica for seconds after their client left)."""
    from hyrax.actors.engine.local import load_engine
    from hyrax.actors.engine.loop import EngineLoop

    config = EngineConfig(deterministic=True)
    prefill = EngineLoop(load_engine(DEMO_MODEL, EngineConfig(deterministic=True, role="prefill")), "ea-prefill")
    decode = EngineLoop(load_engine(DEMO_MODEL, config), "ea-decode")

    async def items(gen) -> list[dict]:
        return [item async for item in gen]

    async def scenario():
        assert not decode.abort("early0")  # unknown yet: remembered
        started = await items(decode.generate("early0", prompt(12, seed=4), {"max_tokens": 50}))
        handoff = None
        async for item in prefill.generate("early1", prompt(12, seed=5), {"max_tokens": 50}):
            if "handoff" in item:
                handoff = item["handoff"]
                break
        assert not decode.abort("early1")  # the gateway's abort overtakes the import
        assert prefill.abort("early1")  # and reaches the source, which holds the offer
        imported = await items(decode.generate_imported(handoff))
        return started, imported

    try:
        started, imported = asyncio.run(scenario())
        for got in (started, imported):
            assert got == [{"finished": True, "finish_reason": "abort", "token_ids": []}], got
        assert decode.stats()["early_aborts_refused"] == 2
        for loop in (prefill, decode):
            assert loop.is_idle_clean() and loop.check_invariants() and loop.list_requests() == []
    finally:
        prefill.shutdown()
        decode.shutdown()
