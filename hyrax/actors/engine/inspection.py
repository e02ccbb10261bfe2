"""Read-only looks at a replica: its requests as the admin API lists them, pool usage, and
the cheap invariants checked at idle and after every test (free + used == capacity, and
every owner of an index is a live request in a state that may own it)."""
from __future__ import annotations

from typing import Iterable

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.lifecycle import RequestTable
from hyrax.actors.engine.moves import Place
from hyrax.actors.engine.prefix_nodes import CACHE_OWNER
from hyrax.actors.engine.request import Request, State
from hyrax.actors.model.state import ComponentSpec

Allocators = dict[str, IndexAllocator]


def describe_requests(requests: Iterable[Request]) -> list[dict]:
    out = []
    for req in requests:
        d = {
            "id": req.id, "state": req.state.value, "hold": req.hold,
            "prompt_tokens": len(req.prompt_ids), "output_tokens": len(req.output_ids),
            "computed_tokens": req.num_computed, "retractions": req.retractions, "hops": req.hops,
            "transferred_bytes": dict(req.transferred_bytes),
            "indices": {k: list(v) for k, v in req.indices.items()},
        }
        if req.backup is not None:
            d["backup"] = req.backup.manifest.to_dict()
        out.append(d)
    return out


def pool_usage(components: tuple[ComponentSpec, ...], alloc: Allocators, host_alloc: Allocators,
               cached: dict[str, int]) -> dict:
    """Per pool: capacity, units requests use, units the prefix cache holds (free to evict when
    no request uses them), host rows; checkpoint pools (`<component>.checkpoint`) too."""
    out = {c.name: {"capacity": alloc[c.name].capacity, "used": alloc[c.name].num_used - cached.get(c.name, 0),
                    "cached": cached.get(c.name, 0),
                    "host_capacity": host_alloc[c.name].capacity, "host_used": host_alloc[c.name].num_used}
           for c in components}
    for name, a in alloc.items():
        if name not in out:
            out[name] = {"capacity": a.capacity, "used": a.num_used - cached.get(name, 0), "cached": cached.get(name, 0),
                         "host_capacity": 0, "host_used": 0}
    return out


def all_free(alloc: Allocators, host_alloc: Allocators) -> bool:
    """No unit is owned by a request (the prefix cache's units do not count)."""
    return all(a.owners() <= {CACHE_OWNER} for a in list(alloc.values()) + list(host_alloc.values()))


def check_invariants(components: tuple[ComponentSpec, ...], alloc: Allocators, host_alloc: Allocators,
                     table: RequestTable, deferred: set[str], rank_backups: dict[int, int]) -> None:
    """Raises AssertionError. `deferred`: owners whose indices wait for the step in flight;
    `rank_backups`: rank -> how many cpu_tensor backups it holds."""
    for a in list(alloc.values()) + list(host_alloc.values()):
        a.check()
    for name, a in alloc.items():  # components and checkpoint pools
        for owner in a.owners() - deferred - {CACHE_OWNER}:
            req = table.get(owner)
            if req is None or req.state not in (State.RUNNING, State.OFFERED):
                raise AssertionError(f"{name}: index owned by {owner}, which is not running")
    for c in components:
        for owner in host_alloc[c.name].owners():
            req = table.get(owner)
            if req is None or req.state != State.RETRACTED:
                raise AssertionError(f"host {c.name}: rows owned by {owner}, which is not retracted")
    kept = sum(1 for r in table.retracted if r.backup is not None and r.backup.location.place == Place.RANK_MEMORY)
    for rank, n in rank_backups.items():
        if n != kept:
            raise AssertionError(f"rank {rank} holds {n} cpu backups, expected {kept}")
