"""Gateway leases on a real replica (issue 20): a stream whose gateway stops renewing its lease
is aborted by the replica once the lease runs out, and its state freed; a stream of a gateway
that keeps renewing runs to its end untouched. (Over Ray nothing else would stop it: a streaming
generator whose caller died keeps producing, docs/deployment-ownership.md.)"""
from __future__ import annotations

import threading

import ray

from ray_harness import Stream, assert_clean, prompt, replica, uid

ALIVE_LEASE_S = 2.0
KEPT_TOKENS = 2000  # ~6 s at the quickest: three of its gateway's leases (the demo context holds 2048)


def test_a_silent_gateways_stream_is_aborted_on_its_lease_and_another_gateways_is_not(demo_deployment):
    coord = replica(demo_deployment, "tp1").coordinator
    alive, dead = uid("gw-alive"), uid("gw-dead")
    # the living gateway's lease is 2 s, renewed every 0.3 s: a renewal may come 1.7 s late (a
    # loaded 2-core machine delayed them past a 1 s lease, and the kept stream was aborted)
    ray.get([coord.renew_gateway.remote(alive, ALIVE_LEASE_S), coord.renew_gateway.remote(dead, 1.0)])
    stop = threading.Event()

    def renew():  # the living gateway renews every third of its lease; the dead one never again
        while not stop.wait(0.3):
            coord.renew_gateway.remote(alive, ALIVE_LEASE_S)
    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        orphan = Stream(coord, uid("orphan"), prompt(12, 1), 1500, gateway=dead)
        kept = Stream(coord, uid("kept"), prompt(12, 2), KEPT_TOKENS, gateway=alive)  # outlives its lease several times
        orphan.wait_done(120)
        kept.wait_done(120)
    finally:
        stop.set()
        renewer.join()
    assert orphan.finish_reason == "abort" and len(orphan.tokens) < 1500
    assert kept.finish_reason == "length" and len(kept.tokens) == KEPT_TOKENS
    assert ray.get(coord.health.remote())["gateway_leases"]["aborted_streams"] >= 1
    assert_clean(coord)
