"""The gateway's listening socket (serve.bind_gateway) gives its connections TCP_NODELAY.

It was made as socket(family, SOCK_STREAM), protocol 0, and asyncio turns Nagle's algorithm
off only on connections whose socket says IPPROTO_TCP: every connection of `hyrax serve` ran with
Nagle on. A streamed response is many small writes (headers, then a chunk per step), and Nagle
holds each write while the one before is unacknowledged, which a client acknowledges only after
its delayed-ACK timer (40 ms on Linux): measured over `hyrax serve` (PD, demo model, c=1), the first
token reached the client 40-45 ms after the request while the gateway had it after ~22 ms."""
from __future__ import annotations

import asyncio
import socket

from hyrax.cluster.serve import bind_gateway


def test_connections_to_the_gateway_socket_have_nagle_off():
    sock = bind_gateway("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen = []

    async def run():
        async def handle(reader, writer):
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)  # as uvicorn serves the socket it is given
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(run())
    assert seen and seen[0] != 0, seen
