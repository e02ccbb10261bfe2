"""Joining a request's consecutive stream items into one, without losing or reordering a token.

Both ends of a feed join items when their reader lags: the replica's queue for a gateway
(feed_queue.py) and a request's own queue on the gateway (stream_queue.py). A joined item holds
the tokens of both in order, their logprobs (one per token) in the same order, and the later
item's other fields (`finished`, `finish_reason`). Only items that carry nothing but tokens
(`PLAIN`) are joined onto: never an import's first item (the gateway skips its tokens), an error,
a hand-off, a refusal, a stream's last item, nor one with any other key. Ray-free.
"""
from __future__ import annotations

PLAIN = frozenset({"token_ids", "finished", "finish_reason", "logprobs"})  # what an item may hold to be joined onto
LISTS = ("token_ids", "logprobs")  # the fields a join concatenates; the others are the later item's


def plain(item: object) -> bool:
    """Whether `item` carries only tokens (and their logprobs) and does not end its stream."""
    return isinstance(item, dict) and PLAIN.issuperset(item) and not item.get("finished")


def joinable(a: object, b: object) -> bool:
    """Whether `b`, the next item of the same request, may be joined onto `a`. `b` may end the
    stream (its tokens then come with the end), but neither an import's first item nor an error."""
    if not plain(a) or not isinstance(b, dict) or "imported" in b or "error" in b:
        return False
    # logprobs come one per token: two items join only if both have them or either has no tokens
    return ("logprobs" in a) == ("logprobs" in b) or not a.get("token_ids") or not b.get("token_ids")


def join(a: dict, b: dict) -> dict:
    """A new item: `a` then `b` (`joinable`); neither is changed."""
    return join_onto({k: list(v or []) if k in LISTS else v for k, v in a.items()}, b)


def join_onto(own: dict, b: dict) -> dict:
    """`b` joined onto `own` in place: an item whose lists nobody else holds (one `join` made),
    so a long run of items costs each one's tokens once, not the whole run's again."""
    for k, v in b.items():
        if k in LISTS:
            own.setdefault(k, []).extend(v or [])
        else:
            own[k] = v
    own.setdefault("token_ids", [])
    return own
