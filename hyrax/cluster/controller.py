"""One named, detached controller per deployment: it owns the deployment's placement groups and
role coordinators, so they outlive every gateway that serves them.

It also keeps the deployment whole: a replica whose coordinator died or hangs is dropped and
replaced, and with autoscaling on it adds and retires replicas of the scaling roles. It is itself
restarted by Ray when it dies, and takes its replicas back (docs/deployment-ownership.md).

A gateway finds the controller by the deployment's name (`hyrax serve --attach --deployment
NAME`), asks it for the replicas, and talks to their coordinators directly; the controller is on
no request's path. Actors a detached actor creates are owned by it, not by the driver that asked
for the deployment; they are detached, so the coordinators (and the ranks they start) live until
the controller tears them down, through the controller's own restarts.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import ray

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.model.errors import HyraxInputError, StartupFailure
from hyrax.cluster.autoscale import Autoscaler, ReplicaLoad, ScalePolicy
from hyrax.cluster.deployment import Deployment, NotPlaced, Replica
from hyrax.cluster.event_log import EventLog, EventPage
from hyrax.cluster.placement import RoleSpec, namespace
from hyrax.cluster.supervision import Check, HealthTracker, ReplaceBackoff, Supervision, Verdict

DEFAULT_NAME = "hyrax"
HEAD_NODE = "node:__internal_head__"  # the resource Ray gives the head node (ray._common.constants)
DEFAULT_LEASE_S = 10.0
CONTROLLER = "controller"  # the controller's actor name, in the deployment's own Ray namespace


@dataclass
class DeploymentInfo:
    """What a gateway needs to serve a deployment: the model (tokenizer, served name) and the
    replicas' coordinator handles."""
    name: str
    model_dir: str
    served_name: str
    replicas: list[Replica]  # serving: route new requests here
    retiring: list[Replica] = field(default_factory=list)  # scaled down: drain (migrate) off, route nothing
    generation: int = 0  # changes whenever the lists do


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=8)
class DeploymentController:
    """Places and owns one deployment's replicas. `ensure` deploys once; every later caller (a
    second gateway attaching at the same moment) waits for that and gets the same replicas.

    Ray restarts it whenever it dies (its process killed or crashed; only the head node's loss,
    which ends the cluster, ends it), and a call in flight is retried on the new process. The
    replicas are detached actors that do not die with it: the restarted controller takes them
    back by name (`Deployment.adopt`) and goes on supervising and scaling them. The gateways talk
    to the replicas directly, so their streams never notice; their membership refresh resumes
    on the same actor handle."""

    def __init__(self, name: str, model_dir: str, served_name: str, roles: list[RoleSpec], config: EngineConfig,
                 rank_timeout_s: float = 60.0, scaling: dict[str, ScalePolicy] | None = None,
                 supervision: Supervision = Supervision()):
        self.name, self.served_name = name, served_name
        self.deployment = Deployment(model_dir, roles, config, rank_timeout_s=rank_timeout_s,
                                     namespace=namespace(name), detached=True)
        self.scaling = dict(scaling or {})  # role -> its autoscaling policy
        self.supervision = supervision
        self.health = HealthTracker(supervision)
        self.backoff = ReplaceBackoff(supervision)
        self._lock = threading.Lock()
        self._started = False
        self.retiring: dict[int, float] = {}  # id(replica) -> when it was retired (monotonic)
        self.leaving: list[tuple[Replica, float]] = []  # out of describe(), stopped once gateways let go
        self.generation = time.time_ns()  # a restarted controller's differs: every gateway refreshes
        self.log = EventLog()  # what happened to the replicas, for operators (event_log.py)
        self.missing: list[str] = []  # roles of replicas that died and are not replaced yet
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._take_back()

    def ensure(self, timeout_s: float = 600.0, wait_for_room_s: float = 0.0) -> DeploymentInfo:
        with self._lock:
            if not self._started:
                try:
                    self.deployment.start(timeout_s=timeout_s, wait_for_room_s=wait_for_room_s)
                except Exception:
                    self.deployment.shutdown()
                    raise
                self._start_loops()
        return self.describe()

    def _start_loops(self) -> None:
        self._started = True
        threading.Thread(target=self._supervise, daemon=True).start()
        if self.scaling:
            threading.Thread(target=self._scale_loop, daemon=True).start()

    def _take_back(self) -> None:
        """After a restart: the replicas placed before are still running; take them back instead
        of placing new ones. Retirements in progress are forgotten (a retired replica serves
        again until the autoscaler retires it anew); replicas of a role short of its count (one
        that died while the controller was down) are replaced as usual."""
        adopted = self.deployment.adopt()
        self._event("restarted", f"restarted: took back {len(adopted)} replicas "
                    f"({', '.join(f'{r.role}/{r.index}' for r in adopted) or 'none'})")
        if not adopted:
            return  # it died before placing anything: the next ensure() deploys
        for spec in self.deployment.roles:
            want = self.scaling[spec.name].min_replicas if spec.name in self.scaling else spec.replicas
            self.missing += [spec.name] * max(0, want - sum(r.role == spec.name for r in adopted))
        self._start_loops()

    # ---- replacing replicas that died or hang ----------------------------------------------
    def _supervise(self) -> None:
        while True:
            time.sleep(self.supervision.interval_s)
            try:
                self._check_replicas()
            except Exception:  # noqa: BLE001 - try again next round
                logging.getLogger("hyrax.controller").exception("replica supervision failed")

    def _check_replicas(self) -> None:
        """Ask every replica for its health, all at once, waiting at most the health timeout (not
        holding the lock meanwhile). A replica whose coordinator died (its node lost, its process
        killed) or that has not answered for `hung_after_s` (hung: alive to Ray, useless to
        everyone) leaves the list at once: gateways stop routing to it, and its streams'
        requests are rebuilt elsewhere by the gateways. A new replica of its role is placed, now
        or, when there is no room yet (Ray's autoscaler was asked for it), in a later round."""
        reps = self._listed()
        refs = [r.coordinator.health.remote() for r in reps]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=self.supervision.health_timeout_s)[0]) if refs else set()
        now = time.monotonic()
        checks = [Check.SILENT if ref not in ready else _answer(ref) for ref in refs]
        with self._lock:
            if not self._started:
                return
            for r, check in zip(reps, checks):
                verdict = self.health.judge((r.role, r.index), check, now)
                if verdict in (Verdict.DEAD, Verdict.HUNG, Verdict.DOWN) and any(x is r for x in self.deployment.replicas):
                    self.deployment.remove_replica(r, graceful=False)
                    self.retiring.pop(id(r), None)
                    self.missing.append(r.role)
                    self._event(verdict.value, {
                        Verdict.DEAD: f"lost {r.role}/{r.index}",
                        Verdict.HUNG: f"hung {r.role}/{r.index}: no health answer for "
                                      f"{self.supervision.hung_after_s:g} s; killed",
                        Verdict.DOWN: f"down {r.role}/{r.index}: its ranks could not be restarted; stopped"}[verdict])
            self._replace_missing()

    def _replace_missing(self) -> None:
        """Place a replica for each one lost, where its role's backoff allows: a group that found
        no room in time was a wait, not a failure (the next round waits again, for the first
        role short, and Ray's autoscaler sees the demand); a replica that failed to start
        delays its role's next try."""
        for role in list(self.missing):
            if not self.backoff.due(role, time.monotonic()):
                continue
            try:
                new = self.deployment.add_replica(role, timeout_s=60)
            except NotPlaced:
                break
            except Exception as e:  # noqa: BLE001 - ranks that cannot start, a node lost meanwhile
                wait = self.backoff.failed(role, time.monotonic())
                self._event("replace_failed", f"could not replace a lost {role} replica ({_one_line(e)}); next try in {wait:g} s")
                continue
            self.backoff.succeeded(role)
            self.missing.remove(role)
            self._event("replaced", f"replaced a lost {role} replica with {role}/{new.index}")

    def _listed(self) -> list[Replica]:
        gone = {id(r) for r, _ in self.leaving}
        return [r for r in self.deployment.replicas if id(r) not in gone]

    def describe(self) -> DeploymentInfo:
        reps = self._listed()
        return DeploymentInfo(self.name, self.deployment.model_dir, self.served_name,
                              [r for r in reps if id(r) not in self.retiring],
                              [r for r in reps if id(r) in self.retiring], self.generation)

    # ---- autoscaling -------------------------------------------------------------------
    def _scale_loop(self, interval_s: float = 1.0, drain_s: float = 3.0) -> None:
        """Scale each role of `scaling` between its policy's bounds. A retired replica takes no new
        requests; gateways migrate theirs off it (client.drain). Once it has held nothing for two
        measurements (`drain_s` after retiring at the earliest) it leaves describe(), and it is
        stopped `drain_s` later, when every gateway has let go of it."""
        scalers = {role: Autoscaler(policy) for role, policy in self.scaling.items()}
        idle: dict[int, int] = {}
        while True:
            time.sleep(interval_s)
            try:
                with self._lock:
                    if self._started:
                        self._stop_left(drain_s)
                        for role, scaler in scalers.items():
                            self._scale_once(role, scaler, drain_s, idle)
            except Exception:  # noqa: BLE001 - a replica that did not answer: measure again next time
                logging.getLogger("hyrax.controller").exception("autoscale step failed")

    def _stop_left(self, drain_s: float) -> None:
        now = time.monotonic()
        for r, since in list(self.leaving):  # gateways refresh every second: stop it after a few
            if now - since >= drain_s:
                self.deployment.remove_replica(r)
                self.leaving.remove((r, since))

    def _scale_once(self, role: str, scaler: Autoscaler, drain_s: float, idle: dict[int, int]) -> None:
        now = time.monotonic()
        reps = [r for r in self._listed() if r.role == role]
        for r in [r for r in reps if id(r) in self.retiring]:
            held = ray.get(r.coordinator.load.remote(), timeout=30)
            idle[id(r)] = idle.get(id(r), 0) + 1 if held == 0 else 0
            if idle[id(r)] >= 2 and now - self.retiring[id(r)] >= drain_s:
                del self.retiring[id(r)]
                self.leaving.append((r, now))
                self._event("removed", f"removed {role}/{r.index}")
        serving = [r for r in reps if id(r) not in self.retiring]
        step = scaler.decide([_measure(r) for r in serving])
        if step > 0:
            r = self.deployment.add_replica(role, timeout_s=300)
            self._event("added", f"added {role}/{r.index}")
        elif step < 0:
            victim = max(serving, key=lambda r: r.index)  # the newest: last in, first out
            self.retiring[id(victim)] = now
            self._event("retiring", f"retiring {role}/{victim.index}")

    def _event(self, kind: str, what: str) -> None:
        self.generation += 1
        self.log.add(kind, what)

    def events(self) -> list[str]:
        return self.log.texts()

    def event_page(self) -> EventPage:
        """The newest events with their times, for `GET /admin/events`."""
        return self.log.page()

    def replicas(self) -> list[Replica]:
        return list(self.deployment.replicas)

    def shutdown(self) -> None:
        with self._lock:
            self.deployment.shutdown()
            self._started = False


