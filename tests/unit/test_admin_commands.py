"""Admin commands are typed values dispatched by type (hyrax/actors/engine/commands.py): each
reaches the one loop method that carries it out, through the in-process backend as through
the loop, and a method name is not a command."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine_helpers import HYBRID, HYBRID_COMPONENTS, assert_idle_clean, make_engine, tiny_model
from hyrax.actors.engine.commands import (Abort, ListRequests, Load, MigrateOut, Pools, Resume, Retract,
                                          SetForcedRetraction, Stats)
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.engine.selection import Selection
from hyrax.api.client import EngineClient, LocalBackend, ModelInfo


def _running(loop: EngineLoop, ids: list[str]) -> None:
    """Step until every request of `ids` runs (prefill done); polls, asserts nothing about time."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        states = {r["id"]: r["state"] for r in loop.run(ListRequests())}
        if all(states.get(i) == "running" for i in ids):
            return
        time.sleep(0.01)
    raise AssertionError(f"requests never ran: {states}")


@pytest.fixture
def loop_with_two():
    engine = make_engine(tiny_model(HYBRID))
    loop = EngineLoop(engine, "commands")
    long = SamplingParams(max_tokens=400, ignore_eos=True)  # still running while the test holds the lock
    with loop.lock:
        ids = [engine.add_request([1, 2, 3, 4, 5], long), engine.add_request([6, 7, 8], long)]
    loop.wake.set()
    _running(loop, ids)
    try:
        yield loop, ids
    finally:
        for rid in ids:
            loop.run(Abort(rid))
        loop.shutdown()
        assert_idle_clean(engine)


def test_each_command_type_reaches_its_own_effect(loop_with_two):
    loop, (a, b) = loop_with_two
    with loop.lock:  # no step runs meanwhile: every answer below is about this one state
        assert loop.run(Retract(Selection(ids=(a,)), mode="host_pool", hold=True)) == {a: Outcome.HOST_POOL}
        listed = {r["id"]: r for r in loop.run(ListRequests())}
        assert (listed[a]["state"], listed[a]["hold"], listed[b]["state"]) == ("retracted", True, "running")
        assert listed[a]["backup"]["components"].keys() == set(HYBRID_COMPONENTS)
        assert loop.run(Load()) == 2
        assert loop.run(Pools())["mamba_ssm"]["host_used"] == 1
        assert loop.run(Stats())["retracted"] == 1
        assert loop.run(Resume(Selection(ids=(a,)))) == {a: Outcome.VERIFIED}
        assert loop.run(Retract(Selection(ids=("nope",)))) == {"nope": Outcome.UNKNOWN}
        assert loop.run(SetForcedRetraction(5)) == 5 and loop.engine.forced_interval == 5
        assert loop.run(SetForcedRetraction(0)) == 0 and loop.engine.forced_interval == 0
        assert loop.run(MigrateOut(a)) is False  # no stream here to hand it to
        assert loop.run(Abort(b)) is True and loop.run(Abort(b)) is False
        assert [r["id"] for r in loop.run(ListRequests())] == [a]


def test_a_method_name_is_not_a_command(loop_with_two):
    loop, _ = loop_with_two
    for not_a_command in ("list_requests", ("retract", Selection(all=True)), Selection(all=True)):
        with pytest.raises(TypeError):
            loop.run(not_a_command)


def test_the_client_sends_commands_through_the_in_process_backend(loop_with_two):
    loop, (a, b) = loop_with_two
    info = ModelInfo("tiny", 512, tokenizer=None, chat_template=None, vocab_size=96)
    client = EngineClient(info, [LocalBackend(loop)])
    with loop.lock:
        got = asyncio.run(client.retract(Retract(Selection(count=1), mode="cpu_tensor", hold=True)))
        assert list(got.values()) == [Outcome.CPU_TENSOR]
        (victim,) = got
        assert {r["id"]: r["state"] for r in asyncio.run(client.list_requests())}[victim] == "retracted"
        assert asyncio.run(client.resume(Resume(Selection(all=True)))) == {victim: Outcome.VERIFIED}
        asyncio.run(client.set_forced_retraction(7))
        assert loop.engine.forced_interval == 7
        asyncio.run(client.set_forced_retraction(0))


def test_a_gateway_retracts_and_resumes_by_id_a_request_another_gateway_streams(loop_with_two):
    """Several gateways serve one deployment and each lists every replica's requests
    (/admin/requests), but retract and resume by id went only to the replica this gateway
    streams the request from: for a request another gateway streams it answered 'unknown request'
    (a 404), while `all` retracted it. The replica owns the request and keeps streaming it to its
    own gateway whoever asked, so every replica is asked for an id this gateway does not stream."""
    loop, (a, b) = loop_with_two  # streamed by nobody here: this client is the other gateway
    info = ModelInfo("tiny", 512, tokenizer=None, chat_template=None, vocab_size=96)
    other = EngineClient(info, [LocalBackend(loop)])
    with loop.lock:
        got = asyncio.run(other.retract(Retract(Selection(ids=(a, "nope")), mode="cpu_tensor", hold=True)))
        assert got == {a: Outcome.CPU_TENSOR, "nope": Outcome.UNKNOWN}
        assert {r["id"]: (r["state"], r["hold"]) for r in loop.run(ListRequests())}[a] == ("retracted", True)
        assert asyncio.run(other.resume(Resume(Selection(ids=(a,))))) == {a: Outcome.VERIFIED}
