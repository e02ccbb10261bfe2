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


def role_resource(role: str) -> str:
    """The custom resource a node advertises to host replicas of `role` (KubeRay worker groups
    set `hyrax_prefill` / `hyrax_decode`); a cluster where no node advertises it pins nothing."""
    return f"hyrax_{role}"


def rank_bundle(gpu: bool, pin: str | None = None) -> dict[str, float]:
    """What one TP rank reserves: one placement-group bundle (its replica's group packs tp of
    them on one node). `pin`: a role resource the node must have (one unit per rank)."""
    bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
    if pin is not None:
        bundle[pin] = 1
    return bundle


def cpus_needed(roles: list[RoleSpec]) -> int:
    """Logical CPUs a deployment of `roles` reserves (coordinators reserve none)."""
    return int(sum(r.replicas * r.tp for r in roles) * rank_bundle(False)["CPU"])


def _amount(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _shape(bundle: dict[str, float]) -> str:
    if len(bundle) == 1:
        return _amount(next(iter(bundle.values())))
    return "{" + ", ".join(f"{k}: {_amount(v)}" for k, v in bundle.items()) + "}"


def _total(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0) + v
    return out


def check_fits(groups: list[tuple[str, list[dict[str, float]]]], free_per_node) -> list:
    """Where each placement group in `groups` ((name, bundles), in placement order) goes on
    nodes with `free_per_node` free (a list, or a dict by node id): one node per group, as its
    STRICT_PACK strategy demands (a replica's TP ranks share a node), and replicas spread: each
    group goes to the node that fits it and holds the fewest groups so far. Returns the chosen
    node (index or id) per group; raises StartupFailure, naming what is missing, when one fits
    nowhere."""
    keys = list(free_per_node) if isinstance(free_per_node, dict) else list(range(len(free_per_node)))
    nodes = list(free_per_node.values()) if isinstance(free_per_node, dict) else list(free_per_node)
    free = [dict(n) for n in nodes]
    held = [0] * len(free)
    unplaced, chosen = [], []
    for name, bundles in groups:
        need = _total(bundles)
        fits = [i for i, n in enumerate(free) if all(n.get(k, 0) >= v for k, v in need.items())]
        if not fits:
            unplaced.append(name)
            continue
        i = min(fits, key=lambda j: held[j])
        for k, v in need.items():
            free[i][k] -= v
        held[i] += 1
        chosen.append(keys[i])
    if not unplaced:
        return chosen
    free_per_node = nodes
    need: dict[str, float] = {}
    for _, bundles in groups:
        for b in bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0) + v
    shapes = {_shape(b) for _, bundles in groups for b in bundles}
    have = {k: sum(n.get(k, 0) for n in free_per_node) for k in need}
    short = all(have[k] >= v for k, v in need.items())
    whole = all(any(all(n.get(k, 0) >= v for k, v in b.items()) for n in free_per_node)
                for _, bundles in groups for b in bundles)
    raise StartupFailure(
        f"cannot place the deployment: it needs {' + '.join(f'{_amount(v)} {k}' for k, v in need.items())} "
        f"in bundles of {' or '.join(sorted(shapes))}, one per rank ("
        + ", ".join(f"{n}: {len(bs)}" for n, bs in groups)
        + f"); the cluster has {', '.join(f'{_amount(v)} {k}' for k, v in have.items())} free"
        + ((", but no node has a whole bundle free" if not whole else ", but no node has room for a whole replica "
            "(a replica's TP ranks share one node)") if short else "")
        + f", so {', '.join(unplaced)} would wait forever")
