"""Place role replicas on the Ray cluster: one placement group per replica (one bundle per TP
rank, STRICT_PACK: a replica lives on one node), replicas spread over the nodes, and one
RoleCoordinator per replica inside its group (so a node that goes away takes whole replicas, never
half of one), which starts its rank actors in that group. Where nodes advertise a role's resource
(`hyrax_prefill`, `hyrax_decode`), that role's replicas go only there."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hyrax.actors.coordinator import RoleCoordinator
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.errors import HyraxInputError, StartupFailure
from hyrax.actors.model.sharding import check_tp
from hyrax.cluster.placement import RoleSpec, check_fits, rank_bundle, role_resource  # noqa: F401 - RoleSpec re-exported


def free_resources_per_node() -> dict[str, dict[str, float]]:
    """What each live node of the Ray cluster has free now, by node id."""
    try:  # private: Ray's public views give totals (ray.nodes) or need the dashboard (ray.util.state)
        from ray._private.state import available_resources_per_node

        return dict(available_resources_per_node())
    except Exception:  # noqa: BLE001 - a Ray without the per-node view: the whole cluster as one node
        return {"": ray.available_resources()}


def request_room(bundles: list[dict[str, float]]) -> None:
    """Ask Ray's autoscaler for a cluster that holds all of `bundles` (the whole deployment:
    request_resources sets a target, it does not add to the last one). Without an autoscaler
    (a laptop, a fixed cluster) nothing happens and the placement simply waits."""
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)
    except Exception:  # noqa: BLE001 - no autoscaler to ask: the pending group still waits for room
        pass


class NotPlaced(StartupFailure):
    """A replica's placement group found no room in time: nothing started, nothing failed."""


@dataclass
class Replica:
    role: str
    index: int
    tp: int
    coordinator: object
    pg: object


def parse_group_name(name: str, namespace: str) -> tuple[str, int] | None:
    """(role, index) of a placement group named by Deployment.group_name in `namespace`, else None."""
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != namespace or not parts[2].isdigit():
        return None
    return parts[1], int(parts[2])


