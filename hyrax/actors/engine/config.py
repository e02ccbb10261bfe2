"""Engine options, validated once. `hyrax generate` and `hyrax serve` share these names."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from hyrax.actors.model.attn_backends import BACKENDS as ATTENTION_BACKENDS
from hyrax.actors.cpu_claims import AFFINITY_MODES
from hyrax.actors.model.captured_decode import CAPTURE_MODES
from hyrax.actors.model.errors import HyraxInputError

BACKUP_MODES = ("cpu_tensor", "host_pool", "recompute")
PREFILL_ORDERS = ("shortest", "fcfs")
CAPACITY_FIELDS = ("kv_capacity_tokens", "swa_capacity_tokens", "mamba_slots")  # what --gpu-memory-fraction sizes



MAX_STEP_DELAY_MS = 10_000.0  # slower than any real device, still short of the executor's rank timeout (60 s)


@dataclass(frozen=True)
class UnsafeFaults:
    """Test-only fault injection. Refused unless `allow_unsafe` is set explicitly.

    skip_backup_component: a rank's backup silently leaves this component out (a comma-separated
        list leaves several out: `mamba_conv,mamba_ssm` is the whole recurrent state).
    restore_into_old_indices: restore writes to the request's old indices, not new ones.
    corrupt_backup_component: flip a byte of this component's backup after checksumming.
    disable_verification: restore trusts the backup (no completeness/ownership/checksum check).
    only_rank: apply the faults on this TP rank only (None: every rank).
    step_error_at_context: a rank's step raises (as an out-of-memory would) when a request in
        it reaches this many tokens of context (0: off). The rank stays alive.
    oom_above_tokens / oom_above_requests: a rank runs a step that has more than this many
        tokens / requests (writing their state), then raises `torch.OutOfMemoryError`, as a
        forward that ran out of memory part-way would (0: off; hyrax.testing.oom).
    stand_in_memory: per TP rank, (total, used, activation peak) bytes of a stand-in device that
        `--gpu-memory-fraction` sizes the pools from instead of the real one (hyrax.testing.memory).
    step_delay_ms: a rank sleeps this long before each step (0: off): a slow device, for tests
        that need requests in flight for a known time (the outputs do not change).
    """

    skip_backup_component: str | None = None
    restore_into_old_indices: bool = False
    corrupt_backup_component: str | None = None
    disable_verification: bool = False
    only_rank: int | None = None
    step_error_at_context: int = 0
    oom_above_tokens: int = 0
    oom_above_requests: int = 0
    stand_in_memory: tuple[tuple[int, int, int], ...] = ()
    step_delay_ms: float = 0.0

    def __post_init__(self):
        for name in ("oom_above_tokens", "oom_above_requests"):
            if getattr(self, name) < 0:
                raise HyraxInputError(f"{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        if not 0 <= self.step_delay_ms <= MAX_STEP_DELAY_MS:
            raise HyraxInputError(f"step_delay_ms must be in [0, {MAX_STEP_DELAY_MS}] (0 = off), got {self.step_delay_ms}")

    @property
    def any(self) -> bool:
        return bool(self.skip_backup_component or self.restore_into_old_indices
                    or self.corrupt_backup_component or self.disable_verification or self.step_error_at_context
                    or self.out_of_memory or self.stand_in_memory or self.step_delay_ms)

    @property
    def out_of_memory(self) -> bool:
        return bool(self.oom_above_tokens or self.oom_above_requests)

    @property
    def skipped(self) -> frozenset[str]:
        return frozenset(n.strip() for n in (self.skip_backup_component or "").split(",") if n.strip())

    def check_components(self, names: set[str] | frozenset[str]) -> None:
        """Raise HyraxInputError when a fault names a component the model does not have."""
        named = set(self.skipped) | ({self.corrupt_backup_component} if self.corrupt_backup_component else set())
        unknown = sorted(named - set(names))
        if unknown:
            raise HyraxInputError(f"fault injection names unknown component(s) {', '.join(unknown)}; "
                                  f"this model has {', '.join(sorted(names))}")

    def applies_to(self, rank: int) -> bool:
        return self.only_rank is None or self.only_rank == rank


# The default prefill chunk. Under load a shorter chunk than a 512-token step budget wins:
# full stack, the quick bench's c=16 workload, 6 runs each alternating, 256 vs 512: TTFT p50
# 143-170 vs 163-196 ms, 533-613 vs 449-515 output tok/s (a prompt arriving into a busy
# replica waits for the steps in flight, each longer with 512-token chunks; docs/architecture.md).
PREFILL_CHUNK = 256
# The default token budget of a step on a CPU: one whole chunk. Against 512-token steps (256-token
# chunks in both), in-process, the quick c=16 workload, runs alternating in one process: the bench
# model 1,086 vs 1,019 output tok/s and TTFT p50 60 vs 82 ms (8 rounds; shorter in every round),
# the large model 50 vs 51 tok/s and 2.99 vs 4.41 s (6 rounds); docs/architecture.md. On CUDA the
# budget stays the earlier 512: not measured there (no GPU has run this code yet).
MAX_BATCH_TOKENS = 256
MAX_BATCH_TOKENS_CUDA = 512


def step_budget_for(device_type: str) -> int:
    """The default step budget on a device of this type ("cpu", "cuda", ...)."""
    return MAX_BATCH_TOKENS_CUDA if device_type == "cuda" else MAX_BATCH_TOKENS


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    kv_capacity_tokens: int = 8192
    swa_capacity_tokens: int | None = None
    mamba_slots: int = 64
    max_running: int = 64
    # tokens per step (prompt chunks and decodes); None: the device's default (`for_device`), at
    # least the prefill chunk - what `hyrax serve` passes when --max-batch-tokens is not given
    max_batch_tokens: int | None = MAX_BATCH_TOKENS
    # prompt tokens per request per step; None: PREFILL_CHUNK, or max_batch_tokens if smaller
    prefill_chunk: int | None = None
    # the order prompts are prefilled in (scheduler.prefill_order): "shortest" remaining first
    # among those that arrived together (scheduler.SHORTEST_FIRST_WINDOW_S), or "fcfs"
    prefill_order: str = "shortest"
    retraction_backup: str = "cpu_tensor"
    host_pool_mb: float = 256.0
    forced_retraction_interval: int = 0
    deterministic: bool = False
    max_model_len: int | None = None
    dtype: str = "auto"  # auto: float32 on the CPU, bfloat16 (float16 before sm80) on CUDA
    faults: UnsafeFaults = field(default_factory=UnsafeFaults)
    allow_unsafe: bool = False
    role: str = "colocated"  # "prefill": hand requests off after their first token
    overlap: bool = False  # plan step N+1 while the ranks run step N
    # Ray replicas: steps through a compiled graph over the ranks (step_graph.py); on in `hyrax
    # serve` (--no-compiled-graph: plain actor calls), off here as overlap is, for library users
    compiled_graph: bool = False
    attention_backend: str = "auto"  # auto | sdpa | vllm_flash_attn (see model/attn_backends.py)
    # decode-only steps through a captured forward (model/captured_decode.py, docs/captured-steps.md):
    # off | compile (torch.compile; 1.2-1.4x the bench models' CPU decode forward after a ~6-9 s
    # first compile) | cuda_graphs (not yet run on a GPU). Off by default: the compile is start-up time
    captured_decode: str = "off"
    # auto: a CPU rank claims CPUs of its own and the coordinator's step loop keeps off them
    # (actors/cpu_claims.py) | off: wherever the OS puts them
    cpu_affinity: str = "auto"
    offer_lease_s: float = 10.0  # an offered hand-off not acknowledged in time is reclaimed (freed)
    # prefix cache (docs/prefix-cache.md): on for colocated and prefill replicas (a decode replica
    # receives its requests' state and never matches a prompt)
    prefix_cache: bool = True
    mamba_track_interval: int = 256  # checkpoint the recurrent state every N tokens (a multiple of page_size)
    mamba_checkpoint_slots: int = 0  # checkpoint pool per recurrent component; 0: 3 x mamba_slots
    # pools sized from free device memory (memory_budget.py): F * total - used - activation peak,
    # shared in the proportions of the capacities above; those named in fixed_capacities keep
    # their values (the CLI names the flags given explicitly)
    gpu_memory_fraction: float | None = None
    fixed_capacities: tuple[str, ...] = ()

    @property
    def caches_prefixes(self) -> bool:
        return self.prefix_cache and self.role != "decode"

    @property
    def checkpoint_slots(self) -> int:
        """Slots of each recurrent component's checkpoint pool (0 when the cache is off)."""
        if not self.caches_prefixes:
            return 0
        return self.mamba_checkpoint_slots or 3 * self.mamba_slots

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with a step budget left to the device (None) resolved for `device_type`:
        its default (`step_budget_for`), or the prefill chunk where that is larger. A config with
        a budget is returned as it is."""
        if self.max_batch_tokens is not None:
            return self
        return dataclasses.replace(self, max_batch_tokens=max(step_budget_for(device_type), self.prefill_chunk))

    def __post_init__(self):
        _check_types(self)
        if self.prefill_chunk is None:
            object.__setattr__(self, "prefill_chunk", min(PREFILL_CHUNK, self.max_batch_tokens or PREFILL_CHUNK))

        def positive(name):
            if getattr(self, name) < 1:
                raise HyraxInputError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for n in ("page_size", "kv_capacity_tokens", "mamba_slots", "max_running", "prefill_chunk"):
            positive(n)
        if self.max_batch_tokens is not None:
            positive("max_batch_tokens")
        if self.retraction_backup not in BACKUP_MODES:
            raise HyraxInputError(f"retraction-backup must be one of {', '.join(BACKUP_MODES)}")
        if self.forced_retraction_interval < 0:
            raise HyraxInputError("forced-retraction-interval must be >= 0 (0 = off)")
        if self.host_pool_mb < 0:
            raise HyraxInputError("host-pool-mb must be >= 0")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "float64"):
            raise HyraxInputError("dtype must be auto, float32, bfloat16, float16 or float64")
        if self.faults.any and not self.allow_unsafe:
            raise HyraxInputError("fault-injection options are test-only: pass the explicit unsafe switch to use them")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise HyraxInputError(f"attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise HyraxInputError(f"prefill-order must be one of {', '.join(PREFILL_ORDERS)}, "
                                  f"got {self.prefill_order!r}")
        if self.cpu_affinity not in AFFINITY_MODES:
            raise HyraxInputError(f"cpu-affinity must be one of {', '.join(AFFINITY_MODES)}, got {self.cpu_affinity!r}")
        if self.captured_decode not in CAPTURE_MODES:
            raise HyraxInputError(f"captured-decode must be one of {', '.join(CAPTURE_MODES)}, "
                                  f"got {self.captured_decode!r}")
        if self.role not in ("colocated", "prefill", "decode"):
            raise HyraxInputError("role must be colocated, prefill or decode")
        if not self.offer_lease_s > 0:
            raise HyraxInputError("offer-lease-s must be > 0")
        if self.mamba_track_interval < 1 or self.mamba_track_interval % self.page_size:
            raise HyraxInputError(f"mamba-track-interval must be a positive multiple of the page size "
                                  f"({self.page_size}), got {self.mamba_track_interval}")
        if self.mamba_checkpoint_slots < 0:
            raise HyraxInputError("mamba-checkpoint-slots must be >= 0 (0 = 3 x mamba-slots)")
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 1:
            raise HyraxInputError(f"gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        unknown = sorted(set(self.fixed_capacities) - set(CAPACITY_FIELDS))
        if unknown:
            raise HyraxInputError(f"fixed_capacities names {', '.join(unknown)}; the capacities are "
                                  f"{', '.join(CAPACITY_FIELDS)}")
        if self.max_batch_tokens is not None and self.prefill_chunk > self.max_batch_tokens:
            raise HyraxInputError(f"prefill-chunk ({self.prefill_chunk}) must not exceed max-batch-tokens "
                                  f"({self.max_batch_tokens})")


# a field's annotation -> the types its value may have (bool is no int here, an int is a float)
_SCALARS = {"int": (int,), "bool": (bool,), "float": (int, float), "str": (str,)}


def _check_types(config: EngineConfig) -> None:
    """Every scalar field has its annotated type: a YAML or Python caller's `"false"` for a
    switch or `3.7` for a count is an error naming the field, never a silently odd engine."""
    for f in fields(config):
        kind, _, none = f.type.partition(" | ")
        ok = _SCALARS.get(kind)
        if ok is None:
            continue
        v = getattr(config, f.name)
        if v is None and none == "None":
            continue
        if not isinstance(v, ok) or (kind != "bool" and isinstance(v, bool)):
            raise HyraxInputError(f"{f.name.replace('_', '-')} must be {'a' if kind != 'int' else 'an'} {kind}"
                                  f"{' or None' if none else ''}, got {v!r}")
