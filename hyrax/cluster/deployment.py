"""Place role replicas on the Ray cluster: one placement group per replica (one bundle per
TP rank), one RoleCoordinator per replica, which starts its rank actors in that group."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from hyrax.actors.coordinator import RoleCoordinator
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.errors import HyraxInputError, StartupFailure
from hyrax.actors.model.sharding import check_tp
from hyrax.cluster.placement import RoleSpec, check_fits, rank_bundle  # noqa: F401 - RoleSpec re-exported


def free_resources_per_node() -> list[dict[str, float]]:
    """What each live node of the Ray cluster has free now."""
    try:
        from ray._private.state import available_resources_per_node

        return list(available_resources_per_node().values())
    except Exception:  # noqa: BLE001 - a Ray without the per-node view: the whole cluster as one node
        return [ray.available_resources()]


@dataclass
class Replica:
    role: str
    index: int
    tp: int
    coordinator: object
    pg: object


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


class Deployment:
    def __init__(self, model_dir: str, roles: list[RoleSpec], config: EngineConfig,
                 rank_timeout_s: float = 60.0, namespace: str = "hyrax"):
        cfg = ModelConfig.from_dir(model_dir)
        for r in roles:
            check_tp(cfg, r.tp)
        self.model_dir, self.roles, self.config = model_dir, roles, config
        self.rank_timeout_s = rank_timeout_s
        self.namespace = namespace  # Ray namespace of its actor names (one per deployment name)
        self.replicas: list[Replica] = []

    def placement_groups(self, gpu: bool) -> list[tuple[RoleSpec, int, list[dict[str, float]]]]:
        """(role, replica index, bundles) of every placement group, in placement order."""
        return [(spec, i, [rank_bundle(gpu) for _ in range(spec.tp)])
                for spec in self.roles for i in range(spec.replicas)]

    def start(self, timeout_s: float = 600.0, wait_for_room_s: float = 0.0) -> None:
        """Place every replica and wait until all are healthy. Fails before anything is placed
        when the cluster has too little free to place them all (after waiting up to
        `wait_for_room_s` for nodes to join, e.g. worker pods still starting)."""
        deadline = time.monotonic() + wait_for_room_s
        while True:
            gpu = ray.cluster_resources().get("GPU", 0) > 0
            groups = self.placement_groups(gpu)
            try:
                check_fits([(f"{spec.name}/{i}", bundles) for spec, i, bundles in groups], free_resources_per_node())
                break
            except StartupFailure:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)
        for spec, i, bundles in groups:
            pg = placement_group(bundles, strategy="PACK", name=f"hyrax/{spec.name}/{i}")
            try:
                ray.get(pg.ready(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(pg)  # something else took the room after the check
                raise StartupFailure(f"{spec.name}/{i} was not placed within {timeout_s:g} s "
                                     f"(the cluster's free resources were taken meanwhile)") from None
            role_config = replace(self.config, role="prefill" if spec.name == "prefill" else "colocated")
            coord = RoleCoordinator.options(name=f"hyrax/{spec.name}/{i}/coordinator", namespace=self.namespace).remote(
                spec.name, i, self.model_dir, spec.tp, role_config, pg, self.rank_timeout_s, namespace=self.namespace)
            self.replicas.append(Replica(spec.name, i, spec.tp, coord, pg))
        try:
            ray.get([r.coordinator.health.remote() for r in self.replicas], timeout=timeout_s)
        except ray.exceptions.RayError as e:
            raise startup_error(e) from None

    def shutdown(self) -> None:
        for r in self.replicas:
            try:
                ray.get(r.coordinator.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - already gone
                pass
            ray.kill(r.coordinator, no_restart=True)
            remove_placement_group(r.pg)
        self.replicas = []
