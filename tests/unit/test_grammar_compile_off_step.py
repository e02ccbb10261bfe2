"""A structured-output request's grammar is compiled by rank 0 in a thread of its own, and the
request waits (unscheduled) until it is: the rest of the batch runs on. Before, rank 0 compiled
inside the step that first sampled the request, so every request on the replica waited for it
(a large schema: seconds to minutes with the demo's vocabulary; see docs/api.md). Here the
compile of one grammar is held by the test (an Event) while the engine steps."""
from __future__ import annotations

import json
import threading

import pytest

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.grammar import GrammarSpec
from hyrax.actors.engine.grammar_gate import GrammarGate
from hyrax.actors.engine.local import load_engine, run_to_completion
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.model.errors import HyraxInputError
from test_grammar import DEMO, _params, _prompt, _tok, _valid

SLOW = GrammarSpec.json_schema({"type": "object", "properties": {"slow": {"enum": ["cat", "dog", "eel"]}},
                                "required": ["slow"], "additionalProperties": False})


@pytest.fixture
def held_compile(monkeypatch):
    """SLOW's compile waits for the returned Event (at most 20 s, then raises); others compile at once."""
    release, real = threading.Event(), GrammarSpec.compile

    def compile(spec, compiler):
        if spec == SLOW and not release.wait(20):
            raise RuntimeError("the test never released the compile")
        return real(spec, compiler)
    monkeypatch.setattr(GrammarSpec, "compile", compile)
    return release


def _engine(**config):
    return load_engine(DEMO, EngineConfig(deterministic=True, **config), decode=_tok().decode)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_batch_runs_on_while_a_grammar_compiles_and_the_request_then_answers_as_alone(held_compile, overlap):
    alone = _engine(overlap=overlap)
    rid = alone.add_request(_prompt(3), _params(3, SLOW))
    held_compile.set()
    run_to_completion(alone)
    want = alone.finished_requests[rid].output_ids
    held_compile.clear()

    e = _engine(overlap=overlap)
    plain = e.add_request(_prompt(1), SamplingParams(max_tokens=40, ignore_eos=True))
    slow = e.add_request(_prompt(3), _params(3, SLOW))
    for _ in range(12):  # the compile is held: the plain request decodes, the other waits its turn
        e.step()
    assert len(e.requests[plain].output_ids) >= 10, e.requests[plain].output_ids
    assert e.requests[slow].output_ids == [] and SLOW in e.grammars.pending
    held_compile.set()
    run_to_completion(e)
    assert e.finished_requests[slow].output_ids == want  # as if it had never waited
    assert json.loads(_tok().decode(want))["slow"] in ("cat", "dog", "eel")
    assert len(e.finished_requests[plain].output_ids) == 40
    assert e.is_idle_clean()


def test_a_grammar_rank_0_cannot_compile_ends_its_requests_not_the_batch(monkeypatch):
    real = GrammarSpec.compile

    def compile(spec, compiler):
        if spec == SLOW:
            raise RuntimeError("[12:00:00] compiler.cc:1: this vocabulary cannot express it")
        return real(spec, compiler)
    monkeypatch.setattr(GrammarSpec, "compile", compile)
    e = _engine(overlap=True)
    plain = e.add_request(_prompt(1), SamplingParams(max_tokens=20, ignore_eos=True))
    bad = e.add_request(_prompt(3), _params(3, SLOW))
    fine = e.add_request(_prompt(4), _params(4))
    run_to_completion(e)
    assert e.finished_requests[bad].finish_reason == "error" and e.finished_requests[bad].output_ids == []
    assert e.finished_requests[plain].finish_reason == "length"
    _valid(e.finished_requests[fine].output_ids)
    assert e.stats.step_errors == 0 and e.is_idle_clean()
    # the next request with that grammar is refused at once, naming why, instead of failing a step
    with pytest.raises(HyraxInputError, match="does not compile .* this vocabulary cannot express it"):
        e.add_request(_prompt(5), _params(5, SLOW))


