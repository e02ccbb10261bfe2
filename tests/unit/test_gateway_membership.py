"""A gateway's membership refresh (ray_client.Membership) over stand-in coordinator handles:
no Ray, only the calls it makes on them."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hyrax.cluster.ray_client import GatewayLease, Membership


class _Coordinator:
    """A coordinator handle that records its lease renewals."""

    def __init__(self):
        self.renewals: list[tuple[str, float]] = []
        self.renew_gateway = SimpleNamespace(remote=lambda gateway, lease_s, job=None:
                                             self.renewals.append((gateway, lease_s)))


def test_a_replica_added_to_the_deployment_gets_this_gateways_lease_at_once():
    """A replica the controller added was only renewed on at the lease thread's next round, a
    third of --gateway-lease later; a stream opened there before that ran under the replica's
    default lease (10 s), so with --gateway-lease over 30 s that default ran out first, and the
    replica aborted the gateway's streams there as if the gateway had died."""
    old, new = _Coordinator(), _Coordinator()
    lease = GatewayLease([old], lease_s=60.0)  # not started: no renewal thread
    client = SimpleNamespace(backends=[], draining=set())
    info = SimpleNamespace(generation=2, retiring=[],
                           replicas=[SimpleNamespace(role="decode", index=0, coordinator=old),
                                     SimpleNamespace(role="decode", index=1, coordinator=new)])

    async def refresh():
        Membership(None, client, lease, generation=1).apply(info)
    asyncio.run(refresh())
    assert new.renewals == [(lease.id, 60.0)]
    assert [b.handle for b in client.backends] == [old, new] and lease.handles == [old, new]


def test_a_retired_replica_that_serves_again_after_a_controller_restart_is_routed_to_and_drained_anew():
    """A restarted controller forgets retirements in progress: a replica it was retiring is listed
    as serving again (docs/deployment-ownership.md). The gateway kept it draining (no new request
    ever routed there again, while the controller counted it as serving), and when the autoscaler
    retired it anew the gateway did not drain it again (it remembered the first drain)."""
    coords = [_Coordinator(), _Coordinator()]
    reps = [SimpleNamespace(role="decode", index=i, coordinator=c) for i, c in enumerate(coords)]
    drained: list = []

    async def drain(backend):
        client.draining.add(id(backend))  # what EngineClient.drain does first
        drained.append(backend.index)
    client = SimpleNamespace(backends=[], draining=set(), drain=drain)

    async def refresh():
        m = Membership(None, client, None, generation=1)
        m.apply(SimpleNamespace(generation=2, replicas=reps[:1], retiring=reps[1:]))  # decode/1 retiring
        await asyncio.sleep(0)
        assert drained == [1] and len(client.draining) == 1
        m.apply(SimpleNamespace(generation=3, replicas=reps, retiring=[]))  # the controller restarted
        assert client.draining == set()  # routed to again
        m.apply(SimpleNamespace(generation=4, replicas=reps[:1], retiring=reps[1:]))  # retired anew
        await asyncio.sleep(0)
        assert drained == [1, 1]
    asyncio.run(refresh())


def test_a_controller_that_stays_gone_is_logged_once_not_every_second(caplog):
    """An attached gateway whose deployment's server stopped (its controller killed, the cluster
    gone) logged a full traceback every refresh, once a second, for as long as it ran. Now the
    first failure is logged with its traceback, the ones after it are counted, and the refresh
    that works again says how many there were."""
    import logging

    failing = {"on": True}

    async def describe():
        if failing["on"]:
            raise ConnectionError("the controller is gone")
        return SimpleNamespace(generation=1)
    controller = SimpleNamespace(describe=SimpleNamespace(remote=describe))
    m = Membership(controller, SimpleNamespace(backends=[], draining=set()), None, generation=1, interval_s=0.001)

    async def rounds():
        task = asyncio.ensure_future(m.run())
        await asyncio.sleep(0.3)
        failing["on"] = False
        await asyncio.sleep(0.05)
        task.cancel()
    with caplog.at_level(logging.INFO, logger="hyrax.gateway"):
        asyncio.run(rounds())
    lines = [r for r in caplog.records if r.name == "hyrax.gateway"]
    assert [r.exc_info is not None for r in lines[:1]] == [True], [r.getMessage() for r in lines]
    assert len(lines) == 2, [r.getMessage() for r in lines]
    assert "works again after" in lines[1].getMessage(), lines[1].getMessage()


def test_failures_that_go_on_are_recalled_once_per_reminder_period(caplog):
    import logging

    async def describe():
        raise ConnectionError("the controller is gone\nsecond line")
    m = Membership(SimpleNamespace(describe=SimpleNamespace(remote=describe)),
                   SimpleNamespace(backends=[], draining=set()), None, generation=1, interval_s=0.001)
    m.REMIND_S = 0.1

    async def rounds():
        task = asyncio.ensure_future(m.run())
        await asyncio.sleep(0.35)
        task.cancel()
    with caplog.at_level(logging.INFO, logger="hyrax.gateway"):
        asyncio.run(rounds())
    lines = [r.getMessage() for r in caplog.records if r.name == "hyrax.gateway"]
    assert 2 <= len(lines) <= 5 and lines[0] == "deployment membership refresh failed", lines
    assert all(ln.startswith("deployment membership refresh still failing (") and
               ln.endswith("times): ConnectionError: the controller is gone") for ln in lines[1:]), lines


def test_a_deployment_torn_down_under_the_gateway_stops_it_once(caplog):
    """The controller is restarted after any failure, so one that Ray reports dead was torn down
    (its server stopped, or `hyrax undeploy`). A gateway attached to it answered 503 until Ray
    killed it a minute later for a lost cluster; now the membership task tells it to stop, once,
    and ends (`hyrax serve` prints the reason and exits 1)."""
    import ray

    async def describe():
        raise ray.exceptions.ActorDiedError()
    controller = SimpleNamespace(describe=SimpleNamespace(remote=describe))
    told: list[str] = []
    m = Membership(controller, SimpleNamespace(backends=[], draining=set()), None, generation=1, interval_s=0.001,
                   on_gone=told.append)

    async def run():
        await asyncio.wait_for(m.run(), 5)  # returns: nothing left to ask
    asyncio.run(run())
    assert len(told) == 1 and "torn down" in told[0] and "\n" not in told[0], told


def test_replicas_added_tell_the_gateway_so_and_nothing_else_does():
    """`hyrax serve` keeps its gateway off the CPUs ranks claimed at start; a replica the
    controller adds later claims CPUs of its own, which the gateway keeps off once told
    (Membership's on_added: serve.keep_off_ranks)."""
    coords = [_Coordinator(), _Coordinator()]
    reps = [SimpleNamespace(role="decode", index=i, coordinator=c) for i, c in enumerate(coords)]
    told: list[int] = []
    client = SimpleNamespace(backends=[], draining=set())

    async def refresh():
        m = Membership(None, client, None, generation=1, on_added=lambda: told.append(len(client.backends)))
        m.apply(SimpleNamespace(generation=2, replicas=reps[:1], retiring=[]))
        m.apply(SimpleNamespace(generation=3, replicas=reps, retiring=[]))  # one added
        m.apply(SimpleNamespace(generation=4, replicas=reps[:1], retiring=[]))  # one removed: nothing to keep off
    asyncio.run(refresh())
    assert told == [1, 2]
