"""A replica's feed that ends or fails while streams are open ends each of them with a server
error (503, retry elsewhere), not with a 400 that blames the client's request."""
from __future__ import annotations

import asyncio
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest

from hyrax.cluster.ray_client import FeedEnd, ReplicaFeed


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Replica:
    """A replica handle whose feed yields nothing, then ends or raises."""

    def __init__(self, fails: bool):
        async def stream():
            await asyncio.sleep(0)
            if fails:
                raise RuntimeError("the feed broke")
            return
            yield  # an async generator

        self.feed = _Remote(lambda feed_id, gateway=None: stream())
        self.close_feed = _Remote(lambda feed_id: None)


@pytest.mark.parametrize("fails", [False, True])
def test_a_feed_that_ends_under_open_streams_ends_them_with_a_503(fails):
    async def run():
        feed = ReplicaFeed(_Replica(fails), gateway="g")
        q = feed.fanout.open("r1")
        return await asyncio.wait_for(q.get(), timeout=5)

    end = asyncio.run(run())
    assert isinstance(end, FeedEnd), end  # the feed's end, not the request's: the stream aborts it there (028a38d)
    item = end.item
    assert item["finished"] and item["finish_reason"] == "error"
    assert item["status"] == 503, item
    assert "broke" not in item["error"], item  # the exception's text is logged, not sent to clients
