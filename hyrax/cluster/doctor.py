"""`hyrax doctor [--json]`: check what this installation can run, one line per check.

Checks: torch and CUDA versions; the attention backend each dtype would get; the CPU's C
kernels (built here; decode attention against SDPA, demo model, greedy tokens); the vllm_flash_attn kernel against SDPA (demo model, greedy tokens); NCCL broadcast and
all-reduce across two GPUs; a backup/restore round trip through pinned host buffers with
checksums; the demo model's greedy tokens on CUDA against the CPU. A check that needs what
this machine lacks says so and is skipped; the exit status is 1 only when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable

import torch

OK, WARN, SKIP, FAIL = "ok", "warn", "skip", "fail"
DEMO_LENGTHS = (5, 17, 40)
DEMO_TOKENS = 16


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | skip | fail
    detail: str


@dataclass(frozen=True)
class Machine:
    """What the checks may use; injectable, so tests can describe a machine they do not have."""
    cuda: bool
    gpus: int

    @staticmethod
    def here() -> "Machine":
        cuda = torch.cuda.is_available()
        return Machine(cuda, torch.cuda.device_count() if cuda else 0)


def check_versions(m: Machine) -> Check:
    parts = [f"torch {torch.__version__}", f"CUDA {torch.version.cuda or 'none (CPU build)'}"]
    for i in range(m.gpus):
        major, minor = torch.cuda.get_device_capability(i)
        parts.append(f"cuda:{i} {torch.cuda.get_device_name(i)} sm{major}{minor}")
    if not m.cuda:
        parts.append("no CUDA device")
    return Check("versions", OK, ", ".join(parts))


def check_attention_backends(m: Machine) -> Check:
    from hyrax.actors.model.attn_backends import select_backend
    from hyrax.actors.model.demo import DEMO_CONFIG

    device = "cuda:0" if m.cuda else "cpu"
    notes: list[str] = []
    picks = [f"{name}={select_backend('auto', device, dtype, DEMO_CONFIG.head_dim, note=notes.append).name}"
             for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32))]
    return Check("attention backend", OK, f"on {device}: " + ", ".join(picks) + "".join(f"; {n}" for n in notes[:1]))


def demo_greedy(device: str, **config) -> list[list[int]]:
    """Greedy outputs of the shipped demo model, one byte-pattern prompt per DEMO_LENGTHS."""
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.local import load_engine, run_to_completion
    from hyrax.actors.engine.request import SamplingParams
    from hyrax.actors.model.demo import DEMO_DIR

    e = load_engine(str(DEMO_DIR), EngineConfig(**{"deterministic": True, **config}), device=device)
    prompts = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate(DEMO_LENGTHS)]
    ids = [e.add_request(p, SamplingParams(max_tokens=DEMO_TOKENS, ignore_eos=True)) for p in prompts]
    run_to_completion(e)
    return [e.finished_requests[i].output_ids for i in ids]


def _agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs), len(pairs)


def _token_status(same: int, total: int) -> str:
    """Greedy tokens of two kernels or devices: all equal is ok; a few apart is a warning (a
    near-tie flipped by rounding changes the rest of its request); most of them apart, or none
    compared, is a failure (the kernel or the device computes something else)."""
    if total and same == total:
        return OK
    return WARN if total and 2 * same >= total else FAIL


def check_cpu_kernels(m: Machine) -> Check:
    """The CPU's C kernels build here (native.py), and the decode attention kernel (cpu_paged)
    decodes the demo model as SDPA does."""
    from hyrax.actors.engine import state_rows
    from hyrax.actors.model import causal_conv_rows, gemm_rows, mamba2_rows, paged_decode, ssd_scan

    kernels = {"paged_decode": paged_decode, "ssd_scan": ssd_scan, "causal_conv": causal_conv_rows,
               "mamba2_rows": mamba2_rows, "state_rows": state_rows, "gemm_rows": gemm_rows}
    missing = {name: module.available() for name, module in kernels.items() if module.available()}
    if missing:
        return Check("cpu kernels", WARN, "not built, torch runs instead: "
                     + "; ".join(f"{name}: {why}" for name, why in missing.items()))
    kernel = demo_greedy("cpu", dtype="float32", attention_backend="cpu_paged", deterministic=False)
    sdpa = demo_greedy("cpu", dtype="float32", attention_backend="sdpa", deterministic=False)
    same, total = _agreement(kernel, sdpa)
    return Check("cpu kernels", OK if same == total else WARN, f"{', '.join(kernels)} built; demo model, "
                 f"float32, greedy, batched: {same}/{total} tokens through cpu_paged equal to sdpa")


def check_flash_vs_sdpa(m: Machine) -> Check:
    if not m.cuda:
        return Check("flash vs sdpa", SKIP, "no CUDA device")
    from hyrax.actors.model.attn_backends import select_backend
    from hyrax.actors.model.demo import DEMO_CONFIG

    backend = select_backend("auto", "cuda:0", torch.bfloat16, DEMO_CONFIG.head_dim, note=lambda _: None)
    if backend.name != "vllm_flash_attn":
        return Check("flash vs sdpa", SKIP, "vllm_flash_attn does not run here (see attention backend)")
    flash = demo_greedy("cuda", dtype="bfloat16", attention_backend="vllm_flash_attn", page_size=16)
    sdpa = demo_greedy("cuda", dtype="bfloat16", attention_backend="sdpa", page_size=16)
    same, total = _agreement(flash, sdpa)
    return Check("flash vs sdpa", _token_status(same, total),
                 f"demo model, bfloat16, greedy: {same}/{total} tokens equal")


def _nccl_worker(rank: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from hyrax.actors.rank import ReplicaGroup

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, 2), rank=rank, world_size=2, device_id=device)
    try:
        group = ReplicaGroup(device)
        tokens = group.broadcast_tokens([11, 22, 33] if rank == 0 else [0, 0, 0])
        total = group.all_reduce(torch.full((4,), float(rank + 1), device=device)).tolist()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"tokens": tokens, "sum": total}, f)


def check_nccl(m: Machine) -> Check:
    if m.gpus < 2:
        return Check("nccl", SKIP, f"needs 2 GPUs, found {m.gpus}")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_nccl_worker, args=(os.path.join(d, "store"), d), nprocs=2, join=True)
        got = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(2)]
    good = all(g["tokens"] == [11, 22, 33] and g["sum"] == [3.0] * 4 for g in got)
    return Check("nccl", OK if good else FAIL, f"broadcast + all_reduce on cuda:0, cuda:1: {got}")


def check_backup_round_trip(m: Machine) -> Check:
    """Device rows -> pooled (pinned on CUDA) host buffer -> new device rows, checksummed at
    each hop, as a cpu_tensor backup and restore move them."""
    from hyrax.actors.engine.host_buffers import HostBuffers
    from hyrax.actors.engine.manifest import checksum

    device = torch.device("cuda", 0) if m.cuda else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(4, 64, 2, 8, 32, generator=g).to(device=device, dtype=torch.bfloat16)
    rows = torch.tensor([5, 17, 3, 40], device=device)
    buffers = HostBuffers(pin=m.cuda)
    want = checksum(pool.index_select(1, rows).cpu())
    host = buffers.take((4, len(rows), 2, 8, 32), pool.dtype)
    host.copy_(pool.index_select(1, rows), non_blocking=True)
    if m.cuda:
        torch.cuda.synchronize(device)
    backed = checksum(host)
    target = torch.zeros_like(pool)
    new_rows = torch.tensor([60, 1, 2, 33], device=device)
    target.index_copy_(1, new_rows, host.to(device, non_blocking=True))
    if m.cuda:
        torch.cuda.synchronize(device)
    restored = checksum(target.index_select(1, new_rows).cpu())
    buffers.give(host)
    pinned = "pinned" if host.is_pinned() else "unpinned (no CUDA)"
    good = want == backed == restored
    return Check("backup round trip", OK if good else FAIL,
                 f"{device}, {pinned} host buffer: checksums {'match' if good else f'{want} {backed} {restored}'}")


def check_demo_cuda_vs_cpu(m: Machine) -> Check:
    if not m.cuda:
        return Check("demo cuda vs cpu", SKIP, "no CUDA device")
    cpu = demo_greedy("cpu", dtype="float32")
    cuda = demo_greedy("cuda", dtype="float32", attention_backend="sdpa")
    same, total = _agreement(cpu, cuda)
    return Check("demo cuda vs cpu", _token_status(same, total), f"float32 greedy: {same}/{total} tokens equal")


CHECKS: tuple[Callable[[Machine], Check], ...] = (
    check_versions, check_attention_backends, check_cpu_kernels, check_flash_vs_sdpa, check_nccl,
    check_backup_round_trip, check_demo_cuda_vs_cpu,
)


def run_checks(machine: Machine, checks: tuple[Callable[[Machine], Check], ...]) -> list[Check]:
    out = []
    for check in checks:
        try:
            out.append(check(machine))
        except Exception as e:  # noqa: BLE001 - a broken check is a failed check, the rest still run
            name = check.__name__.removeprefix("check_").replace("_", " ")
            out.append(Check(name, FAIL, f"{type(e).__name__}: {e}".splitlines()[0]))
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check this installation (torch, CUDA, kernels, NCCL, backups)",
                       description="Check what this installation can run, one line per check: torch and CUDA "
                                   "versions, the attention backend each dtype gets, the CPU's C kernels and the "
                                   "flash-attention kernel "
                                   "against SDPA, NCCL across two GPUs, a backup/restore round trip through host "
                                   "buffers, and the demo model on CUDA against the CPU. A check this machine "
                                   "cannot run is skipped; the exit status is 1 only when a check fails.")
    p.add_argument("--json", action="store_true", help="print one JSON object per check instead of text")
    p.set_defaults(func=main)


def main(args: argparse.Namespace, machine: Machine | None = None) -> int:
    results = run_checks(machine or Machine.here(), CHECKS)
    for r in results:
        print(json.dumps(asdict(r)) if args.json else f"{r.status:4}  {r.name}: {r.detail}")
    sys.stdout.flush()
    return 1 if any(r.status == FAIL for r in results) else 0
