"""Penalties, logit_bias and min_tokens over Ray with PD (issue 19): seeded sampled requests
prefilled on one replica, handed to a decode replica at TP 2 and retracted every third step
there draw exactly the tokens of the uninterrupted single-process engine. The decode ranks
never saw the prompt: the penalties' token history comes from the coordinator in the plan."""
from __future__ import annotations

import asyncio

import pytest

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.local import load_engine, run_to_completion
from hyrax.actors.engine.request import SamplingParams
from pd_harness import assert_all_clean, pd_deployed, stats, stats_delta
from ray_harness import DEMO_MODEL, prompt, uid

pytestmark = pytest.mark.timeout(300)

LENGTHS = [12, 45, 90, 300]
PENALTIES = dict(temperature=1.0, top_k=40, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3,
                 logit_bias=((65, 2.0), (70, -3.0)), min_tokens=4, ignore_eos=True)
PARAMS = [dict(max_tokens=16 + i, seed=700 + i, **PENALTIES) for i in range(len(LENGTHS))]


def _single_process(prompts, params) -> list[list[int]]:
    engine = load_engine(DEMO_MODEL, EngineConfig(deterministic=True))
    ids = [engine.add_request(p, SamplingParams(**kw)) for p, kw in zip(prompts, params)]
    run_to_completion(engine)
    return [engine.finished_requests[i].output_ids for i in ids]


async def _stream(client, prompts, params) -> list[list[int]]:
    async def one(p, kw):
        tokens = []
        async for item in client.generate(uid("pen"), p, kw):
            assert not item.get("error"), item
            tokens += item.get("token_ids", [])
        return tokens

    return list(await asyncio.gather(*(one(p, kw) for p, kw in zip(prompts, params))))


def test_penalised_seeded_requests_over_pd_with_forced_retraction_equal_the_single_process_run(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    prompts = [prompt(n, seed=1900 + n) for n in LENGTHS]
    want = _single_process(prompts, PARAMS)
    plain = _single_process(prompts, [{k: v for k, v in kw.items() if k in ("max_tokens", "seed", "temperature",
                                                                          "top_k", "ignore_eos")} for kw in PARAMS])
    assert want != plain, "the penalties change nothing here: the test could not fail"
    config = EngineConfig(deterministic=True, forced_retraction_interval=3)
    with pd_deployed([RoleSpec("prefill", 1, 1), RoleSpec("decode", 1, 2)], config) as (d, client):
        before = stats(d, "decode")
        got = asyncio.run(asyncio.wait_for(_stream(client, prompts, PARAMS), 180))
        assert got == want
        dd = stats_delta(before, stats(d, "decode"))
        assert dd["transfers_in"].get("verified") == len(prompts), dd["transfers_in"]
        assert dd["retractions"] > 0, dd
        assert_all_clean(d)
