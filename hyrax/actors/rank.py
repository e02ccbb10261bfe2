"""RankWorker: the Ray actor of one tensor-parallel rank.

A thin shell over `RankRuntime`: it loads its weight shard, joins its replica's
torch.distributed group (gloo on CPU, NCCL on GPU) for row-parallel all-reduces, and holds
its shard of every pool. It decides nothing.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
from dataclasses import replace
from datetime import timedelta
from typing import Callable

import ray
import torch

from hyrax import heap
from hyrax.actors.cpu_claims import CpuClaim, claim, thread_cpu_sets
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.memory_budget import measured_capacities
from hyrax.actors.engine.pools import host_pool_rows, pool_sizes_for
from hyrax.actors.engine.rank_runtime import RankRuntime, make_rank_runtime
from hyrax.actors.model.hybrid import resolve_dtype
from hyrax.actors.model.loader import load_model
from hyrax.actors.model.sharding import TP
from hyrax.actors.step_bell import StepRinger
from hyrax.actors.step_graph import PARK, PARKED, WITH_RING, from_wire, to_wire
from hyrax.env import apply_torch_threads


# Where a machine has fewer CPUs to claim than ranks (cpu_claims.py), the prefill ranks of a
# disaggregated deployment take them first: a decode rank claims only once its model has
# loaded, a prefill or colocated rank before it loads its model. Which rank won used to be a
# race between the replicas' set-ups, and the outcomes differ: on the 2-core VM (prefill x1 +
# decode x1, c=16 quick workload of 64 requests, 5 runs each, alternating) the prefill rank on
# the claimed CPU with the decode rank free to use either made 733-813 output tok/s (medians),
# the decode rank pinned to it 485 (the prefill rank's bursts landed on its CPU, and a pinned
# rank cannot move away), the decode rank on it alone with everything else on the other CPU 316,
# no claim at all 655. A decode rank on a machine with CPUs left still gets one of its own.


@ray.remote(num_cpus=1, max_restarts=0)
class RankWorker:
    """Steps arrive through the replica's compiled graph, on a thread of their own (Ray runs
    compiled tasks there), or as plain calls; every other call is a plain call on the main
    thread. `_turn` lets one of them touch the runtime at a time."""

    def __init__(self, role: str, replica: int, tp_rank: int, tp_size: int):
        apply_torch_threads()
        self.role, self.replica = role, replica
        self.tp = TP(tp_rank, tp_size)
        self.runtime: RankRuntime | None = None
        self._turn = threading.Lock()
        self._ringer = StepRinger.unconnected()
        self._cpus: CpuClaim | None = None
        self._claims_cpus = False  # set by setup (--cpu-affinity auto, a CPU rank)
        self.device = place_rank(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available())

    def dist_address(self) -> str:
        """Rank 0 opens where the replica's process group meets: a socket bound to this node's
        address (127.0.0.1 on a local cluster) on a free port, held until `setup` hands it to
        the group's store, so nothing listens on every interface and the port cannot be lost."""
        ip = ray.util.get_node_ip_address()
        self._store_socket = socket.create_server((ip, 0), family=_family(ip), backlog=128)
        port = self._store_socket.getsockname()[1]
        return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"

    def setup(self, model_dir: str, config: EngineConfig, dist_address: str | None) -> dict:
        """Load this rank's shard and join the group. With `config.gpu_memory_fraction` the
        pools wait: the rank measures its device and answers the capacities it could hold
        ("capacities", "memory"); the coordinator agrees on the smallest over its ranks and calls
        `allocate`. Otherwise the pools are allocated now, as `config` sizes them."""
        config = config.for_device(self.device.type)  # a step budget left to the device (memory profiling)
        allreduce, self._broadcast, self._agree = _identity, None, None
        if self.tp.size > 1:
            self._join_group(dist_address)
            group = ReplicaGroup(self.device)
            allreduce, self._broadcast, self._agree = group.all_reduce, group.broadcast_tokens, group.all_reduce
        self._claims_cpus = config.cpu_affinity == "auto" and self.device.type == "cpu"
        if config.role != "decode":
            self._claim_cpus()
        dtype = resolve_dtype(config.dtype, self.device)
        self._model = load_model(model_dir, self.tp, dtype, allreduce, self.device, config.attention_backend,
                                 config.captured_decode, row_plans=not config.deterministic)
        if config.role == "decode":
            self._claim_cpus()  # after its model loaded: decode ranks claim last (the note above the class)
        self._model_dir = model_dir
        info = {"rank": self.tp.rank, "device": str(self.device),
                "attention_backend": self._model.attention_backend_name, "dtype": str(dtype).removeprefix("torch.")}
        if config.gpu_memory_fraction is None:
            return info | self.allocate(config)
        query = None
        if config.faults.stand_in_memory:  # test-only (allow_unsafe): a stand-in device
            from hyrax.testing.memory import stand_in_memory
            query = stand_in_memory(config.faults, self.tp.rank)
        caps, m = measured_capacities(self._model, config, query, self.tp.rank, self.device, self._broadcast)
        return info | {"capacities": caps, "memory": m.describe()}

    def allocate(self, config: EngineConfig) -> dict:
        """This rank's shard of every pool, as `config`'s capacities size them."""
        comps = self._model.components
        sizes = pool_sizes_for(comps, config)
        host = host_pool_rows(comps, sizes, config.host_pool_mb)
        self.runtime = make_rank_runtime(self._model, sizes, host, self.tp.rank, config.faults, self.device,
                                         self._broadcast, tokenizer_dir=self._model_dir, all_reduce=self._agree)
        if config.faults.out_of_memory:  # test-only (allow_unsafe), chosen once here
            from hyrax.testing.oom import with_oom_fault
            self.runtime = with_oom_fault(self.runtime, config.faults, self.tp.rank)
        # the model and its pools are what this process keeps for its life: later full collections
        # (on the stepping thread) skip them (heap.py)
        heap.settle()
        return {"pool_bytes": {n: t.numel() * t.element_size() for n, t in self.runtime.pools.items()},
                "heap": heap.summary()}

    def _join_group(self, dist_address: str) -> None:
        """Join the replica's torch.distributed group. Every socket it listens on is bound to
        this node's Ray address: the store (rank 0) on the socket `dist_address` opened, and
        the gloo/NCCL transport on the interface that carries the node's address."""
        import torch.distributed as dist

        host, port = dist_address.rsplit(":", 1)
        host = host.strip("[]")
        timeout = timedelta(seconds=300)
        if self.tp.rank == 0:
            store = dist.TCPStore(host, int(port), self.tp.size, True, timeout, wait_for_workers=False,
                                  master_listen_fd=self._store_socket.detach())  # the store owns it now
        else:
            store = dist.TCPStore(host, int(port), self.tp.size, False, timeout)
        _bind_transport_to(ray.util.get_node_ip_address())
        cuda = self.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=self.tp.rank, world_size=self.tp.size,
                                device_id=self.device if cuda else None)  # NCCL: bound to this rank's GPU
        self._store = store  # rank 0's store serves the group for as long as the rank lives

    def ping(self) -> int:
        return self.tp.rank

    def _claim_cpus(self) -> None:
        """CPUs of its own (cpu_claims.py), if it has none yet and one is free: at setup, and
        again whenever it joins a new graph (a rank that was being replaced may have held them)."""
        if self._claims_cpus and self._cpus is None:
            self._cpus = claim(torch.get_num_threads())

    def pinned_threads(self) -> set[tuple[int, ...]]:
        """The distinct CPU sets this process's threads may run on (for checks: one set, the
        claimed CPUs, when the rank claimed some)."""
        return thread_cpu_sets()

    def cpu_claim(self) -> dict | None:
        """The CPUs this rank claimed for itself, and its machine's Ray node (cpu_claims.py):
        {"node", "cpus"}; None: it runs where the OS puts it."""
        if self._cpus is None:
            return None
        return {"node": ray.get_runtime_context().get_node_id(), "cpus": list(self._cpus.cpus)}

    def execute(self, plan):
        with self._turn:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # per thread: the graph's thread starts on GPU 0
            try:
                return self.runtime.execute(plan)
            except torch.OutOfMemoryError as e:
                message = str(e)  # the failed forward's tensors live in the frames of e's traceback
            # raised anew once they are gone, so the coordinator's retry finds the memory free (the
            # type tells it to shrink the batch: executor.step_error)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise torch.OutOfMemoryError(message)

    def execute_wire(self, wire: bytes) -> bytes:
        """`execute` as a plain actor call runs it (no compiled graph): plan and result cross as
        bytes pickled by `step_graph.to_wire`, which Ray passes through as they are, where Ray's
        own serializer of the objects themselves cost ~0.3-0.4 ms more per step (a 32-request
        plan, the 2-core box)."""
        return to_wire(self.execute(from_wire(wire)))

    def ring_step_bell_at(self, address: tuple[str, int], index: int, key: bytes) -> None:
        """Connect to a new compiled graph's doorbell (step_bell.py) as rank `index`, with the
        bell's `key`: from now on `execute_and_ring` rings it after every step."""
        self._claim_cpus()  # before the coordinator's loop keeps off the claimed CPUs
        ringer = StepRinger(tuple(address), index, key)
        old, self._ringer = self._ringer, ringer
        old.close()

    def execute_and_ring(self, wire: bytes) -> bytes:
        """`execute` as the compiled graph runs it: plan and result travel pickled
        (step_graph.to_wire); the bell rings when the step has returned or raised, carrying the
        result when there is one, so the coordinator, asleep until then, has it at once (the
        graph's output then says `WITH_RING`; a result the ring could not carry goes through the
        graph). A park step (step_bell.py) sleeps until the bell wakes this rank, touching
        nothing: the calls on the main thread (ping, save, load, ...) go on meanwhile."""
        if wire == PARK:
            try:
                self._ringer.wait_for_wake()
            finally:
                self._ringer.ring()
            return PARKED
        try:
            result = self.execute_wire(wire)
        except BaseException:
            self._ringer.ring()  # the error goes through the graph
            raise
        return WITH_RING if self._ringer.ring(result) else result

    def save(self, req_id, rows, location):
        with self._turn:
            return self.runtime.save(req_id, rows, location)

    def load(self, req_id, rows, location, expect, *shards):
        """An OBJECT_STORE load's shards come as arguments of their own, so that Ray fetches
        them (it resolves object refs only at the top level of a call)."""
        with self._turn:
            return self.runtime.load(req_id, rows, replace(location, payload=shards) if shards else location, expect)

    def discard(self, req_id):
        with self._turn:
            self.runtime.discard(req_id)

    def num_backups(self) -> int:
        with self._turn:
            return self.runtime.num_backups()


