"""A request migrated away and back to the same replica (a live migration there and home
again, a drain undone): the id is new to the replica's ranks a second time. What the ranks
kept for its first stay (its last sampled token, its grammar matcher) is dropped before its
second stay starts, never during it: with overlap scheduling the step after an import refers
to the token the step before it sampled, and the CI found that token forgotten (a KeyError on
the rank, the request ended with `error`) when the first stay's departure was announced in the
same plan that ran the request again."""
from __future__ import annotations

import pytest

from engine_helpers import HYBRID, assert_idle_clean, greedy, make_engine, make_prompts, run_requests, tiny_model
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.request import State

MAX_TOKENS = 24


def _decode_until(engine, rid, n):
    while len(engine.requests[rid].output_ids) < n:
        engine.step()


def _move(src, dst, rid):
    handoff = src.export_running(rid)
    assert handoff is not None
    assert dst.import_request(handoff) == Outcome.VERIFIED
    assert src.release_handoff(rid)  # the importer's acknowledgement


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_request_migrated_away_and_back_continues_as_if_it_never_moved(deterministic):
    model = tiny_model(HYBRID)
    prompt = make_prompts(1, seed=31)[0]
    want = run_requests(make_engine(model), [prompt], greedy(max_tokens=MAX_TOKENS))
    home, away = (make_engine(model, overlap=True, deterministic=deterministic) for _ in range(2))
    rid = home.add_request(prompt, greedy(max_tokens=MAX_TOKENS))
    _decode_until(home, rid, 4)
    _move(home, away, rid)  # home runs no step after this: its departure is not yet told to its ranks
    _decode_until(away, rid, 8)
    _move(away, home, rid)
    while home.has_unfinished() or home.has_inflight():
        home.step()
    assert home.stats.step_errors == 0, home.recovery.last_step_error
    assert home.stats.finished == {"length": 1}
    out = home.finished_requests[rid]
    assert out.output_ids == want[0], "the request's tokens differ from the uninterrupted run"
    for e in (home, away):
        e.finished_requests.clear()
        assert_idle_clean(e)
    assert away.requests.get(rid) is None or away.requests[rid].state == State.FINISHED


def test_a_prefill_replica_refuses_a_request_that_is_decoding():
    """A prefill replica never decodes: a request imported there after its first token sat
    running with no progress, holding its state (found by an attack session through an
    admin migrate with an explicit target). The import is refused and nothing is taken."""
    from hyrax.actors.model.errors import HyraxInputError

    model = tiny_model(HYBRID)
    src, prefill = make_engine(model), make_engine(model, role="prefill")
    rid = src.add_request(make_prompts(1, seed=5)[0], greedy(max_tokens=MAX_TOKENS))
    _decode_until(src, rid, 3)
    handoff = src.export_running(rid)
    with pytest.raises(HyraxInputError, match="prefill replica"):
        prefill.import_request(handoff)
    assert not prefill.has_unfinished() and rid not in prefill.requests
    assert_idle_clean(prefill)


def test_an_import_that_can_never_fit_this_replicas_pools_is_refused_and_the_replica_serves_on():
    """Replicas' pools need not be the same size (sized from each device's memory). A request
    handed over with more state than this replica's pools can ever hold waited retracted for
    room that never came, and while it waited the replica admitted nothing: every later request
    queued for good. The import is refused (the source keeps its offer until its lease ends)."""
    from hyrax.actors.model.errors import HyraxInputError

    model = tiny_model(HYBRID)
    src, small = make_engine(model, role="prefill"), make_engine(model, role="decode", kv_capacity_tokens=32)
    rid = src.add_request(make_prompts(1, seed=3, lo=40, hi=40)[0], greedy(max_tokens=4))  # 11 pages; 8 here
    handoffs = []
    while not handoffs:
        handoffs += [o.handoff for o in src.step() if o.handoff is not None]
    with pytest.raises(HyraxInputError, match="full_kv"):
        small.import_request(handoffs[0])
    assert rid not in small.requests
    assert run_requests(small, [[1, 2, 3]], greedy(max_tokens=2))  # it still serves what fits
    assert src.abort(rid)
    assert_idle_clean(src)
