"""Retraction across the two ranks of a TP=2 replica, with cpu_tensor and host_pool backups:
forced retraction every 3 steps leaves greedy outputs unchanged and every restore is
verified; a held retraction's manifest carries checksums from both ranks; a resumed
request whose old slot went to another request continues exactly."""
from __future__ import annotations

import pytest

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.selection import Selection
from hyrax.actors.engine.commands import Resume, Retract, SetForcedRetraction
from ray_harness import (DEMO_CONFIG, DEMO_MODEL, Stream, assert_clean, assert_manifest_from_every_rank, call,
                         deployed, prompt, rank_backups, reference, replica, request_info, run_all, stats_delta,
                         uid)

pytestmark = pytest.mark.timeout(300)

HOST_POOL_CONFIG = EngineConfig(deterministic=True, retraction_backup="host_pool", host_pool_mb=8,
                                forced_retraction_interval=3)
DEMO_COMPONENTS = ["full_kv", "swa_kv", "mamba_conv", "mamba_ssm"]


@pytest.fixture(scope="module")
def host_pool_deployment(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    with deployed(DEMO_MODEL, [RoleSpec("hostpool-tp2", 1, 2)], HOST_POOL_CONFIG) as d:
        yield d


@pytest.fixture(params=["cpu_tensor", "host_pool"])
def tp2_forced(request):
    """(backup mode, TP=2 coordinator retracting one request every 3 steps)."""
    if request.param == "cpu_tensor":
        coord = request.getfixturevalue("demo_tp2")
        call(coord.run, SetForcedRetraction(3))
    else:
        coord = replica(request.getfixturevalue("host_pool_deployment"), "hostpool-tp2").coordinator
    return request.param, coord


def test_forced_retraction_every_3_steps_keeps_tp2_outputs_and_verifies_restores(tp2_forced):
    mode, coord = tp2_forced
    lengths, max_tokens = [6, 20, 70, 33], [24, 18, 20, 22]
    prompts = [prompt(n, seed=300 + n) for n in lengths]
    want = reference(DEMO_MODEL, DEMO_CONFIG, prompts, max_tokens)
    before = call(coord.stats)
    streams = run_all(coord, prompts, max_tokens, prefix=f"forced-{mode}-")
    d = stats_delta(before, call(coord.stats))
    assert [s.tokens for s in streams] == want
    assert [s.finish_reason for s in streams] == ["length"] * len(prompts)
    assert d["retractions_by"].get(f"forced/{mode}", 0) > 0, d
    assert d["retractions_by"].get("forced/recompute", 0) == 0, d
    assert d["restores_by"].get("verified", 0) > 0, d
    assert d["restores_by"].get("verified", 0) == d["retractions"], d
    assert d["restore_fallbacks"] == 0 and d["checksum_failures"] == 0, d
    assert_clean(coord)


def test_held_retraction_manifest_has_checksums_from_both_ranks_and_resume_matches(tp2_forced):
    mode, coord = tp2_forced
    p = prompt(40, seed=401)
    want = reference(DEMO_MODEL, DEMO_CONFIG, [p], 60)[0]
    before = call(coord.stats)
    s = Stream(coord, uid(f"held-{mode}"), p, 60)
    s.wait_tokens(3)
    assert call(coord.run, Retract(Selection(ids=(s.id,)), hold=True)) == {s.id: mode}
    info = request_info(coord, s.id)
    assert info["state"] == "retracted" and info["hold"] is True
    assert info["indices"] == {}  # device indices are freed once every rank acknowledged
    m = info["backup"]
    assert m["mode"] == mode and m["num_tokens"] == info["computed_tokens"] > len(p)
    assert_manifest_from_every_rank(m, DEMO_COMPONENTS, tp=2)
    # cpu_tensor: each rank keeps its shard in fresh host tensors; host_pool: in its host pool
    assert rank_backups(coord) == ([1, 1] if mode == "cpu_tensor" else [0, 0])
    assert call(coord.pools)["components"]["mamba_ssm"]["host_used"] == (mode == "host_pool")
    assert call(coord.check_invariants) is True
    held_at = len(s.tokens)
    assert call(coord.run, Resume(Selection(ids=(s.id,)))) == {s.id: "verified"}
    s.wait_done()
    assert held_at < len(s.tokens)
    assert s.tokens == want
    d = stats_delta(before, call(coord.stats))
    assert d["restores_by"].get("verified", 0) >= 1 and d["restore_fallbacks"] == 0, d
    assert_clean(coord)


def test_restore_after_slot_reuse_across_ranks_matches_uninterrupted_run(demo_tp2):
    """A is retracted (held); B takes A's freed slot and pages on both ranks; A resumes
    into new indices and continues exactly as if it had never stopped."""
    coord = demo_tp2
    pa, pb = prompt(30, seed=501), prompt(25, seed=502)
    want_a, want_b = reference(DEMO_MODEL, DEMO_CONFIG, [pa, pb], [40, 80])
    a = Stream(coord, uid("slot-A"), pa, 40)
    a.wait_tokens(3)
    assert call(coord.run, Retract(Selection(ids=(a.id,)), hold=True)) == {a.id: "cpu_tensor"}
    old = request_info(coord, a.id)["backup"]["components"]
    old_slot = {n: old[n]["indices"] for n in ("mamba_conv", "mamba_ssm")}

    b = Stream(coord, uid("slot-B"), pb, 80)
    b.wait_tokens(2)
    b_idx = request_info(coord, b.id)["indices"]
    # B now owns A's old slot, and A's old pages (LIFO free lists hand them out first)
    assert {n: b_idx[n] for n in old_slot} == old_slot
    for n in ("full_kv", "swa_kv"):
        assert set(b_idx[n]) & set(old[n]["indices"]), (n, b_idx[n], old[n]["indices"])

    assert not b.done, "B finished before A could be resumed beside it"
    assert call(coord.run, Resume(Selection(ids=(a.id,)))) == {a.id: "verified"}
    a_idx = request_info(coord, a.id)["indices"]
    for n in old_slot:
        assert a_idx[n] != old_slot[n], (n, a_idx[n], old_slot[n])
    assert call(coord.check_invariants) is True
    a.wait_done()
    b.wait_done()
    assert a.tokens == want_a
    assert b.tokens == want_b
    assert_clean(coord)


def test_json_schema_answers_validate_on_a_tp2_replica_over_ray_under_forced_retraction(demo_tp2):
    """Structured output on a TP=2 replica: rank 0 masks, both ranks take the broadcast token, and
    the grammar is rebuilt after every forced retraction; every answer over HTTP validates."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    from gateway_harness import HTTP, Gateway
    from hyrax.api.app import GatewaySettings, create_app
    from hyrax.api.client import EngineClient
    from hyrax.cluster.ray_client import RayBackend, model_info

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4},
                                               "sunny": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
              "required": ["city", "sunny", "level"], "additionalProperties": False}
    coord = demo_tp2
    call(coord.run, SetForcedRetraction(3))
    before = call(coord.stats)
    client = EngineClient(model_info(DEMO_MODEL, "hyrax-demo"), [RayBackend(coord, "colocated", 0)])
    gw = Gateway(create_app(client, GatewaySettings(admin_token="tp2-admin")))
    try:
        def ask(k: int) -> dict:
            r = HTTP.post(f"{gw.url}/v1/chat/completions", timeout=240, json={
                "model": "hyrax-demo", "messages": [{"role": "user", "content": f"weather {k}"}], "max_tokens": 60,
                "temperature": 1.0, "seed": k, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        with ThreadPoolExecutor(4) as pool:  # one wave: every answer decodes beside the others
            answers = list(pool.map(ask, range(4)))
    finally:
        gw.close()
    for a in answers:
        assert a["finish_reason"] == "stop", a
        jsonschema.validate(json.loads(a["message"]["content"]), schema)
    d = stats_delta(before, call(coord.stats))
    assert d["retractions"] > 0 and d["restore_fallbacks"] == 0 and d["checksum_failures"] == 0, d
    assert_clean(coord)
