"""Gateway leases on a real replica (issue 20): a stream whose gateway stops renewing its lease
is aborted by the replica once the lease runs out, and its state freed; a stream of a gateway
that keeps renewing runs to its end untouched. (Over Ray nothing else would stop it: a streaming
generator whose caller died keeps producing, docs/deployment-ownership.md.)"""
from __future__ import annotations

import threading

import ray

from ray_harness import Stream, assert_clean, prompt, replica, uid


def test_a_silent_gateways_stream_is_aborted_on_its_lease_and_another_gateways_is_not(demo_deployment):
    coord = replica(demo_deployment, "tp1").coordinator
    alive, dead = uid("gw-alive"), uid("gw-dead")
    ray.get([coord.renew_gateway.remote(alive, 1.0), coord.renew_gateway.remote(dead, 1.0)])
    stop = threading.Event()

    def renew():  # the living gateway renews every third of its lease; the dead one never again
        while not stop.wait(0.3):
            coord.renew_gateway.remote(alive, 1.0)
    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        orphan = Stream(coord, uid("orphan"), prompt(12, 1), 1500, gateway=dead)
        kept = Stream(coord, uid("kept"), prompt(12, 2), 300, gateway=alive)  # outlives the lease several times
        orphan.wait_done(120)
        kept.wait_done(120)
    finally:
        stop.set()
        renewer.join()
    assert orphan.finish_reason == "abort" and len(orphan.tokens) < 1500
    assert kept.finish_reason == "length" and len(kept.tokens) == 300
    assert ray.get(coord.health.remote())["gateway_leases"]["aborted_streams"] >= 1
    assert_clean(coord)
