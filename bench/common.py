"""Shared pieces of the suites: sizes per mode, progress on stderr, timing helpers, RSS,
the local Ray cluster, and the checkpoints the suites run on."""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH_SEED = 1234


@dataclass(frozen=True)
class Profile:
    """How much work each suite does. `quick` fits in a few minutes on 2 CPU cores."""

    name: str
    judge_timing: bool = True  # False: timing rows carry no target (the smoke test's tiny sizes)
    # serving: concurrency -> number of requests; output lengths drawn from out_range
    serving_requests: dict = field(default_factory=dict)
    serving_out_range: tuple[int, int] = (64, 128)
    serving_prompt_range: tuple[int, int] = (32, 512)
    serving_target_concurrency: int = 16
    # runs of the same workload at concurrency 1 and at the target concurrency (the prefix cache
    # flushed in between), the in-process engine's runs interleaved with the latter: medians
    serving_repeats: int = 5
    # serving, large model: requests at concurrency 16 (0: skip), output and prompt lengths. The
    # answers are several times their prompts, so that decoding, not prefill, dominates
    # transformers' sequential time (its "ceiling" row: bench/README.md)
    large_requests: int = 32
    large_out_range: tuple[int, int] = (96, 160)
    large_prompt_range: tuple[int, int] = (32, 256)
    # coordination: decode steps timed per (tp, batch)
    coord_batches: tuple[int, ...] = (1, 32)
    coord_tps: tuple[int, ...] = (1, 2)
    coord_steps: int = 30
    # per-step CPU (step_cpu.py): steady decode steps timed per run (the requests' contexts grow
    # with them, and so do their page tables, which batch building reads)
    step_cpu_steps: int = 120
    # retraction: requests backed up and restored per round, rounds, crossover sweep
    retract_prompts: tuple[int, ...] = (256, 512, 768, 1024)
    retract_rounds: int = 9
    crossover_lengths: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    crossover_reps: int = 5
    # transfer: prompt lengths handed over, repetitions each
    transfer_prompts: tuple[int, ...] = (128, 512, 1024)
    transfer_reps: int = 9
    # memory: requests in all, the early RSS mark, concurrent requests, forced retraction
    memory_total: int = 1000
    memory_first: int = 100
    memory_concurrency: int = 8
    memory_forced_interval: int = 2
    memory_formula_prompts: tuple[int, ...] = (5, 40, 300, 1000)
    # prefix cache: shared prefix length, requests that share it, unique-prompt requests (0 % hits)
    prefix_len: int = 1024
    prefix_requests: int = 8
    prefix_unique_requests: int = 16
    prefix_rounds: int = 4  # routing: rounds of one request per prefix group (the first fills the caches)
    # soak: requests in the chaos run, share of vanishing clients, clients at once, chaos pace
    soak_requests: int = 10_000
    soak_vanish_share: float = 0.25
    soak_concurrency: int = 32
    soak_forced_interval: int = 3
    soak_operator_period_s: float = 1.0

    def target(self, t: str) -> str:
        """A timing target, or none at sizes too small to judge timing."""
        return t if self.judge_timing else ""


FULL = Profile(
    name="full",
    serving_requests={1: 8, 4: 24, 16: 64, 64: 128},
)
QUICK = Profile(
    name="quick",
    serving_requests={1: 3, 4: 8, 16: 32},
    serving_out_range=(24, 40),
    large_requests=16,
    large_out_range=(64, 96),
    large_prompt_range=(32, 128),
    coord_steps=40,
    step_cpu_steps=48,
    retract_prompts=(256, 1024),
    retract_rounds=5,
    crossover_lengths=(32, 128, 512, 1024),
    crossover_reps=3,
    transfer_prompts=(128, 512, 1024),
    transfer_reps=5,
    memory_total=300,
    memory_first=50,
    prefix_requests=6,
    prefix_unique_requests=12,
    soak_requests=1000,
)
TINY = Profile(  # the smoke test: plumbing only, seconds
    name="tiny",
    judge_timing=False,
    serving_requests={1: 1},
    serving_out_range=(4, 8),
    serving_repeats=1,
    large_requests=0,
    coord_steps=2,
    step_cpu_steps=40,
    retract_prompts=(64,),
    retract_rounds=1,
    crossover_lengths=(32,),
    crossover_reps=1,
    transfer_prompts=(64,),
    transfer_reps=1,
    memory_total=24,
    memory_first=8,
    memory_concurrency=4,
    memory_formula_prompts=(5, 100),
    prefix_len=64,
    prefix_requests=2,
    prefix_unique_requests=2,
    prefix_rounds=2,
    soak_requests=60,
    soak_concurrency=8,
    soak_operator_period_s=0.3,
)
PROFILES = {p.name: p for p in (FULL, QUICK, TINY)}

