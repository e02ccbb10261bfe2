"""Start or join a Ray cluster. A local cluster stays on 127.0.0.1."""
from __future__ import annotations

import os
import socket

from hyrax.actors.model.errors import HyraxInputError, StartupFailure
from hyrax.cluster.cluster_watch import ClusterEndpoints, accepts


def prepare_env(address: str | None) -> None:
    """Settings Ray reads when it is first imported: call before anything imports ray.

    A local cluster keeps all of its traffic on 127.0.0.1 (Ray's node address, which the
    ranks' collective groups listen on too). A driver joining a cluster must not set it:
    it would register itself at 127.0.0.1 instead of the node's address."""
    if not address:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray starts workers at niceness 15; rank actors are the serving hot path, not background work
    os.environ.setdefault("RAY_worker_niceness", "0")


def init_ray(address: str | None = None, num_cpus: int | None = None, dashboard: bool = True,
             quiet: bool = True, num_gpus: int | None = None) -> bool:
    """Join `address`, or start a local single-node cluster. Returns True if started here.

    `num_gpus` (local cluster only; None: Ray counts the machine's GPUs): 0 keeps a GPU host's
    cluster CPU-only, so ranks ask for no GPU (the test suites' CPU clusters)."""
    prepare_env(address)
    import ray

    if ray.is_initialized():
        return False
    if address:
        check_reachable(address)
        _init_or_fail(f"joining the Ray cluster at {address} failed", address=address, namespace="hyrax",
                      log_to_driver=not quiet, hint=_auth_hint())
        return False
    # address="local": always a new cluster of our own, never one that Ray finds by itself
    # (a stale /tmp/ray/ray_current_cluster, another user's cluster)
    _init_or_fail("the local Ray cluster failed to start", address="local", num_cpus=num_cpus, num_gpus=num_gpus,
                  namespace="hyrax", include_dashboard=dashboard, dashboard_host="127.0.0.1",
                  log_to_driver=not quiet)
    return True


def _auth_hint() -> str:
    """What a failed join adds to its error while this driver sends no Ray token: Ray turns token
    authentication on for the cluster a local `hyrax serve` starts, and for `ray start --head`
    wherever ~/.ray/auth_token exists, but a driver joining an explicit address sends its token
    only under RAY_AUTH_MODE=token (Ray's rule: no token goes to an address unasked), and the join
    then fails with nothing but "Failed to connect"."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return ""
    return ("; if the cluster uses Ray's token authentication (`hyrax serve` starts its local cluster with it, "
            "and `ray start --head` where ~/.ray/auth_token exists), set RAY_AUTH_MODE=token: Ray then sends "
            "the token from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token")


def _init_or_fail(what: str, hint: str = "", **kwargs) -> None:
    """`ray.init(**kwargs)`; Ray's own exceptions (a node that timed out starting on a loaded
    machine, a cluster that went away) become one StartupFailure line, not a traceback, with
    `hint` after Ray's message."""
    import ray

    try:
        ray.init(**kwargs)
    except Exception as e:  # noqa: BLE001 - Ray raises plain Exception / ConnectionError / RuntimeError
        if ray.is_initialized():
            ray.shutdown()
        last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise StartupFailure(f"{what}: {last}{hint}") from None


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail at once when nothing listens at a joined cluster's `host:port` (Ray itself retries a
    missing GCS for minutes). Other forms (`auto`, `ray://...`) are Ray's to resolve."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise StartupFailure(f"no Ray cluster answers at {address} ({e.strerror or type(e).__name__}); "
                             f"is the address right, and is the cluster up (`ray start --head`)?") from None


def gcs_alive(timeout_s: float = 1.0) -> bool:
    """Whether the GCS of the cluster this driver joined still accepts connections. A SIGTERM to
    the whole process group (GNU `timeout`, systemd's default KillMode) stops a local cluster's
    GCS and raylet together with `hyrax serve`; every Ray call after that waits a minute for the
    GCS before Ray gives up."""
    import ray

    try:
        return accepts(ray.get_runtime_context().gcs_address, timeout_s)
    except AttributeError:  # no address yet
        return False


def local_num_cpus(needed: int, requested: int | None) -> tuple[int, str | None]:
    """Logical CPUs of a local cluster for a deployment that needs `needed` (one per rank):
    exactly that unless --num-cpus asks for more, and a note when it exceeds this machine's
    cores (ranks are idle between steps, so sharing cores is fine locally)."""
    if requested is not None and requested < needed:
        raise HyraxInputError(f"--num-cpus {requested} is less than the {needed} CPU the deployment needs "
                              f"(one per TP rank); raise it or leave it out")
    num = requested if requested is not None else needed
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    note = None
    if num > cores:
        note = (f"note: the local Ray cluster gets {num} logical CPUs (one per TP rank) on {cores} "
                f"core{'s' if cores != 1 else ''}; the ranks share them")
    return num, note


def cluster_address() -> str | None:
    """The address another process joins this Ray cluster at (`--address`), or None."""
    import ray

    try:
        return ray.get_runtime_context().gcs_address or None
    except Exception:  # noqa: BLE001 - best effort, only for printing
        return None


def cluster_endpoints() -> ClusterEndpoints | None:
    """Where this driver reaches its cluster (the GCS, its node's raylet), for the gateway's
    ClusterWatch; None before Ray is up."""
    import ray

    try:
        ctx = ray.get_runtime_context()
        node = ctx.worker.node
        port = node.node_manager_port
        return ClusterEndpoints(ctx.gcs_address, f"{node.node_ip_address}:{port}" if port else None)
    except Exception:  # noqa: BLE001 - Ray not up, or a Ray that keeps these elsewhere: nothing to watch
        return None


def attach_command() -> str:
    """How another gateway joins this driver's cluster, for the banner: `hyrax serve --address
    ADDR --attach`, after RAY_AUTH_MODE=token where the cluster uses Ray's token authentication
    (the local one `hyrax serve` starts does, and a joining driver sends its token only when
    asked to: without it the join fails after ~20 s of warnings). "n/a" with no cluster."""
    address = cluster_address()
    if address is None:
        return "n/a"
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
        token = is_token_auth_enabled()
    except ImportError:  # a Ray without token authentication
        token = False
    return f"{'RAY_AUTH_MODE=token ' if token else ''}hyrax serve --address {address} --attach"


def dashboard_url() -> str | None:
    import ray

    try:
        url = ray.get_runtime_context().worker.node.address_info.get("webui_url")
    except Exception:  # noqa: BLE001 - best effort, only for printing
        return None
    return f"http://{url}" if url and not url.startswith("http") else url
