"""Structured output at engine level, with the demo checkpoint's tokenizer: answers match their
grammar, and the grammar matcher's state is request state: a request that is retracted (every
backup mode, with and without overlap) or migrated to another engine continues the same
grammar, token for token as if it had never moved."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import pytest

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.grammar import GrammarMasks, GrammarSpec, _Matcher
from hyrax.actors.engine.local import load_engine, run_to_completion
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.tokenizer import load_tokenizer

DEMO = str(Path(__file__).resolve().parents[2] / "hyrax" / "models" / "demo")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"},
                   "kind": {"enum": ["cat", "dog", "eel"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["name", "ok", "kind", "tags"],
    "additionalProperties": False,
}
N = 6


@functools.lru_cache(maxsize=None)
def _tok():
    return load_tokenizer(DEMO, 264)


def _engine(**config):
    return load_engine(DEMO, EngineConfig(deterministic=True, **config), decode=_tok().decode)


def _params(k: int, spec: GrammarSpec = GrammarSpec.json_schema(SCHEMA)) -> SamplingParams:
    return SamplingParams(max_tokens=100, temperature=1.0, seed=k, grammar=spec)


def _prompt(k: int) -> list[int]:
    return _tok().encode(f"Record {k}: ")


def _run(engine) -> list[list[int]]:
    ids = [engine.add_request(_prompt(k), _params(k)) for k in range(N)]
    run_to_completion(engine)
    return [engine.finished_requests[r].output_ids for r in ids]


@functools.lru_cache(maxsize=None)
def _baseline() -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(out) for out in _run(_engine()))


def _valid(out) -> None:
    jsonschema.validate(json.loads(_tok().decode(list(out))), SCHEMA)


def test_json_schema_answers_parse_validate_and_end_with_stop():
    e = _engine()
    ids = [e.add_request(_prompt(k), _params(k)) for k in range(N)]
    ids.append(e.add_request(_prompt(9), _params(9, GrammarSpec.choice(["red", "green", "blue"]))))
    ids.append(e.add_request(_prompt(9), _params(9, GrammarSpec("regex", r"[a-z]{3}-[0-9]{2}"))))
    ids.append(e.add_request(_prompt(9), _params(9, GrammarSpec("json_object"))))
    run_to_completion(e)
    reqs = [e.finished_requests[r] for r in ids]
    assert all(r.finish_reason == "stop" for r in reqs[:-1]), [r.finish_reason for r in reqs]
    for r in reqs[:N]:
        _valid(r.output_ids)
    assert reqs[N].text in ("red", "green", "blue")
    assert len(reqs[N + 1].text) == 6 and reqs[N + 1].text[3] == "-"
    if reqs[-1].finish_reason == "stop":  # a free-form object may run out of tokens
        assert isinstance(json.loads(reqs[-1].text), dict)
    # the test can fail: unconstrained, the demo model does not write JSON
    free = _engine()
    rid = free.add_request(_prompt(0), SamplingParams(max_tokens=40, temperature=1.0, seed=0))
    run_to_completion(free)
    with pytest.raises(ValueError):
        json.loads(free.finished_requests[rid].text)


@pytest.mark.parametrize("mode,overlap", [("cpu_tensor", False), ("host_pool", True), ("recompute", True)])
def test_retracted_requests_continue_their_grammar(mode, overlap):
    e = _engine(forced_retraction_interval=3, retraction_backup=mode, overlap=overlap)
    got = _run(e)
    s = e.stats.summary()
    assert s["retractions"] >= 3, s
    assert tuple(map(tuple, got)) == _baseline()
    for out in got:
        _valid(out)


def _migrate(after: int) -> tuple[list[int], int]:
    """Run request 0 on engine A for `after` tokens, move it to engine B, finish it there."""
    a, b = _engine(overlap=True), _engine()
    rid = a.add_request(_prompt(0), _params(0))
    while len(a.requests[rid].output_ids) < after:
        a.step()
    handoff = a.export_running(rid)
    assert handoff is not None
    b.import_request(handoff)
    assert a.release_handoff(rid)
    run_to_completion(a)
    run_to_completion(b)
    return b.finished_requests[rid].output_ids, b.executor.rank.grammars.rebuilt


def test_migrated_request_continues_its_grammar_on_another_engine():
    out, rebuilt = _migrate(after=7)
    assert rebuilt == 1  # engine B built the matcher from the tokens the request carried
    assert tuple(out) == _baseline()[0]
    _valid(out)


def test_mutation_a_matcher_rebuilt_without_replaying_the_outputs_is_noticed(monkeypatch):
    real = GrammarMasks._matcher

    def forgetful(self, rid, step, outputs):
        if rid not in self.matchers and outputs:  # the bug: a fresh matcher, told it consumed them
            import xgrammar as xgr

            m = _Matcher(step.spec, xgr.GrammarMatcher(step.spec.compile(self._compiler)))
            m.consumed = list(outputs)
            self.matchers[rid] = m
        return real(self, rid, step, outputs)

    monkeypatch.setattr(GrammarMasks, "_matcher", forgetful)
    out, _ = _migrate(after=7)
    assert tuple(out) != _baseline()[0]


@pytest.mark.parametrize("spec,params,needle", [
    (GrammarSpec("json_schema", '{"type": "objectx"}'), {}, "invalid json_schema"),
    (GrammarSpec("regex", "[a-"), {}, "invalid regex"),
    (GrammarSpec.choice([]), {}, "choice must be"),
    (GrammarSpec("json_object"), {"ignore_eos": True}, "ignore_eos"),
    (GrammarSpec("json_object"), {"min_tokens": 2}, "min_tokens"),
])
def test_bad_grammars_are_refused_naming_the_problem(spec, params, needle):
    with pytest.raises(HyraxInputError, match=needle):
        SamplingParams(grammar=spec, **params).validate(264)
