"""A gateway whose process stalls for longer than its lease (SIGSTOP, a frozen event loop) and then
goes on: the replica aborted its streams and ended its feed meanwhile. Whatever the gateway asks
of that feed before it has read its end must not run unread on the replica: before, a request
submitted on the ended feed (its end not read yet) ran to its last token into a sink that
dropped every item, held by the gateway's renewed lease, while its client got a 503 and the
gateway, which took that 503 for the stream's end, never aborted it."""
from __future__ import annotations

import asyncio
import threading
import time

import ray

from hyrax.cluster.ray_client import RayBackend
from ray_harness import assert_clean, prompt, replica, request_info, uid

LEASE_S = 1.0


def test_a_request_sent_on_a_lapsed_feed_after_a_stall_is_not_left_running(demo_deployment):
    coord = replica(demo_deployment, "tp1").coordinator
    gateway = uid("gw-stalled")
    ray.get(coord.renew_gateway.remote(gateway, LEASE_S))
    stop = threading.Event()
    params = {"max_tokens": 4000, "ignore_eos": True}

    def renew():  # the gateway's lease thread, once the process goes on
        while not stop.wait(LEASE_S / 3):
            coord.renew_gateway.remote(gateway, LEASE_S)

    async def gateway_process():
        backend = RayBackend(coord, "colocated", 0, gateway=gateway)
        first = backend.generate(uid("before"), prompt(12, 1), params)
        await first.__anext__()  # streaming on this gateway's feed
        time.sleep(3 * LEASE_S)  # stalled: no renewal, no event loop; the replica aborts and ends the feed
        threading.Thread(target=renew, daemon=True).start()  # SIGCONT: renewals again
        late = uid("late")
        items = [item async for item in backend.generate(late, prompt(12, 2), params)]
        rest = [item async for item in first]
        await asyncio.sleep(0)
        return late, items, rest

    try:
        late, items, rest = asyncio.run(gateway_process())
        # both streams end, each with one last item, and neither goes on after it
        assert items[-1]["finished"] and items[-1].get("error"), items[-1]
        assert rest and rest[-1]["finished"] and rest[-1]["finish_reason"] in ("abort", "error"), rest[-1:]
        # nothing of the late request runs on the replica for a client that was told it failed
        deadline = time.monotonic() + 5.0
        while request_info(coord, late) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert request_info(coord, late) is None, request_info(coord, late)
        assert_clean(coord, timeout=10.0)
    finally:
        stop.set()
