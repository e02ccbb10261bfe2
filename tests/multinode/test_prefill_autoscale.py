"""Prefill autoscaling (issue 20): `hyrax serve --min-prefill-replicas 1 --max-prefill-replicas 2`
on its own local Ray cluster, through the same controller loop and policy as the decode role's
(`Autoscaler` per role). A lull retires the second prefill replica while a request decodes; the
request, and the requests prefilled on the one replica left, end with the single-process text.
(Scale-up goes through the same `Autoscaler.decide` and `add_replica` as the decode role's,
tests/multinode/test_autoscale.py; a prefill queue long enough to trigger it on the tiny demo
model was not found: its prompts prefill in milliseconds.)"""
from __future__ import annotations

import pytest

from hyrax.testing.multinode import Gateway, Stream, reference_texts, wait_until

# ~1.5 min on 2 cores: opt-in, `pytest -m slow tests/multinode`
pytestmark = [pytest.mark.timeout(500), pytest.mark.slow]
LONG = "t567;e03627;b86334;u8890;d97427;a28719;y987;r410?b"
BURST = ["k12;q3;w99;z4?q", "a1;b22;c333;d4444?c", "x9;y88;z777?y", "m5;n66;o777;p8888?p"]
MAX_TOKENS = 16


def test_a_lull_retires_the_newest_prefill_replica_and_requests_across_it_are_unchanged(tmp_path):
    reference = reference_texts(BURST, MAX_TOKENS)
    long_reference = reference_texts([LONG], 1200)[LONG]
    srv = Gateway(None, tmp_path, "serve", "--prefill-replicas", "2", "--min-prefill-replicas", "1",
                  "--max-prefill-replicas", "2", "--deterministic", "--num-cpus", "3")
    try:
        srv.wait_serving()
        assert srv.replicas() == ["decode/0", "prefill/0", "prefill/1"]
        crossing = Stream(srv, LONG, 1200, "crossing")  # decoding through the scale-down
        wait_until(lambda: srv.replicas() == ["decode/0", "prefill/0"], 90, interval=0.5,
                   what="prefill/1 retired and removed")
        assert not crossing.done, "the request ended before the scale-down: lengthen it"
        burst = [Stream(srv, p, MAX_TOKENS, f"burst-{i}") for i, p in enumerate(BURST)]
        for s in [crossing, *burst]:
            s.join(300)
            assert s.done and s.error is None, (s.request_id, s.error)
        assert crossing.text == long_reference
        assert [s.text for s in burst] == [reference[p] for p in BURST]
        assert srv.admin("requests")["requests"] == []
    finally:
        srv.stop()