def place_rank(gpu_ids: list, visible: str | None, cuda_available: bool,
               set_device: Callable[[torch.device], None] = torch.cuda.set_device) -> torch.device:
    """The device of a rank: the GPU Ray assigned it, made the process's current CUDA device,
    or the CPU when it was assigned none (a CPU cluster, or `num_gpus=0` on a GPU host).

    gpu_ids: `ray.get_gpu_ids()`, physical ids. visible: CUDA_VISIBLE_DEVICES, which Ray sets to
    the assigned ids, so the GPU is found by its position there (0 for a one-GPU rank); unset,
    the physical id is the index.
    """
    if not gpu_ids:
        return torch.device("cpu")
    if not cuda_available:
        raise RuntimeError(f"Ray assigned GPU {gpu_ids[0]} to this rank, but torch sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={visible!r})")
    gpu = str(gpu_ids[0])
    order = [v.strip() for v in visible.split(",")] if visible else None
    if order is not None and gpu not in order:
        raise RuntimeError(f"Ray assigned GPU {gpu}, which CUDA_VISIBLE_DEVICES={visible!r} does not list")
    device = torch.device("cuda", order.index(gpu) if order is not None else int(gpu))
    set_device(device)
    return device


def _family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_of(ip: str) -> str | None:
    """The network interface that carries IPv4 address `ip` (e.g. "lo" for 127.0.0.1), or None."""
    if ":" in ip:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # interface without an IPv4 address
                continue
            if socket.inet_ntoa(req[20:24]) == ip:
                return name
    return None


def _bind_transport_to(ip: str) -> None:
    """Make the collective transport (gloo now, NCCL when its communicator is built lazily)
    listen on the interface of `ip`, not on whatever the hostname resolves to. This process
    is the rank's own, so the setting stays; an operator's own setting wins."""
    iface = interface_of(ip)
    if iface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class ReplicaGroup:
    """The replica's torch.distributed group as one rank uses it.

    Every tensor handed to a collective lives on `device`, the device the group's backend
    serves: the rank's GPU under NCCL (which accepts CUDA tensors only), the CPU under gloo.
    `_join_group` picks the backend from the same device, so the two cannot disagree.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t: a row-parallel layer's partial output, any shape, already on `device` (the
        model's activations) -> the sum over the group, in place."""
        import torch.distributed as dist

        dist.all_reduce(t)
        return t

    def broadcast_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's sampled tokens, on every rank (they feed the next step's placeholders).
        tokens: (n,) ints; other ranks pass n placeholders."""
        import torch.distributed as dist

        t = torch.tensor(tokens, dtype=torch.long, device=self.device)
        dist.broadcast(t, src=0)
        return t.tolist()
