"""Engine options on the command line — one definition shared by `hyrax generate` and
`hyrax serve`, so both accept the same names."""
from __future__ import annotations

import argparse

from hyrax.actors.cpu_claims import AFFINITY_MODES
from hyrax.actors.engine.config import (ATTENTION_BACKENDS, BACKUP_MODES, CAPTURE_MODES, MAX_BATCH_TOKENS,
                                        MAX_BATCH_TOKENS_CUDA, PREFILL_CHUNK, PREFILL_ORDERS, EngineConfig,
                                        UnsafeFaults)
from hyrax.actors.engine.scheduler import SHORTEST_FIRST_WINDOW_S
from hyrax.cluster.arg_types import non_negative_float, non_negative_int, positive_int

KV_DEFAULT = EngineConfig.kv_capacity_tokens  # the dataclass defaults
SLOTS_DEFAULT = EngineConfig.mamba_slots
# engine options that only a Ray replica's rank actors use, as dest -> (default, the flag that
# changes it): `hyrax generate` runs the engine in-process, where they would change nothing, so
# it refuses them when given and its help says they do not apply
RAY_ONLY = {"compiled_graph": (True, "--no-compiled-graph"), "cpu_affinity": ("auto", "--cpu-affinity off")}
NOT_IN_PROCESS = ("does not apply to hyrax generate, which runs the engine in-process without a Ray replica's rank "
                  "actors: a value other than the default (%(default)s) is an error")


