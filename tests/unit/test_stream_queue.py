"""A request's queue on the gateway (step_feed.Fanout's) stays bounded while its stream reads
slowly, and still gives the stream every token and logprob in order, each special item as it
was. Before, it was an unbounded asyncio.Queue: one item a step for as long as the stream lagged."""
from __future__ import annotations

import asyncio
import copy

from hyrax.actors.engine.step_feed import Fanout, error_item
from hyrax.actors.engine.stream_queue import JOIN_AFTER

STEPS = 3000


def _token(step: int, logprobs: bool) -> dict:
    out = {"token_ids": [step], "finished": False, "finish_reason": None}
    if logprobs:
        out["logprobs"] = [{"logprob": -step / 1000, "top": [[step, -step / 1000]]}]
    return out


def _flat(items: list[dict], key: str) -> list:
    return [x for it in items if isinstance(it, dict) for x in it.get(key) or []]


def _script() -> dict[str, list]:
    """What three requests' streams get, one item a step, in order. "a": an import's first item,
    tokens with logprobs, an item with a key the join does not know, its last item; "b": tokens
    without logprobs, then an error; "c": tokens, then the feed's end (not a dict)."""
    a: list = [{"token_ids": [7], "finished": False, "finish_reason": None, "imported": "verified"}]
    a += [_token(s, True) for s in range(STEPS)]
    a.insert(1500, dict(_token(-1, True), later="x"))
    a.append(dict(_token(STEPS, True), finished=True, finish_reason="length"))
    b = [_token(s, False) for s in range(STEPS // 2)] + [error_item("step failed", 503)]
    c = [_token(s, False) for s in range(STEPS // 3)] + [object()]
    return {"a": a, "b": b, "c": c}


def test_a_stalled_streams_queue_stays_bounded_and_then_gives_every_token_in_order():
    script = _script()
    sent = copy.deepcopy({rid: [it for it in items if isinstance(it, dict)] for rid, items in script.items()})

    async def main():
        fan = Fanout()
        queues = {rid: fan.open(rid) for rid in script}
        peak = 0
        for step in range(max(map(len, script.values()))):
            fan.dispatch([(rid, items[step]) for rid, items in script.items() if step < len(items)])
            peak = max(peak, *(q.qsize() for q in queues.values()))
        got = {}
        for rid, q in queues.items():
            got[rid] = []
            while q.qsize():
                got[rid].append(await q.get())
        return peak, got

    peak, got = asyncio.run(main())
    assert peak <= JOIN_AFTER + 3, peak  # the limit, then what is never joined onto (import, the odd key, an end)
    for rid, items in script.items():
        assert _flat(got[rid], "token_ids") == _flat(items, "token_ids"), rid
        assert _flat(got[rid], "logprobs") == _flat(items, "logprobs"), rid
        specials = [it for it in items if not isinstance(it, dict) or set(it) - {"token_ids", "finished",
                                                                                    "finish_reason", "logprobs"}
                    or it.get("finished")]
        assert [it for it in got[rid] if any(it is s for s in specials)] == specials, rid  # each as it was
        assert got[rid][-1] is items[-1]
    assert got["a"][0] is script["a"][0]  # the import's first item: its tokens stay apart (the gateway skips them)
    # the items dispatched were not changed by the joins
    assert {rid: [it for it in items if isinstance(it, dict)] for rid, items in script.items()} == sent


def test_a_stream_that_keeps_up_gets_its_items_as_they_were_sent():
    async def main():
        fan = Fanout()
        q = fan.open("a")
        items = [_token(s, True) for s in range(50)]
        got = []
        for it in items:
            fan.dispatch([("a", it)])
            got.append(await q.get())
        return items, got

    items, got = asyncio.run(main())
    assert len(got) == len(items) and all(g is it for g, it in zip(got, items))


def test_items_with_and_without_logprobs_are_never_joined():
    """Logprobs come one per token: a joined item holding tokens with and without them would
    pair a logprob with the wrong token."""
    async def main():
        fan = Fanout()
        q = fan.open("a")
        items = [_token(s, s % 2 == 0) for s in range(4 * JOIN_AFTER)]
        fan.dispatch([("a", it) for it in items])
        return [await q.get() for _ in range(q.qsize())]

    got = asyncio.run(main())
    assert len(got) == 4 * JOIN_AFTER
