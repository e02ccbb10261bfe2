"""Place role replicas on the Ray cluster: one placement group per replica (one bundle per
TP rank), one RoleCoordinator per replica, which starts its rank actors in that group."""
from __future__ import annotations

from dataclasses import dataclass, replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from hyrax.actors.coordinator import RoleCoordinator
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.errors import HyraxInputError, StartupFailure
from hyrax.actors.model.sharding import check_tp


@dataclass(frozen=True)
class RoleSpec:
    name: str  # "prefill", "decode", or "colocated" (does both)
    replicas: int = 1
    tp: int = 1

    def __post_init__(self):
        if self.replicas < 1 or self.tp < 1:
            raise HyraxInputError(f"role {self.name}: replicas and tp must be >= 1")


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
                 rank_timeout_s: float = 60.0):
        cfg = ModelConfig.from_dir(model_dir)
        for r in roles:
            check_tp(cfg, r.tp)
        self.model_dir, self.roles, self.config = model_dir, roles, config
        self.rank_timeout_s = rank_timeout_s
        self.replicas: list[Replica] = []

    def start(self, timeout_s: float = 600.0) -> None:
        gpu = ray.cluster_resources().get("GPU", 0) > 0
        for spec in self.roles:
            for i in range(spec.replicas):
                bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
                pg = placement_group([dict(bundle) for _ in range(spec.tp)], strategy="PACK",
                                     name=f"hyrax/{spec.name}/{i}")
                ray.get(pg.ready(), timeout=timeout_s)
                role_config = replace(self.config, role="prefill" if spec.name == "prefill" else "colocated")
                coord = RoleCoordinator.options(name=f"hyrax/{spec.name}/{i}/coordinator", namespace="hyrax").remote(
                    spec.name, i, self.model_dir, spec.tp, role_config, pg, self.rank_timeout_s)
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