def add_engine_args(p: argparse.ArgumentParser, in_process: bool = False) -> None:
    """`in_process`: for `hyrax generate`, whose help says that the RAY_ONLY options do not apply."""
    def replica_help(text: str) -> str:
        return NOT_IN_PROCESS if in_process else text

    g = p.add_argument_group("engine")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16", "float64"], default="auto",
                   help="model dtype; auto = float32 on the CPU, bfloat16 on CUDA (float16 on GPUs before "
                        "compute capability 8.0)")
    g.add_argument("--page-size", type=positive_int, default=16, help="tokens per K/V page (default 16)")
    # default None: whether a capacity was given explicitly matters with --gpu-memory-fraction
    g.add_argument("--kv-capacity-tokens", type=positive_int, default=None,
                   help=f"K/V pool capacity per attention component, in tokens (default {KV_DEFAULT})")
    g.add_argument("--swa-capacity-tokens", type=positive_int, default=None,
                   help="sliding-window K/V capacity in tokens (default: --kv-capacity-tokens)")
    g.add_argument("--mamba-slots", type=positive_int, default=None,
                   help=f"Mamba state slots (default {SLOTS_DEFAULT})")
    g.add_argument("--gpu-memory-fraction", type=float, default=None, metavar="F",
                   help="size the pools from the GPU's memory: after the weights load and a profiling forward at "
                        "--max-batch-tokens / --max-running measures the activation peak, the pools get F x total "
                        "memory - what is in use - that peak, shared in the ratio of the three capacities above; "
                        "a capacity given explicitly keeps its value (as vLLM's --gpu-memory-utilization; "
                        "CUDA only, 0 < F <= 1)")
    g.add_argument("--max-running", type=positive_int, default=64, help="max concurrently running requests")
    g.add_argument("--max-batch-tokens", type=positive_int, default=None, metavar="N",
                   help=f"token budget per step, prompt chunks and decode tokens together (default: "
                        f"{MAX_BATCH_TOKENS} on a CPU, {MAX_BATCH_TOKENS_CUDA} on a GPU, and never below "
                        f"--prefill-chunk)")
    g.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="N",
                   help=f"max prompt tokens per request per step, at most --max-batch-tokens when that is "
                        f"given (default: {PREFILL_CHUNK}, or --max-batch-tokens if smaller)")
    g.add_argument("--prefill-order", choices=PREFILL_ORDERS, default="shortest",
                   help=f"which prompts prefill first: shortest: the fewest tokens left first, among those that "
                        f"arrived within {SHORTEST_FIRST_WINDOW_S:g} s of the oldest one still to prefill, admitted "
                        f"or waiting; fcfs: arrival order (default: shortest)")
    g.add_argument("--retraction-backup", choices=BACKUP_MODES, default="cpu_tensor",
                   help="how retracted requests keep their state (default cpu_tensor)")
    g.add_argument("--host-pool-mb", type=non_negative_float, default=256.0,
                   help="host pool size for host_pool backups")
    g.add_argument("--forced-retraction-interval", type=non_negative_int, default=0, metavar="N",
                   help="testing hook: retract one request every N steps (0 = off)")
    g.add_argument("--no-overlap", action="store_true",
                   help="do not plan step N+1 while step N runs (overlap scheduling is on by default)")
    g.add_argument("--compiled-graph", action=argparse.BooleanOptionalAction, default=True,
                   help=replica_help("send each step to a replica's ranks through a Ray Compiled Graph (~1 ms less per "
                        "step than plain actor calls; an idle replica parks its ranks, which then use no CPU). "
                        "--no-compiled-graph: plain actor calls, as also where no graph can be built "
                        "(default on)"))
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="attention kernel: auto = vllm_flash_attn on CUDA with float16/bfloat16 when the "
                        "gpu extra imports; cpu_paged (a C decode kernel built on first use with the "
                        "machine's C compiler) for float32 on the CPU; else torch SDPA (default auto)")
    g.add_argument("--cpu-affinity", choices=AFFINITY_MODES, default="auto",
                   help=replica_help("auto (default): each CPU rank runs on CPUs of its own where some are free (never "
                        "the first of its CPUs; none under a cgroup CPU quota; prefill ranks before decode ranks), "
                        "the coordinator's process keeps off its ranks' CPUs while it steps a compiled graph and the "
                        "gateway's off every claimed CPU of its machine; off: wherever the OS puts them"))
    g.add_argument("--captured-decode", choices=CAPTURE_MODES, default="off",
                   help="run decode-only steps through a captured forward: compile = torch.compile (one "
                        "graph for every batch size >= 2, one for 1; the first decode step of each compiles it, "
                        "seconds on a small CPU: 6-9 s on a 2-core VM, for 1.2-1.35x), cuda_graphs = a CUDA "
                        "graph per batch size and key-length bucket (CUDA and --attention-backend sdpa only; not yet run on a GPU). "
                        "Prefill stays eager "
                        "(default off)")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics: outputs independent of batch composition")
    g.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the state of cached prompt prefixes (radix tree; full-attention pages shared, "
                        "sliding-window rows and recurrent checkpoints copied); default on, ignored by decode "
                        "replicas, which never prefill prompts")
    g.add_argument("--mamba-track-interval", type=positive_int, default=None, metavar="N",
                   help="checkpoint the recurrent state every N tokens for the prefix cache (a multiple of "
                        "--page-size; default: the first multiple of the page size >= 256)")
    g.add_argument("--mamba-checkpoint-slots", type=non_negative_int, default=0, metavar="N",
                   help="checkpoint slots per recurrent component (default 0: 3 x --mamba-slots)")
    u = p.add_argument_group("fault injection (test-only; refused without --unsafe-allow-fault-injection)")
    u.add_argument("--unsafe-allow-fault-injection", action="store_true",
                   help="allow the --unsafe-* options below (they break state on purpose, to prove tests notice)")
    u.add_argument("--unsafe-skip-backup-component", default=None, metavar="NAME[,NAME]",
                   help="backups silently leave these components out (mamba_conv,mamba_ssm: the recurrent state)")
    u.add_argument("--unsafe-corrupt-backup-component", default=None, metavar="COMPONENT",
                   help="flip a byte of this component in every backup after checksumming (restores must notice)")
    u.add_argument("--unsafe-restore-into-old-indices", action="store_true",
                   help="restore into the indices a request gave up, which may belong to another request by then")
    u.add_argument("--unsafe-disable-verification", action="store_true",
                   help="restores trust the backup: no completeness, ownership or checksum check")
    u.add_argument("--unsafe-step-delay-ms", type=float, default=0.0, metavar="MS",
                   help="every rank sleeps this long before each step: a slow device (default 0: off)")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """Raises HyraxInputError on invalid values."""
    faults = UnsafeFaults(
        skip_backup_component=a.unsafe_skip_backup_component,
        restore_into_old_indices=a.unsafe_restore_into_old_indices,
        corrupt_backup_component=a.unsafe_corrupt_backup_component,
        disable_verification=a.unsafe_disable_verification,
        step_delay_ms=a.unsafe_step_delay_ms,
    )
    given = {"kv_capacity_tokens": a.kv_capacity_tokens, "swa_capacity_tokens": a.swa_capacity_tokens,
             "mamba_slots": a.mamba_slots}
    return EngineConfig(
        page_size=a.page_size, kv_capacity_tokens=KV_DEFAULT if a.kv_capacity_tokens is None else a.kv_capacity_tokens,
        swa_capacity_tokens=a.swa_capacity_tokens,
        mamba_slots=SLOTS_DEFAULT if a.mamba_slots is None else a.mamba_slots,
        gpu_memory_fraction=a.gpu_memory_fraction, fixed_capacities=tuple(k for k, v in given.items() if v is not None), max_running=a.max_running, max_batch_tokens=a.max_batch_tokens,
        prefill_chunk=a.prefill_chunk, prefill_order=a.prefill_order,
        retraction_backup=a.retraction_backup,
        host_pool_mb=a.host_pool_mb, forced_retraction_interval=a.forced_retraction_interval,
        deterministic=a.deterministic, dtype=a.dtype, faults=faults, allow_unsafe=a.unsafe_allow_fault_injection,
        overlap=not a.no_overlap, compiled_graph=a.compiled_graph, attention_backend=a.attention_backend,
        captured_decode=a.captured_decode, prefix_cache=a.prefix_cache, cpu_affinity=a.cpu_affinity,
        mamba_track_interval=(-(-256 // max(a.page_size, 1)) * max(a.page_size, 1) if a.mamba_track_interval is None
                              else a.mamba_track_interval),
        mamba_checkpoint_slots=a.mamba_checkpoint_slots,
    )