def _actor(name: str, namespace: str):
    """The live actor of that name, or None."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


_INPUT_ERROR = "HyraxInputError: "


def startup_error(e: Exception) -> Exception:
    """One line for a replica that failed to start: the HyraxInputError a rank or coordinator
    raised (bad option for this cluster, e.g. a kernel its devices cannot run), else the
    last line of the remote error."""
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _INPUT_ERROR in ln:
            return HyraxInputError(ln.split(_INPUT_ERROR, 1)[1])
    return StartupFailure(f"a replica failed to start: {lines[-1] if lines else type(e).__name__}")


def coordinator_name(role: str, index: int) -> str:
    """The name of a replica's coordinator, in its deployment's Ray namespace."""
    return f"hyrax/{role}/{index}/coordinator"


class Deployment:
    """A deployment's replicas. `detached`: each replica (its coordinator and its placement group)
    outlives the process that placed it (the controller), so a restarted controller can take it
    back by name (`adopt`); the replica's ranks live and die with its coordinator."""

    def __init__(self, model_dir: str, roles: list[RoleSpec], config: EngineConfig,
                 rank_timeout_s: float = 60.0, namespace: str = "hyrax", detached: bool = False):
        cfg = ModelConfig.from_dir(model_dir)
        for r in roles:
            check_tp(cfg, r.tp)
        self.model_dir, self.roles, self.config = model_dir, roles, config
        self.rank_timeout_s = rank_timeout_s
        self.namespace = namespace  # Ray namespace of its actor names (one per deployment name)
        self.lifetime = "detached" if detached else None
        self.replicas: list[Replica] = []
        self._highest: dict[str, int] = {}  # the highest replica index given out, per role

    def placement_groups(self, gpu: bool, pinned: frozenset[str] = frozenset()) -> list[tuple[RoleSpec, int, list[dict[str, float]]]]:
        """(role, replica index, bundles) of every placement group, in placement order;
        `pinned`: the role resources some node advertises (those roles go only there)."""
        def pin(role: str) -> str | None:
            return role_resource(role) if role_resource(role) in pinned else None
        return [(spec, i, [rank_bundle(gpu, pin(spec.name)) for _ in range(spec.tp)])
                for spec in self.roles for i in range(spec.replicas)]

    def start(self, timeout_s: float = 600.0, wait_for_room_s: float = 0.0) -> None:
        """Place every replica and wait until all are healthy. Fails before anything is placed
        when the cluster has too little free to place them all (after waiting up to
        `wait_for_room_s` for nodes to join, e.g. worker pods still starting)."""
        deadline = time.monotonic() + wait_for_room_s
        while True:
            total = ray.cluster_resources()
            gpu = total.get("GPU", 0) > 0
            groups = self.placement_groups(gpu, frozenset(k for k in total if k.startswith("hyrax_")))
            try:
                nodes = check_fits([(f"{spec.name}/{i}", bundles) for spec, i, bundles in groups],
                                   free_resources_per_node())
                break
            except StartupFailure:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)
        for (spec, i, bundles), node in zip(groups, nodes):
            self.replicas.append(self._place(spec, i, bundles, node, timeout_s))
        try:
            ray.get([r.coordinator.health.remote() for r in self.replicas], timeout=timeout_s)
        except ray.exceptions.RayError as e:
            raise startup_error(e) from None

    def _place(self, spec: RoleSpec, i: int, bundles: list[dict[str, float]], node, timeout_s: float) -> Replica:
        """One replica: its placement group on `node` (a soft target: where check_fits found room
        and the fewest replicas), then its coordinator in the group's first bundle."""
        self._highest[spec.name] = max(self._highest.get(spec.name, -1), i)
        pg = placement_group(bundles, strategy="STRICT_PACK", name=self.group_name(spec.name, i),
                             lifetime=self.lifetime, _soft_target_node_id=node or None)
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)  # something else took the room after the check
            raise NotPlaced(f"{spec.name}/{i} was not placed within {timeout_s:g} s "
                            f"(the cluster's free resources were taken meanwhile)") from None
        # a decode replica gets its requests' state handed over: it prefills no prompt, so keeps no prefix cache
        role_config = replace(self.config, role=spec.name if spec.name in ("prefill", "decode") else "colocated")
        coord = RoleCoordinator.options(
            name=coordinator_name(spec.name, i), namespace=self.namespace, lifetime=self.lifetime,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote(spec.name, i, self.model_dir, spec.tp, role_config, pg, self.rank_timeout_s, namespace=self.namespace)
        return Replica(spec.name, i, spec.tp, coord, pg)

    def add_replica(self, role: str, timeout_s: float = 600.0) -> Replica:
        """One more replica of `role`, with the next unused index; healthy when this returns."""
        spec = next(r for r in self.roles if r.name == role)
        # indices are never reused: a lost replica's actor names may not be released yet
        i = max([r.index for r in self.replicas if r.role == role] + [self._highest.get(role, -1)]) + 1
        total = ray.cluster_resources()
        pinned = frozenset(k for k in total if k.startswith("hyrax_"))
        bundles = [rank_bundle(total.get("GPU", 0) > 0, role_resource(role) if role_resource(role) in pinned else None)
                   for _ in range(spec.tp)]
        try:
            [node] = check_fits([(f"{role}/{i}", bundles)], free_resources_per_node())
        except StartupFailure:  # no room now: ask Ray's autoscaler (if the cluster runs one) for a node
            node = None
            request_room([b for r in self.replicas for b in ray.util.placement_group_table(r.pg)["bundles"].values()]
                         + bundles)
        replica = self._place(spec, i, bundles, node, timeout_s)  # a pending group is a demand the autoscaler sees
        try:
            ray.get(replica.coordinator.health.remote(), timeout=timeout_s)
        except ray.exceptions.RayError as e:
            self._stop(replica)
            raise startup_error(e) from None
        self.replicas.append(replica)
        return replica

    def remove_replica(self, replica: Replica, graceful: bool = True) -> None:
        """Stop `replica`; without `graceful`, kill it at once (it hangs: it would not answer)."""
        self.replicas = [r for r in self.replicas if r is not replica]
        self._stop(replica, graceful)

    @staticmethod
    def _stop(r: Replica, graceful: bool = True) -> None:
        if graceful:
            try:
                ray.get(r.coordinator.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - already gone
                pass
        ray.kill(r.coordinator, no_restart=True)
        remove_placement_group(r.pg)  # ends the ranks in it too

    # ---- taking replicas back (a restarted controller) -----------------------------------
    def group_name(self, role: str, index: int) -> str:
        """A replica's placement group name (placement group names are not namespaced: the
        deployment's namespace leads, so two deployments' groups never share a name)."""
        return f"{self.namespace}/{role}/{index}"

    def adopt(self) -> list[Replica]:
        """Take back the replicas this deployment placed before (detached, found by name): every
        live coordinator of one of its roles with its placement group. A group left without a
        coordinator (placed just before the controller died) is removed, and so is a coordinator
        without its group; replica indices go on after the highest ever given out."""
        roles = {r.name for r in self.roles}
        groups: dict[tuple[str, int], dict] = {}
        for pg_id, info in ray.util.placement_group_table().items():
            key = parse_group_name(info.get("name") or "", self.namespace)
            if key is None or key[0] not in roles:
                continue
            self._highest[key[0]] = max(self._highest.get(key[0], -1), key[1])
            if info["state"] != "REMOVED":
                groups[key] = dict(info, pg=PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
        coords = {(role, i): _actor(coordinator_name(role, i), self.namespace)
                  for role in roles for i in range(self._highest.get(role, -1) + 1)}
        for role, i in sorted({k for k, c in coords.items() if c is not None} | set(groups)):
            info, coord = groups.get((role, i)), coords.get((role, i))
            if coord is not None and info is not None:
                self.replicas.append(Replica(role, i, len(info["bundles"]), coord, info["pg"]))
            elif coord is not None:
                ray.kill(coord, no_restart=True)
            else:
                remove_placement_group(info["pg"])
        return list(self.replicas)

    def shutdown(self) -> None:
        for r in self.replicas:
            self._stop(r)
        self.replicas = []
