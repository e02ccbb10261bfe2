"""Forced retraction during a PD run: every third step a request is retracted on each
replica (prefill and decode), backed up on every rank, and restored verified.

- Greedy outputs stay equal to the single-process engine's, token for token.
- Penalties, logit_bias and min_tokens (issue 19): seeded sampled requests prefilled on one
  replica, handed to the TP=2 decode replica and retracted there draw exactly the tokens of
  the uninterrupted single-process engine. The decode ranks never saw the prompt: the
  penalties' token history comes from the coordinator in the plan.

Both run on one deployment (prefill TP=1, decode TP=2, forced retraction every 3 steps);
each test leaves every replica clean, and counts only its own stats deltas."""
from __future__ import annotations

import asyncio

import pytest

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.local import load_engine, run_to_completion
from hyrax.actors.engine.request import SamplingParams
from pd_harness import Run, assert_all_clean, assert_outputs, drive, pd_deployed, stats, stats_delta
from ray_harness import DEMO_MODEL, prompt, reference, uid

pytestmark = pytest.mark.timeout(300)

CONFIG = EngineConfig(deterministic=True, forced_retraction_interval=3)
# 300 and 520 exceed the prefill chunk (256): their prompts take several steps on the prefill
# replica, so forced retraction can strike there mid-prompt too
LENGTHS = [10, 40, 70, 150, 300, 520]
MAX = [24, 20, 28, 16, 22, 18]

PENALTY_LENGTHS = [12, 45, 90, 300]
PENALTIES = dict(temperature=1.0, top_k=40, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3,
                 logit_bias=((65, 2.0), (70, -3.0)), min_tokens=4, ignore_eos=True)
PENALTY_PARAMS = [dict(max_tokens=16 + i, seed=700 + i, **PENALTIES) for i in range(len(PENALTY_LENGTHS))]


@pytest.fixture(scope="module")
def forced_pd(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    with pd_deployed([RoleSpec("prefill", 1, 1), RoleSpec("decode", 1, 2)], CONFIG) as (d, client):
        yield d, client


def test_pd_forced_retraction_on_decode_keeps_outputs_and_restores_verified(forced_pd):
    d, client = forced_pd
    prompts = [prompt(n, seed=1200 + n) for n in LENGTHS]
    want = reference(DEMO_MODEL, CONFIG, prompts, MAX)
    before = stats(d, "decode")
    runs = drive(client, [Run(uid(f"forced-{i}"), p, m) for i, (p, m) in enumerate(zip(prompts, MAX))])
    assert_outputs(runs, want)
    dd = stats_delta(before, stats(d, "decode"))
    assert dd["transfers_in"].get("verified") == len(runs), dd["transfers_in"]
    assert dd["retractions"] > 0, dd
    assert dd["retractions_by"].get("forced/cpu_tensor", 0) == dd["retractions"], dd["retractions_by"]
    # every retraction came back verified: nothing was rebuilt, no checksum failed
    # (PD imports are counted as transfers, not restores)
    assert dd["restores"] == dd["retractions"], (dd["restores"], dd["retractions"])
    assert dd["restore_fallbacks"] == 0 and dd["checksum_failures"] == 0
    assert dd["bytes_restored"] and all(v > 0 for v in dd["bytes_restored"].values()), dd["bytes_restored"]
    assert_all_clean(d)


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


def test_penalised_seeded_requests_over_pd_with_forced_retraction_equal_the_single_process_run(forced_pd):
    d, client = forced_pd
    prompts = [prompt(n, seed=1900 + n) for n in PENALTY_LENGTHS]
    want = _single_process(prompts, PENALTY_PARAMS)
    plain = _single_process(prompts, [{k: v for k, v in kw.items() if k in ("max_tokens", "seed", "temperature",
                                                                          "top_k", "ignore_eos")}
                                      for kw in PENALTY_PARAMS])
    assert want != plain, "the penalties change nothing here: the test could not fail"
    before = stats(d, "decode")
    got = asyncio.run(asyncio.wait_for(_stream(client, prompts, PENALTY_PARAMS), 180))
    assert got == want
    dd = stats_delta(before, stats(d, "decode"))
    assert dd["transfers_in"].get("verified") == len(prompts), dd["transfers_in"]
    assert dd["retractions"] > 0, dd
    assert_all_clean(d)