def test_the_gate_asks_once_holds_until_compiled_and_asks_again_after_new_ranks():
    gate, a, b = GrammarGate(keep=2), GrammarSpec("json_object"), SLOW
    gate.want(a), gate.want(a), gate.want(None)
    assert gate.asks() == (a,) and gate.asks() == ()  # once
    assert gate.holds(a) and not gate.holds(None) and gate.pending == {a}
    gate.want(a)  # asked already: not again
    assert gate.asks() == ()
    gate.done([a])
    assert not gate.holds(a) and not gate.pending
    gate.want(b)
    gate.done(gate.asks())
    c = GrammarSpec("regex", "[a-z]")
    gate.want(c)
    gate.done(gate.asks())  # keeps two: a, the least recently used, goes
    assert gate.holds(a) and not gate.holds(b) and not gate.holds(c)
    assert gate.asks() == (a,)  # a request still holding it has it asked for again: it never waits for good
    gate.done([a])

    class Req:
        def __init__(self, spec):
            self.params = SamplingParams(grammar=spec)
    gate.reset([Req(b), Req(None)])  # new ranks have compiled nothing: the live requests' grammars are asked again
    assert gate.asks() == (b,) and gate.holds(b)
    assert gate.holds(c) and gate.asks() == (c,)  # and any other a request turns out to need


def test_a_compile_leaves_the_steps_a_cpu():
    from hyrax.actors.engine.grammar import compile_threads

    assert [compile_threads(n) for n in (1, 2, 4, 16, 64)] == [1, 1, 1, 7, 8]


def test_a_long_compile_does_not_hold_up_another_requests_grammar(held_compile):
    """One client's huge schema (a compile of minutes) must not stall every other structured
    request on the replica behind it: compiles run side by side, not one at a time."""
    e = _engine(overlap=True)
    slow = e.add_request(_prompt(3), _params(3, SLOW))  # asked first
    other = e.add_request(_prompt(4), _params(4))
    for _ in range(400):
        if other in e.finished_requests:
            break
        e.step()
    assert other in e.finished_requests, "the second grammar waited for the first one's compile"
    _valid(e.finished_requests[other].output_ids)
    assert e.requests[slow].output_ids == [] and SLOW in e.grammars.pending
    held_compile.set()
    run_to_completion(e)
    assert json.loads(_tok().decode(e.finished_requests[slow].output_ids))["slow"] in ("cat", "dog", "eel")
    assert e.is_idle_clean()


def test_compiles_run_side_by_side_up_to_the_bound():
    from hyrax.actors.engine.grammar import _Workers

    pool, gate = _Workers("test-compile", size=2), threading.Event()
    running: list[int] = []

    def hold(k):
        running.append(k)
        assert gate.wait(20)
        return k
    futures = [pool.submit(hold, k) for k in range(3)]
    for _ in range(200):
        if len(running) == 2:
            break
        threading.Event().wait(0.01)
    assert sorted(running) == [0, 1] and not futures[2].running()  # two at once, the third waits its turn
    gate.set()
    assert [f.result(timeout=20) for f in futures] == [0, 1, 2]
    assert pool._threads == 2


def test_a_long_compile_does_not_keep_rank_0_from_letting_go_of_older_grammars(held_compile, monkeypatch):
    """Rank 0 keeps COMPILED_KEPT grammars, the least recently used going first; it stopped at
    the oldest compile still running, so while one ran for minutes (the others now finish beside
    it) every grammar compiled meanwhile was kept."""
    from hyrax.actors.engine import grammar
    from hyrax.actors.model.config import ModelConfig

    monkeypatch.setattr(grammar, "COMPILED_KEPT", 2)
    cfg = ModelConfig.from_dir(DEMO)
    masks = grammar.GrammarMasks(DEMO, cfg.vocab_size, [cfg.vocab_size - 1])
    masks.prepare([SLOW])  # held: never done in this test
    quick = [GrammarSpec("regex", f"[a-z]{{{k}}}") for k in range(1, 6)]
    for spec in quick:
        masks.prepare([spec])
        masks._compiled[spec].result(timeout=20)
    masks.prepare([])  # a later plan trims again
    assert SLOW in masks._compiled and len(masks._compiled) <= 3, list(masks._compiled)
    assert quick[-1] in masks._compiled  # the newest stays
    held_compile.set()