def _answer(ref) -> Check:
    """What a health call that returned in time says about its replica."""
    try:
        health = ray.get(ref)
    except ray.exceptions.RayActorError:
        return Check.DIED
    except ray.exceptions.RayError:  # it answered, with an error of its own: alive
        return Check.ANSWERED
    return Check.DOWN if health.get("down") else Check.ANSWERED


def _one_line(e: Exception) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def _measure(r: Replica) -> ReplicaLoad:
    stats, pools = ray.get([r.coordinator.stats.remote(), r.coordinator.pools.remote()], timeout=30)
    usage = max((c["used"] / c["capacity"] for c in pools["components"].values() if c["capacity"]), default=0.0)
    held = stats["running"] + stats["waiting"] + stats["retracted"] + stats.get("handoff", 0)
    return ReplicaLoad(waiting=stats["waiting"], held=held, pool_usage=usage)


def find(name: str):
    """The controller of deployment `name` on the connected cluster, or None."""
    try:
        return ray.get_actor(CONTROLLER, namespace=namespace(name))
    except ValueError:
        return None


def create(name: str, model_dir: str, served_name: str, roles: list[RoleSpec], config: EngineConfig,
           rank_timeout_s: float, attach: bool, scaling: dict[str, ScalePolicy] | None = None,
           supervision: Supervision = Supervision()):
    """The controller of deployment `name`: a new one, or with `attach` the existing one (created
    here if the cluster has none yet). Without `attach` an existing deployment is an error: two
    servers must not both think they own it. `scaling` (role -> policy) and `supervision` are
    the deployment's from its creation on: a gateway that attaches to a running one uses its own
    replicas' shape no more than its own scaling."""
    if not attach and find(name) is not None:
        raise HyraxInputError(f"a deployment named {name!r} already runs on this Ray cluster; "
                              f"pass --attach to serve it, or choose another --deployment name")
    # on the head node: Ray restarts it there, and the head's loss ends the cluster anyway
    opts = {"name": CONTROLLER, "namespace": namespace(name), "lifetime": "detached", "resources": {HEAD_NODE: 0.001}}
    if attach:
        opts["get_if_exists"] = True  # two gateways attaching at once get one controller
    try:
        return DeploymentController.options(**opts).remote(name, model_dir, served_name, roles, config, rank_timeout_s,
                                                           scaling, supervision)
    except ValueError:  # created by someone else between find() and here
        raise HyraxInputError(f"a deployment named {name!r} already runs on this Ray cluster; "
                              f"pass --attach to serve it, or choose another --deployment name") from None


def ensure(controller, wait_for_room_s: float = 0.0, timeout_s: float = 600.0) -> DeploymentInfo:
    """Wait until the deployment is placed and healthy; its own errors (cannot place, a bad
    option) come back as themselves, not wrapped in Ray's."""
    try:
        return ray.get(controller.ensure.remote(timeout_s, wait_for_room_s))
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, (HyraxInputError, StartupFailure)):
            raise cause from None
        raise StartupFailure(f"the deployment controller failed: {str(e).strip().splitlines()[-1]}") from None
    except ray.exceptions.RayActorError as e:
        raise StartupFailure(f"the deployment controller died: {type(e).__name__}") from None


def tear_down(controller) -> None:
    """Stop every replica of the deployment and the controller itself."""
    try:
        ray.get(controller.shutdown.remote(), timeout=120)
    except Exception:  # noqa: BLE001 - already gone
        pass
    ray.kill(controller, no_restart=True)
