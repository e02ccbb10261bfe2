"""Prefill autoscaling (issue 20): `hyrax serve --min-prefill-replicas 1 --max-prefill-replicas 2`
on its own local Ray cluster, through the same controller loop and policy as the decode role's
(`Autoscaler` per role). A lull retires the second prefill replica while a request decodes; the
request, and the requests prefilled on the one replica left, end with the single-process text.
A burst of long prompts adds the second prefill replica: a prefill replica admits prompts at
once, so its load is the prompts it holds, not a queue waiting for admission."""
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
    # every step 25 ms slower (a slow device; tokens unchanged): the crossing request then decodes
    # for ~35 s on a machine of any speed, past the scale-down (~15 s: ten quiet measurements)
    srv = Gateway(None, tmp_path, "serve", "--prefill-replicas", "2", "--min-prefill-replicas", "1",
                  "--max-prefill-replicas", "2", "--deterministic", "--num-cpus", "3",
                  "--unsafe-allow-fault-injection", "--unsafe-step-delay-ms", "25")
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


def test_a_burst_of_long_prompts_adds_a_prefill_replica_and_outputs_are_unchanged(tmp_path):
    """The prefill role's load is the prompts it holds (`up_held_per_replica`): a burst of long,
    unrelated prompts (no prefix-cache hits) keeps more than 8 in prefill for seconds, and a
    second prefill replica is added; every request, before and after it, gives the single-process text."""
    import random

    rng = random.Random(5)
    prompts = ["".join(rng.choice("abcdefghij0123456789;?") for _ in range(900)) for _ in range(48)]
    reference = reference_texts(prompts, 2)
    srv = Gateway(None, tmp_path, "serve", "--min-prefill-replicas", "1", "--max-prefill-replicas", "2",
                  "--deterministic", "--num-cpus", "3")
    try:
        srv.wait_serving()
        assert srv.replicas() == ["decode/0", "prefill/0"]
        burst = [Stream(srv, p, 2, f"burst-{i}") for i, p in enumerate(prompts)]
        wait_until(lambda: "prefill/1" in srv.replicas(), 120, interval=0.5, what="a second prefill replica")
        for s in burst:
            s.join(300)
            assert s.done and s.error is None, (s.request_id, s.error)
        assert [s.text for s in burst] == [reference[p] for p in prompts]
        after = [Stream(srv, p, 2, f"after-{i}") for i, p in enumerate(prompts[:4])]
        for s in after:
            s.join(300)
            assert s.done and s.error is None
        assert [s.text for s in after] == [reference[p] for p in prompts[:4]]
    finally:
        srv.stop()
