"""Whether a deployment fits in this machine's memory when Hyrax starts the Ray cluster itself.

Logical CPUs on a local cluster may be oversubscribed (ranks idle between steps share cores),
but memory may not: a deployment of more processes than the machine can hold gets its workers
killed by Ray's memory monitor or the kernel, restarted by supervision and killed again. So a
local deployment is refused before anything starts when a lower bound of what it needs exceeds
the memory the kernel reports available. The bound counts what every process certainly holds,
measured on the demo model: a rank actor (Python, torch, Ray worker: ~0.6 GB resident) and a
replica's coordinator (~0.33 GB), plus each replica's weights (its ranks' shards add up to the
checkpoint), plus each rank's state pools when they live in host memory (no CUDA here): the
pools are zero-filled when a rank starts, so every byte of them is resident. Each rank's host
backup pool (`--host-pool-mb`, where retracted requests' state goes) counts in full, wherever
the ranks compute: with CUDA it is pinned, resident from the start; on the CPU its pages become
resident as backups fill it, and a pool the machine cannot hold gets the ranks killed once it
does. Activations come on top, so a deployment that passes may still be too big; one that fails
certainly is. A joined cluster (`--address`) is Ray's to place.
"""
from __future__ import annotations

from pathlib import Path

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster.placement import RoleSpec

RANK_PROCESS_BYTES = 512 * 2**20  # below the ~600 MB measured per rank actor
COORDINATOR_BYTES = 256 * 2**20  # below the ~330 MB measured per coordinator
GIB = 2**30


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from the kernel (Linux); None where there is no such file."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the checkpoint's weight files (one replica's share, summed over its ranks): the
    files the loader reads (`loader.weight_files`), not a stale copy beside them."""
    from hyrax.actors.model.loader import weight_files

    return sum(f.stat().st_size for f in weight_files(Path(model_dir)))


def rank_pool_bytes(cfg, config, tp: int) -> int:
    """Bytes of one rank's state pools (each component's pool and, with the prefix cache, its
    checkpoint pool) at `config`'s capacities, in a TP group of `tp` on the CPU."""
    from hyrax.actors.engine.pools import pool_bytes, pool_sizes_for
    from hyrax.actors.model.hybrid import resolve_dtype
    from hyrax.actors.model.sharding import TP
    from hyrax.actors.model.state import derive_components

    comps = derive_components(cfg, TP(0, tp), resolve_dtype(config.dtype, "cpu"))
    return pool_bytes(comps, pool_sizes_for(comps, config))


def rank_backup_pool_bytes(cfg, config, tp: int, device: str) -> int:
    """Bytes of one rank's host backup pool in a TP group of `tp` computing on `device`:
    `config.host_pool_mb` shared among the components in whole rows, as the rank shares it
    (`pools.host_pool_rows`)."""
    from hyrax.actors.engine.pools import host_pool_rows, pool_sizes_for
    from hyrax.actors.model.hybrid import resolve_dtype
    from hyrax.actors.model.sharding import TP
    from hyrax.actors.model.state import derive_components

    comps = derive_components(cfg, TP(0, tp), resolve_dtype(config.dtype, device))
    rows = host_pool_rows(comps, pool_sizes_for(comps, config), config.host_pool_mb)
    return sum(rows[c.name] * c.row_bytes for c in comps)


def _per_rank(roles: list[RoleSpec], by_role: dict[str, int] | None) -> int:
    """`by_role` (one rank's bytes by role name) summed over every rank of `roles`."""
    return sum(r.replicas * r.tp * (by_role or {}).get(r.name, 0) for r in roles)


def needed_bytes(roles: list[RoleSpec], weights: int, pools: dict[str, int] | None = None,
                 backups: dict[str, int] | None = None) -> int:
    """A lower bound of the memory a deployment of `roles` holds once started; `pools`: one
    rank's state-pool bytes by role name, when the pools are in host memory; `backups`: one
    rank's host backup pool bytes by role name."""
    ranks = sum(r.replicas * r.tp for r in roles)
    replicas = sum(r.replicas for r in roles)
    return (ranks * RANK_PROCESS_BYTES + replicas * (COORDINATOR_BYTES + weights) + _per_rank(roles, pools)
            + _per_rank(roles, backups))


def check_fits(roles: list[RoleSpec], weights: int, available: int | None, pools: dict[str, int] | None = None,
               backups: dict[str, int] | None = None, what: str = "the deployment") -> None:
    """Raise naming both numbers when the deployment cannot fit; `available` None: not known.
    `what`: the deployment's shape as the message names it (e.g. at its autoscaling bounds)."""
    if available is None:
        return
    need = needed_bytes(roles, weights, pools, backups)
    if need > available:
        ranks = sum(r.replicas * r.tp for r in roles)
        replicas = sum(r.replicas for r in roles)
        pool_total, backup_total = _per_rank(roles, pools), _per_rank(roles, backups)
        held = (f", {pool_total / GIB:.2f} GiB of state pools at these capacities" if pool_total else "")
        held += (f", {backup_total / GIB:.2f} GiB of host backup pools (--host-pool-mb, one a rank)" if backup_total
                 else "")
        advice = "lower --kv-capacity-tokens / --mamba-slots / --mamba-checkpoint-slots, " if pool_total else ""
        advice += "lower --host-pool-mb, " if backup_total else ""
        raise HyraxInputError(
            f"{what} needs at least {need / GIB:.1f} GiB ({ranks} rank processes, {replicas} coordinators, "
            f"{replicas} copies of {weights / GIB:.2f} GiB of weights{held}) but this machine has "
            f"{available / GIB:.1f} GiB available; {advice}deploy fewer replicas or smaller TP, or join a larger "
            f"cluster with --address")
