"""A client abort mid-stream frees every index on the coordinator and every backup on
every rank of a TP=2 replica, whether the request was running or retracted."""
from __future__ import annotations

import pytest

from hyrax.actors.engine.commands import Abort, Retract
from hyrax.actors.engine.selection import Selection
from ray_harness import (DEMO_CONFIG, DEMO_MODEL, Stream, assert_clean, call, prompt, rank_backups, reference,
                         request_info, uid)

pytestmark = pytest.mark.timeout(300)


def _end_stream(coord, s: Stream) -> None:
    """An aborted stream ends promptly with its finish item."""
    s.wait_done(10)


def test_abort_of_a_running_request_mid_stream_frees_every_rank(demo_tp2):
    coord = demo_tp2
    s = Stream(coord, uid("abort-run"), prompt(50, seed=701), 200)
    s.wait_tokens(4)
    info = request_info(coord, s.id)
    assert info["state"] == "running" and all(info["indices"].values())
    assert call(coord.run, Abort(s.id)) is True
    assert_clean(coord)
    assert call(coord.run, Abort(s.id)) is False  # gone: a second abort is a no-op
    _end_stream(coord, s)
    assert s.finish_reason == "abort"
    assert 4 <= len(s.tokens) < 200


def test_abort_of_a_held_retracted_request_discards_backups_on_every_rank(demo_tp2):
    coord = demo_tp2
    s = Stream(coord, uid("abort-held"), prompt(20, seed=702), 200)
    s.wait_tokens(3)
    assert call(coord.run, Retract(Selection(ids=(s.id,)), hold=True)) == {s.id: "cpu_tensor"}
    assert rank_backups(coord) == [1, 1]  # the test can fail: both ranks hold a backup now
    assert call(coord.run, Abort(s.id)) is True
    assert_clean(coord)
    _end_stream(coord, s)
    assert s.finish_reason == "abort"


def test_abort_beside_other_requests_leaves_them_running_to_completion(demo_tp2):
    coord = demo_tp2
    pk = prompt(10, seed=703)
    keep = Stream(coord, uid("abort-keep"), pk, 30)
    drop = Stream(coord, uid("abort-drop"), prompt(70, seed=704), 200)
    drop.wait_tokens(3)
    assert call(coord.run, Abort(drop.id)) is True
    drop.wait_done(30)
    keep.wait_done(60)
    assert drop.finish_reason == "abort"
    assert keep.finish_reason == "length"
    assert keep.tokens == reference(DEMO_MODEL, DEMO_CONFIG, [pk], 30)[0]
    assert_clean(coord)


def test_abort_of_the_last_request_ends_its_stream_with_finish_reason_abort(demo_tp2):
    coord = demo_tp2
    s = Stream(coord, uid("abort-last"), prompt(8, seed=705), 200)
    s.wait_tokens(2)
    assert call(coord.run, Abort(s.id)) is True
    try:
        s.wait_done(5)
        assert s.finish_reason == "abort"
    finally:
        _end_stream(coord, s)
        assert_clean(coord)
