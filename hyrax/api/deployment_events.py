"""The gateway's reads of the deployment controller's event log (hyrax/cluster/event_log.py), for
`GET /admin/events` and /metrics' `hyrax_deployment_events_total`. The source is an async
callable answering the controller's `EventPage` (hyrax serve asks the controller actor); a gateway
over an in-process engine has none."""
from __future__ import annotations

import asyncio
import logging

TIMEOUT_S = 5.0
log = logging.getLogger("hyrax.api")


class ControllerSilent(Exception):
    """The controller did not answer in time, or the call failed (it is restarting, or gone)."""


async def fetch(source):
    """The controller's event page; ControllerSilent (its cause logged) when it does not give one."""
    try:
        return await asyncio.wait_for(source(), TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - restarting, or gone: the reader is told, the cause logged
        log.warning("the deployment controller did not answer for its events: %s: %s", type(e).__name__, e)
        raise ControllerSilent() from None
