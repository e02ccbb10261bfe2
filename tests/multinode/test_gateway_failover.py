"""Engines outlive gateways (issue 20): two `hyrax serve` gateways on one deployment of a
multi-node Ray cluster; one is SIGKILLed mid-stream. The other's streams finish unchanged, the
dead one's requests are aborted by their gateway lease and freed on every replica, and a new
gateway attaches and serves the same replicas."""
from __future__ import annotations

import pytest

from hyrax.testing.multinode import Gateway, HeldCluster, Stream, wait_until

# ~2 min on 2 cores (a cluster, a deployment, four gateway processes): opt-in, `pytest -m slow tests/multinode`
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PROMPT_LIVE = "t567;e03627;b86334;u8890;d97427;a28719;y987;r410?b"
PROMPT_DEAD = "k12;q3;w99;z4?q"
LEASE_S = "2"


@pytest.fixture(scope="module")
def cluster():
    c = HeldCluster()
    try:
        c.add_node("A", num_cpus=1)
        c.add_node("B", num_cpus=1)
        yield c
    finally:
        c.shutdown()


def test_a_killed_gateway_loses_nothing_another_serves_and_its_requests_are_freed(cluster, tmp_path):
    shape = ["--deterministic", "--gateway-lease", LEASE_S]
    gw1 = Gateway(cluster.address, tmp_path, "gw1", *shape).wait_serving()
    gateways = [gw1]
    try:
        # a second server that does not say --attach is refused, in one line, and touches nothing
        refused = Gateway(cluster.address, tmp_path, "refused", *shape)
        assert refused.proc.wait(timeout=120) == 2
        lines = [ln for ln in refused.log.read_text().splitlines() if ln.startswith("hyrax: error:")]
        assert len(lines) == 1 and "already runs" in lines[0] and "--attach" in lines[0], refused.log.read_text()

        gw2 = Gateway(cluster.address, tmp_path, "gw2", "--attach", *shape).wait_serving()
        gateways.append(gw2)
        before = gw2.finished_by_reason()

        dead = [Stream(gw1, PROMPT_DEAD, 1500, f"dead-{i}") for i in range(2)]
        live = [Stream(gw2, PROMPT_LIVE, 400, f"live-{i}") for i in range(2)]
        wait_until(lambda: all(s.chunks for s in dead + live), 60, what="every stream's first tokens")
        gw1.kill()

        # the other gateway's streams are unaffected: complete, and what an undisturbed run gives
        for s in live:
            s.join()
            assert s.done and s.error is None, (s.request_id, s.error)
        reference = gw2.complete(PROMPT_LIVE, 400)
        assert [s.text for s in live] == [reference] * 2
        # the dead gateway's clients see their stream break, never a hang
        for s in dead:
            s.join()
            assert not s.done

        # its requests are aborted on their lease (not run to their 1500 tokens) and freed everywhere
        def dead_gone():
            return not [r for r in gw2.admin("requests")["requests"] if r["id"].startswith("dead-")]
        wait_until(dead_gone, 120, interval=0.2, what="the dead gateway's requests to leave every replica")
        after = gw2.finished_by_reason()
        assert after.get("abort", 0) - before.get("abort", 0) >= 2, (before, after)
        assert after.get("length", 0) - before.get("length", 0) == 3  # the 2 live streams + the reference

        def idle_clean():
            return all(c["used"] == 0 and c["host_used"] == 0
                       for p in gw2.admin("pools")["replicas"] for c in p["components"].values())
        wait_until(idle_clean, 30, interval=0.2, what="every pool empty")

        # a new gateway attaches to the same replicas and serves
        gw3 = Gateway(cluster.address, tmp_path, "gw3", "--attach", *shape).wait_serving()
        gateways.append(gw3)
        assert gw3.complete(PROMPT_LIVE, 400) == reference
    finally:
        for g in gateways:
            g.stop()
