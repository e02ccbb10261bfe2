"""Autoscaling (issue 20): `hyrax serve --min-replicas 1 --max-replicas 2` on its own local Ray
cluster. A burst that queues adds a replica; a lull retires the newest, whose running requests are
migrated live to the other replica (the gateway drains it) before it is removed. Every request,
including the one that crossed the scale-down, ends with the text an undisturbed run gives."""
from __future__ import annotations

import httpx
import pytest

from hyrax.testing.multinode import ADMIN, Gateway, Stream, wait_until

# ~2 min on 2 cores (a replica started and stopped while requests run): opt-in, `pytest -m slow tests/multinode`
pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
BURST = ["k12;q3;w99;z4?q", "a1;b22;c333;d4444?c", "x9;y88;z777?y", "m5;n66;o777;p8888?p", "g1;h2;i3;j4;k5?i",
         "t567;e03627;b86334?b"]
LONG = "t567;e03627;b86334;u8890;d97427;a28719;y987;r410?b"
LONG_TOKENS = 1500


def test_a_burst_adds_a_replica_and_a_lull_drains_the_newest_by_live_migration(tmp_path):
    # every step 20 ms slower (a slow device; tokens unchanged), so that on a machine of any speed
    # the burst queues for seconds (a scale-up takes three overloaded measurements) and the long
    # requests decode for ~35 s, past the scale-down (ten quiet measurements after the burst)
    srv = Gateway(None, tmp_path, "serve", "--colocated", "--replicas", "1", "--min-replicas", "1",
                  "--max-replicas", "2", "--max-running", "2", "--deterministic", "--num-cpus", "2",
                  "--unsafe-allow-fault-injection", "--unsafe-step-delay-ms", "20")
    try:
        srv.wait_serving()
        assert srv.replicas() == ["colocated/0"]

        # a burst that queues on the one replica (2 run at a time): a second replica is added
        burst = [Stream(srv, p, 160, f"burst-{i}") for i, p in enumerate(BURST)]
        wait_until(lambda: srv.replicas() == ["colocated/0", "colocated/1"], 180, interval=0.5,
                   what="a second replica")
        # two long requests: at least one on the new replica (both, while the burst still holds the first)
        long = [Stream(srv, LONG, LONG_TOKENS, f"long-{i}") for i in range(2)]
        for s in burst:
            s.join(300)
            assert s.done and s.error is None, (s.request_id, s.error)

        # the lull (2 requests left, room for them on one replica) retires the newest replica; the
        # gateway migrates its running requests to colocated/0, then it is removed
        wait_until(lambda: srv.replicas() == ["colocated/0"], 180, interval=0.5, what="the newest replica removed")
        assert all(not s.done for s in long), "the long requests finished before the scale-down: lengthen them"
        for s in long:
            s.join(300)
            assert s.done and s.error is None, (s.request_id, s.error)
        log = srv.log.read_text()

        # every request ends as an undisturbed run on the one replica left ends it
        assert [s.text for s in long] == [srv.complete(LONG, LONG_TOKENS)] * 2
        assert [s.text for s in burst] == [srv.complete(p, 160) for p in BURST]
        reqs = httpx.get(f"{srv.url}/admin/requests", headers=ADMIN, timeout=30).json()["requests"]
        assert reqs == []
        # the requests on the retired replica moved with their state (verified import), not recomputed
        verified = sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{srv.url}/metrics", timeout=30).text.splitlines()
                       if line.startswith("hyrax_transfers_in_total{") and 'result="verified"' in line)
        assert verified >= 1, log[-2000:]
    finally:
        srv.stop()
