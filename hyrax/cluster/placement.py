"""What a deployment reserves on a Ray cluster, and whether the cluster has room for it:
plain data and arithmetic, no Ray, so it is checked before anything starts or is placed."""
from __future__ import annotations

from dataclasses import dataclass

from hyrax.actors.model.errors import HyraxInputError, StartupFailure


@dataclass(frozen=True)
class RoleSpec:
    name: str  # "prefill", "decode", or "colocated" (does both)
    replicas: int = 1
    tp: int = 1

    def __post_init__(self):
        if self.replicas < 1 or self.tp < 1:
            raise HyraxInputError(f"role {self.name}: replicas and tp must be >= 1")


def namespace(name: str) -> str:
    """A deployment's Ray namespace: its name. The default deployment keeps Hyrax's usual
    actor names (`hyrax/<role>/<i>/coordinator` in namespace `hyrax`)."""
    if not name or any(c in name for c in " /\t\n"):
        raise HyraxInputError(f"--deployment {name!r}: a name without spaces or slashes")
    return name


def rank_bundle(gpu: bool) -> dict[str, float]:
    """What one TP rank reserves: one placement-group bundle (its replica's group packs tp of them)."""
    return {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}


def cpus_needed(roles: list[RoleSpec]) -> int:
    """Logical CPUs a deployment of `roles` reserves (coordinators reserve none)."""
    return int(sum(r.replicas * r.tp for r in roles) * rank_bundle(False)["CPU"])


def _amount(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _shape(bundle: dict[str, float]) -> str:
    if len(bundle) == 1:
        return _amount(next(iter(bundle.values())))
    return "{" + ", ".join(f"{k}: {_amount(v)}" for k, v in bundle.items()) + "}"


def check_fits(groups: list[tuple[str, list[dict[str, float]]]], free_per_node: list[dict[str, float]]) -> None:
    """Raise StartupFailure, naming what is missing, unless every placement group in `groups`
    ((name, bundles), in placement order) can be placed on nodes with `free_per_node` free.
    A bundle must fit on one node; the groups' PACK strategy lets one group span nodes."""
    free = [dict(n) for n in free_per_node]
    unplaced = []
    for name, bundles in groups:
        trial = [dict(n) for n in free]
        for b in bundles:
            node = next((n for n in trial if all(n.get(k, 0) >= v for k, v in b.items())), None)
            if node is None:
                unplaced.append(name)
                break
            for k, v in b.items():
                node[k] -= v
        else:
            free = trial
    if not unplaced:
        return
    need: dict[str, float] = {}
    for _, bundles in groups:
        for b in bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0) + v
    shapes = {_shape(b) for _, bundles in groups for b in bundles}
    have = {k: sum(n.get(k, 0) for n in free_per_node) for k in need}
    short = all(have[k] >= v for k, v in need.items())
    raise StartupFailure(
        f"cannot place the deployment: it needs {' + '.join(f'{_amount(v)} {k}' for k, v in need.items())} "
        f"in bundles of {' or '.join(sorted(shapes))}, one per rank ("
        + ", ".join(f"{n}: {len(bs)}" for n, bs in groups)
        + f"); the cluster has {', '.join(f'{_amount(v)} {k}' for k, v in have.items())} free"
        + (", but no node has a whole bundle free" if short else "")
        + f", so {', '.join(unplaced)} would wait forever")
