"""Gateway leases (issue 20): a replica aborts exactly the streams of gateways that stopped
renewing, once their lease ran out, and nothing of a gateway that keeps renewing."""
from __future__ import annotations

from hyrax.actors.engine.gateway_leases import GatewayLeases


def test_only_the_silent_gateways_streams_expire_after_its_lease():
    g = GatewayLeases(default_lease_s=10)
    g.renew("alive", 2, now=0)
    g.renew("dead", 2, now=0)
    for rid in ("a1", "a2"):
        g.open("alive", rid, now=0)
    for rid in ("d1", "d2"):
        g.open("dead", rid, now=0)
    g.open(None, "in-process", now=0)  # no gateway: never expires
    assert g.expired(now=1.9) == []
    g.renew("alive", 2, now=1.9)
    assert sorted(g.expired(now=2.0)) == ["d1", "d2"]
    assert g.expired(now=3.8) == []  # the dead gateway is forgotten: its streams are aborted once
    assert g.summary()["aborted_streams"] == 2 and g.summary()["gateways"] == 1


def test_a_finished_stream_is_not_aborted_and_a_new_gateway_gets_the_default_lease():
    g = GatewayLeases(default_lease_s=5)
    g.open("gw", "r1", now=0)
    g.open("gw", "r2", now=0)
    g.close("gw", "r1")
    assert g.expired(now=4.9) == []
    assert g.expired(now=5.0) == ["r2"]