# ---- progress ------------------------------------------------------------------------------
_T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[bench {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ---- statistics ----------------------------------------------------------------------------
def percentile(xs, q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of a non-empty sequence; None if empty."""
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(xs) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def time_call(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median seconds of `fn()` over `reps` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


# ---- process memory ------------------------------------------------------------------------
def rss_bytes() -> int:
    """Resident set size of this process: psutil when installed, else /proc/self/status."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("cannot read VmRSS from /proc/self/status") from None
    return psutil.Process().memory_info().rss


# ---- Ray -----------------------------------------------------------------------------------
_ray_started = False


def ensure_ray():
    """Start one local Ray cluster for the whole run (or join the one already up)."""
    global _ray_started
    from hyrax.cluster.ray_cluster import init_ray

    # Ray starts worker processes at niceness 15 by default: on a shared machine Hyrax's actors
    # would then get a fraction of the CPU that the baselines in this (nice 0) process get.
    os.environ.setdefault("RAY_worker_niceness", "0")
    if init_ray(num_cpus=8, dashboard=False):
        _ray_started = True
        progress("started a local Ray cluster (127.0.0.1, 8 logical CPUs, worker niceness "
                 f"{os.environ['RAY_worker_niceness']})")
    import ray

    return ray


def shutdown_ray() -> None:
    global _ray_started
    if _ray_started:
        import ray

        ray.shutdown()
        _ray_started = False


# ---- threads -------------------------------------------------------------------------------
def single_thread_torch() -> None:
    """Every Hyrax rank runs torch with HYRAX_TORCH_THREADS (default 1) intra-op threads; the
    in-process engines and the transformers baseline get the same budget."""
    import torch

    from hyrax.env import torch_threads

    torch.set_num_threads(torch_threads())


# ---- checkpoints ---------------------------------------------------------------------------
def demo_model_dir() -> str:
    """The shipped demo checkpoint: full + sliding-window attention + Mamba2, so every
    state component kind (token, window, slot) is present."""
    from hyrax.actors.model.demo import DEMO_DIR

    return str(DEMO_DIR)


# Bamba shape close to the demo model: hidden 128, 6 layers (attention at 1 and 3), 8 Mamba
# heads of 32 channels, state 32, vocab 264. Transformers loads it, and so does Hyrax.
BAMBA_KW = dict(
    vocab_size=264, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3],
    mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=32, mamba_d_conv=4,
    mamba_expand=2, mamba_chunk_size=32, max_position_embeddings=2048,
    bos_token_id=None, eos_token_id=None, pad_token_id=0,  # ignore_eos runs; no early stop in HF
)


# The "large model" rows: ~110M parameters (hidden 768, 12 layers with attention at 3 and 9,
# 24 Mamba heads of 64, state 64, MLP 2048, vocab 8192), ~440 MB in float32, so that a decode
# step reads far more weight bytes than it spends in Python: the regime serving systems are for.
BAMBA_LARGE_KW = dict(
    BAMBA_KW, vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
    num_attention_heads=12, num_key_value_heads=4, attn_layer_indices=[3, 9],
    mamba_n_heads=24, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=64,
)


def make_bamba_checkpoint(path: Path, seed: int = BENCH_SEED, large: bool = False) -> Path:
    """A random Bamba checkpoint (transformers `save_pretrained`) plus a tokenizer.json that
    decodes every id to exactly one visible character, so that each streamed SSE chunk of a
    completion carries exactly the tokens of one engine step (client-side ITL is per token).
    `large`: the ~110M-parameter shape (BAMBA_LARGE_KW)."""
    import torch
    import transformers

    quiet_transformers()
    torch.manual_seed(seed)
    cfg = transformers.BambaConfig(**(BAMBA_LARGE_KW if large else BAMBA_KW))
    if large:  # transformers' own init of 110M parameters takes a minute and a half on 2 cores
        with torch.device("meta"):
            model = transformers.BambaForCausalLM(cfg).eval()
        model.to_empty(device="cpu")
    else:
        model = transformers.BambaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-degenerate recurrences (HF's defaults make every head alike)
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if large and p.dim() >= 2:
                p.normal_(0.0, cfg.initializer_range, generator=g)
            elif large:  # norms, biases, D
                p.fill_(0.0 if name.endswith("bias") else 1.0)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 1.5)
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    _write_char_tokenizer(path, cfg.vocab_size)
    return path


def quiet_transformers() -> None:
    """No progress bars or fallback-kernel notices from transformers in the bench output."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _write_char_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models

    vocab = {chr(0x100 + i): i for i in range(vocab_size)}  # Latin Extended and beyond: 1 char each
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=chr(0x100)))
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))


def load_demo_engine(config=None, model=None):
    """An in-process engine (one rank, no Ray) over the demo checkpoint."""
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.local import engine_for_model
    from hyrax.actors.model.hybrid import resolve_dtype
    from hyrax.actors.model.loader import load_model

    config = config or EngineConfig()
    if model is None:
        model = load_model(demo_model_dir(), dtype=resolve_dtype(config.dtype, "cpu"))
    return engine_for_model(model, config)


def run_until(engine, pred, max_steps: int = 100_000) -> None:
    for _ in range(max_steps):
        if pred():
            return
        engine.step()
    raise RuntimeError("benchmark engine did not reach the expected state")


def prompt_ids(rng, n: int, vocab: int = 256) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def env_summary() -> str:
    import platform

    import torch

    cores = os.cpu_count()
    return (f"{platform.node() or 'host'}: {platform.processor() or platform.machine()}, {cores} CPU cores, "
            f"torch {torch.__version__} ({torch.get_num_threads()} intra-op thread(s)), "
            f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M %Z')}")
