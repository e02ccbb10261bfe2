"""Commands a gateway sends a replica, as values.

The engine client (`hyrax/api/client.py`) builds one, its backend hands it to the replica
(`LocalBackend.run` in-process, `RayBackend.run` -> `RoleCoordinator.run` over Ray), and
`EngineLoop.run` dispatches it by type to the one method that carries it out. Nothing on that
path looks a method up by name, so a reader (or a tool) follows `Retract` from the admin route
to the ranks by its type.

Every command is a frozen dataclass that pickles as it is (Ray sends it unchanged).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from hyrax.actors.engine.selection import Selection


@dataclass(frozen=True)
class Retract:
    """Save the selected running requests' state and free their device memory. `mode`:
    cpu_tensor, host_pool or recompute (None: the replica's default); `hold`: stay retracted
    until a `Resume`. Answer: request id -> Outcome (the mode used, or a refusal)."""

    selection: Selection
    mode: str | None = None
    hold: bool = False


@dataclass(frozen=True)
class Resume:
    """Release the selected retracted requests. Answer: request id -> Outcome."""

    selection: Selection


@dataclass(frozen=True)
class SetForcedRetraction:
    """Retract one running request every `interval` steps (0: off). Answer: the interval."""

    interval: int


@dataclass(frozen=True)
class MigrateOut:
    """Offer a running request to another replica; its stream ends with the hand-off, which names
    `to` (role, replica index), the replica asked for: the gateway streaming the request offers
    it there, whichever gateway asked. Answer: False when it is not running here."""

    request_id: str
    to: tuple[str, int] | None = None


@dataclass(frozen=True)
class Abort:
    """End a request wherever it is on the replica. Answer: whether it was there."""

    request_id: str


@dataclass(frozen=True)
class ListRequests:
    """Answer: one dict per request (state, indices, backup manifest)."""


@dataclass(frozen=True)
class Pools:
    """Answer: pool usage per component."""


@dataclass(frozen=True)
class Stats:
    """Answer: the replica's counters and timings."""


@dataclass(frozen=True)
class Load:
    """Answer: how many requests the replica holds (the router's measure of how busy it is)."""


@dataclass(frozen=True)
class FlushCache:
    """Evict every cached prefix no request uses. Answer: units freed per pool."""


@dataclass(frozen=True)
class CachedPrefix:
    """How many leading tokens of `token_ids` a prefix-cache hit would cover here (the cache-aware
    router's question; the cache's LRU order is left as it is). Answer: a token count."""

    token_ids: tuple[int, ...]


Command = Union[Retract, Resume, SetForcedRetraction, MigrateOut, Abort, ListRequests, Pools, Stats, Load, FlushCache,
                CachedPrefix]
