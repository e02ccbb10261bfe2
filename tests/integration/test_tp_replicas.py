"""TP=1 and TP=2 Ray replicas produce the single-process engine's greedy outputs token for
token (deterministic mode), for the SWA+Mamba2 and full+SWA+Mamba2 layouts, with several
concurrent requests whose prompts cross pages, the sliding window and prefill chunks."""
from __future__ import annotations

import pytest

from ray_harness import DEMO_CONFIG, DEMO_MODEL, SWA_CONFIG, assert_clean, call, deployed, prompt, reference, replica, run_all

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def swa_deployment(ray_session, swa_mamba_model):
    from hyrax.cluster.deployment import RoleSpec

    with deployed(swa_mamba_model, [RoleSpec("swa-tp1", 1, 1), RoleSpec("swa-tp2", 1, 2)], SWA_CONFIG) as d:
        yield d


# (prompt lengths, max_tokens) per layout. SWA layout: page 4, window 8, prefill chunk 16.
# Demo layout: page 16, window 64, prefill chunk 256.
SWA_LENGTHS, SWA_MAX = [3, 9, 21, 45], [20, 14, 18, 12]
DEMO_LENGTHS, DEMO_MAX = [5, 17, 90, 300], [16, 20, 12, 10]


@pytest.mark.parametrize("tp", [1, 2])
def test_swa_mamba_replica_greedy_output_equals_single_process_engine(swa_deployment, swa_mamba_model, tp):
    coord = replica(swa_deployment, f"swa-tp{tp}").coordinator
    prompts = [prompt(n, seed=100 + n) for n in SWA_LENGTHS]
    want = reference(swa_mamba_model, SWA_CONFIG, prompts, SWA_MAX)
    streams = run_all(coord, prompts, SWA_MAX, prefix=f"swa-tp{tp}-")
    assert [s.finish_reason for s in streams] == ["length"] * len(prompts)
    assert [s.tokens for s in streams] == want
    assert_clean(coord)
    assert call(coord.health)["step_path"] == "compiled graph"  # the default of `hyrax serve`


@pytest.mark.parametrize("tp", [1, 2])
def test_full_swa_mamba_replica_greedy_output_equals_single_process_engine(demo_deployment, tp):
    coord = replica(demo_deployment, f"tp{tp}").coordinator
    prompts = [prompt(n, seed=200 + n) for n in DEMO_LENGTHS]
    want = reference(DEMO_MODEL, DEMO_CONFIG, prompts, DEMO_MAX)
    streams = run_all(coord, prompts, DEMO_MAX, prefix=f"demo-tp{tp}-")
    assert [s.finish_reason for s in streams] == ["length"] * len(prompts)
    assert [s.tokens for s in streams] == want
    assert_clean(coord)
