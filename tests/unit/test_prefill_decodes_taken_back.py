"""A prefill replica that took back its hand-off (no decode replica took it) decodes that request
to its end, whatever happens to the request's state meanwhile.

Rebuilt by prefill from its tokens (a retraction in recompute mode, or the replica's ranks lost
and rebuilt), the request waits first in line with its generated tokens. The prefill replica's
rule "run a request only up to its first token" left it there for good: it never ran again, and
being first in line it kept every later prompt from being admitted too. It runs on now, and every
stream ends as the uninterrupted run.

Real engine loops in process (LocalBackend): prefill x1 + decode x1 and one engine client, as in
test_migrate_take_back.py; a lost rank as test_loop_rank_failures.py makes one.
"""
from __future__ import annotations

import asyncio

from engine_helpers import HYBRID, make_engine, tiny_model
from hyrax.actors.engine.commands import Retract, Stats
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine.selection import Selection
from hyrax.api.client import EngineClient, LocalBackend
from test_loop_rank_failures import LostRank
from test_migrate_take_back import INFO, Stream, _settled, _uninterrupted


class PrefillAndDecode:
    """prefill/0 (whose rank can be lost and is replaced, as the coordinator replaces it) and
    decode/0, and a client; decode/0 starts out of service, so each hand-off is taken back."""

    def __init__(self):
        model = tiny_model(HYBRID)
        self.prefill = make_engine(model, prefix_cache=True, role="prefill")
        self.rank = LostRank(self.prefill.executor)
        self.recoveries = 0
        self.loops = [EngineLoop(self.prefill, "prefill", on_rank_failure=self._recover),
                      EngineLoop(make_engine(model, prefix_cache=False, role="decode"), "decode")]
        self.client = EngineClient(INFO, [LocalBackend(self.loops[0], "prefill", 0),
                                          LocalBackend(self.loops[1], "decode", 0)], cache_route_margin=None)
        self.decode = self.client.find_backend("decode", 0)
        self.client._refused(self.decode, {"error": "its health check failed"})

    def _recover(self, err: Exception) -> None:
        self.recoveries += 1
        self.rank.restart()
        self.prefill.reset_for_recovery()

    def lose_rank_before_the_offer_comes_back(self, and_in_the_import: bool = False) -> None:
        """The prefill rank is lost and replaced (its offers let go) just before the gateway brings
        a hand-off back; `and_in_the_import`: the new rank is lost too, found by the import."""
        prefill = self.client.find_backend("prefill", 0)
        bring_back = prefill.generate_imported

        def lost_meanwhile(handoff):
            with self.loops[0].lock:
                self._recover(RuntimeError("the rank was lost after its offer"))
                if and_in_the_import:
                    self.rank.die()
            return bring_back(handoff)
        prefill.generate_imported = lost_meanwhile

    def decode_back_in_service(self) -> None:
        self.client.out_of_service.pop(id(self.decode))  # its next health check found it well

    def stats(self, k: int) -> dict:
        return self.loops[k].run(Stats())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            _settled(self.loops)
        for loop in self.loops:
            loop.shutdown()


def _taken_back(pd: PrefillAndDecode, *rids: str) -> list[Stream]:
    streams = [Stream(pd.client, rid) for rid in rids]
    for s in streams:
        s.wait_tokens(5)
        assert pd.client.owner[s.rid].role == "prefill"
    return streams


def test_a_taken_back_request_retracted_for_recompute_decodes_on_and_later_prompts_go_to_decode():
    """q1 is retracted in recompute mode while q2 decodes beside it; then decode/0 is back and q3
    arrives: q3 is handed off as usual, q1 and q2 end at the prefill replica. Before, q1 waited for
    good after it was rebuilt, and q3 waited behind it."""
    want = _uninterrupted()
    with PrefillAndDecode() as pd:
        s1, s2 = _taken_back(pd, "q1", "q2")
        got = asyncio.run(pd.client.retract(Retract(Selection(ids=("q1",)), mode="recompute")))
        assert got == {"q1": Outcome.RECOMPUTE}, got
        pd.decode_back_in_service()
        s3 = Stream(pd.client, "q3")
        assert [s.finish() for s in (s1, s2, s3)] == [want] * 3
        prefill = pd.stats(0)
        assert prefill["offers_taken_back"] == 2 and prefill["transfers_out"] == 1, prefill
        assert pd.stats(1)["transfers_in"] == {"verified": 1}


def test_a_taken_back_request_decodes_on_after_the_prefill_replicas_rank_is_lost():
    """The prefill replica's rank is lost while it decodes two requests it took back: it is
    replaced, both are rebuilt from their tokens and go on there to their ends, each stream
    unbroken and equal to the uninterrupted run."""
    want = _uninterrupted()
    with PrefillAndDecode() as pd:
        streams = _taken_back(pd, "q4", "q5")
        with pd.loops[0].lock:
            pd.rank.die()  # the next step finds it
        assert [s.finish() for s in streams] == [want] * 2
        assert pd.recoveries == 1
        assert pd.stats(0)["offers_taken_back"] == 2


def test_a_hand_off_whose_offer_a_lost_rank_freed_is_still_decoded_by_the_prefill_replica():
    """The prefill replica's rank is lost and replaced between its offer and the gateway bringing
    the offer back: recovery let the offer go (its state went with the rank), so there is no offer
    to take back. The hand-off is the replica's own, so the replica imports it (rebuilt from its
    tokens: the exported state may be gone) and decodes it; before, the import was refused
    ("offered to a prefill replica, which does not decode") and the client got that error after
    its first token."""
    want = _uninterrupted()
    with PrefillAndDecode() as pd:
        pd.lose_rank_before_the_offer_comes_back()
        s = Stream(pd.client, "q6")
        assert s.finish() == want
        stats = pd.stats(0)
        assert stats["offers_reclaimed"] == 1 and stats["offers_taken_back"] == 0, stats


def test_an_own_hand_off_whose_import_loses_the_rank_is_still_decoded_by_the_prefill_replica():
    """As above, and the replacement rank is lost too while the replica loads the hand-off's
    state: the import is recovered (RANKS_FAILED, the request rebuilt from its tokens) and the
    request is still one the prefill replica decodes. Before, the import raised before the replica
    marked it so, and the rebuilt request waited first in line for good (the stream never ended)."""
    want = _uninterrupted()
    with PrefillAndDecode() as pd:
        pd.lose_rank_before_the_offer_comes_back(and_in_the_import=True)
        s = Stream(pd.client, "q7")
        assert s.finish() == want
        assert pd.recoveries == 2
        assert pd.stats(0)["transfers_in"] == {"ranks_failed": 1}
