"""Shared helpers for the engine unit tests: tiny models, engines, reference runs, and the
idle-clean check every scenario ends with.

Imported by the test_engine_* modules next to it (pytest puts this folder on sys.path).
Models are built once per (layout, dtype) and shared: a model holds weights only, every
engine gets its own pools.
"""
from __future__ import annotations

import copy
import functools
import random
from dataclasses import dataclass

import torch

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.engine import Engine
from hyrax.actors.engine.local import engine_for_model, run_to_completion
from hyrax.actors.engine.request import Request, SamplingParams, State
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.hybrid import HybridModel

# Four layers each; hidden size 32.
LAYOUTS = {
    "full": ("full_attention",) * 4,
    "swa": ("sliding_attention",) * 4,
    "mamba": ("mamba2",) * 4,
    "swa_mamba": ("sliding_attention", "mamba2", "sliding_attention", "mamba2"),
    "full_swa_mamba": ("full_attention", "mamba2", "sliding_attention", "mamba2"),
}
# The components of the full hybrid layout, in the order the model declares them.
HYBRID = "full_swa_mamba"
HYBRID_COMPONENTS = ("full_kv", "swa_kv", "mamba_conv", "mamba_ssm")

VOCAB = 96
PAGE_SIZE = 4
SLIDING_WINDOW = 5
MAX_TOKENS = 10

# Small pools that still fit every scenario here unpressured; host_pool_mb is kept small
# because every engine pre-allocates its host pool.
BASE_CONFIG = dict(
    page_size=PAGE_SIZE, kv_capacity_tokens=1024, mamba_slots=16, max_running=64,
    max_batch_tokens=32, prefill_chunk=8, host_pool_mb=2.0, deterministic=True,
)


def tiny_config(layout: str) -> ModelConfig:
    types = LAYOUTS[layout]
    return ModelConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, layer_types=types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2,
        mamba_d_conv=4, mamba_chunk_size=4,
        sliding_window=SLIDING_WINDOW if "sliding_attention" in types else None,
        max_position_embeddings=512,
    )


@functools.lru_cache(maxsize=None)
def tiny_model(layout: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> HybridModel:
    """Random weights large enough that state mistakes change greedy tokens:
    N(0, 0.3) everywhere, norm weights 1 + N(0, 0.3), A_log ~ U(-1, 1)."""
    model = HybridModel(tiny_config(layout), dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                new = torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1
            elif "norm" in name:
                new = 1 + torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3
            else:
                new = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3
            p.copy_(new.to(p.dtype))
    return model


def make_engine(model: HybridModel, **overrides) -> Engine:
    return engine_for_model(model, EngineConfig(**{**BASE_CONFIG, **overrides}))


def make_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    """n prompts of different lengths in [lo, hi]."""
    rng = random.Random(seed)
    lengths = rng.sample(range(lo, hi + 1), n) if hi - lo + 1 >= n else [rng.randint(lo, hi) for _ in range(n)]
    return [[rng.randrange(VOCAB) for _ in range(k)] for k in lengths]


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)



def assert_idle_clean(engine: Engine) -> None:
    """Every device and host pool is back to free + used == capacity with nothing owned by a
    request, no request is left anywhere and no rank holds a backup; what the prefix cache
    still holds is referenced by nothing, and flushing it frees every unit."""
    engine.check_invariants()
    assert engine.is_idle_clean(), engine.pool_usage()
    assert not engine.requests and not engine.running and not engine.waiting and not engine.retracted
    assert all(n == 0 for n in engine.executor.num_backups().values()), engine.executor.num_backups()
    engine.flush_cache()
    engine.check_invariants()
    for a in list(engine.alloc.values()) + list(engine.host_alloc.values()):
        assert a.num_free + a.num_used == a.capacity, a.name
        assert a.num_used == 0 and not a.owners(), (a.name, a.owners())


def run_requests(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 check_every_step: bool = True) -> list[list[int]]:
    """Add all prompts, run to completion (checking the allocation invariants after every
    step), assert the engine is idle and clean, return outputs in prompt order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
    for _ in range(10_000):
        if not engine.has_unfinished() and not engine.has_inflight():
            break
        engine.step()
        if check_every_step:
            engine.check_invariants()
    else:
        raise AssertionError("requests still unfinished after 10000 steps")
    assert_idle_clean(engine)
    return [engine.finished_requests[i].output_ids for i in ids]


@functools.lru_cache(maxsize=None)
def mixer_switch_outputs(layout: str, switch: str, **fixed: bool) -> list:
    """Greedy outputs of the tiny model, with every Mamba2 mixer's boolean attribute `switch`
    (which chooses a CPU kernel or the torch path) off, then on, and the attributes `fixed` set
    as given in both runs: chunked prefill, mixed and decode steps, forced retraction. Returns
    [outputs off, outputs on]."""
    from hyrax.actors.model.mamba2 import Mamba2Mixer

    outs = []
    for on in (False, True):
        model = copy.deepcopy(tiny_model(layout))
        for m in model.modules():
            if isinstance(m, Mamba2Mixer):
                assert getattr(m, switch), f"{switch} is off here: the test would compare the torch path with itself"
                setattr(m, switch, on)
                for name, value in fixed.items():
                    setattr(m, name, value)
        engine = make_engine(model, deterministic=False, forced_retraction_interval=4)
        prompts = [[(3 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((4, 19, 11, 30, 26))]
        outs.append(run_requests(engine, prompts, SamplingParams(max_tokens=10, ignore_eos=True)))
    return outs


def _reference(layout: str, dtype: torch.dtype, prompts: tuple[tuple[int, ...], ...], max_tokens: int,
               deterministic: bool) -> tuple[tuple[int, ...], ...]:
    e = make_engine(tiny_model(layout, dtype), deterministic=deterministic)
    outs = run_requests(e, [list(p) for p in prompts], greedy(max_tokens), check_every_step=False)
    s = e.stats.summary()
    assert s["retractions"] == 0, s
    return tuple(tuple(o) for o in outs)


def reference_outputs(layout: str, dtype: torch.dtype, prompts: list[list[int]], max_tokens: int = MAX_TOKENS,
                      deterministic: bool = True) -> list[list[int]]:
    """Greedy outputs of an uninterrupted run (no retraction, roomy pools); cached."""
    key = tuple(tuple(p) for p in prompts)
    return [list(o) for o in _reference(layout, dtype, key, max_tokens, deterministic)]


# ---- the slot-reuse scenario ---------------------------------------------------------------

PROMPT_A = [(7 * i + 3) % VOCAB for i in range(13)]
PROMPT_B = [(11 * i + 5) % VOCAB for i in range(22)]  # more pages than A: B takes all of A's
MAX_A, MAX_B = 10, 12


@dataclass
class SlotReuse:
    engine: Engine
    a: Request
    b: Request
    a_old: dict[str, list[int]]  # A's indices when it was retracted
    b_indices: dict[str, list[int]]  # B's indices once it had decoded into A's freed slots
    a_new: dict[str, list[int]]  # A's indices right after resume ({} when it fell back)
    retract_mode: str
    resume_result: str

    @property
    def out_a(self) -> list[int]:
        return self.a.output_ids

    @property
    def out_b(self) -> list[int]:
        return self.b.output_ids


def _step_until(engine: Engine, cond, limit: int = 200) -> None:
    for _ in range(limit):
        if cond():
            return
        engine.step()
        engine.check_invariants()
    raise AssertionError("condition not reached")


def slot_reuse_scenario(model: HybridModel, **overrides) -> SlotReuse:
    """A runs and decodes; A is retracted and held; B is admitted into A's freed indices
    (LIFO allocators hand freed indices out next) and decodes, overwriting them; A is
    resumed while B still runs; both run to completion. Ends with the idle-clean check."""
    e = make_engine(model, **overrides)
    aid = e.add_request(PROMPT_A, greedy(MAX_A))
    a = e.requests[aid]
    _step_until(e, lambda: len(a.output_ids) >= 3)
    a_old = copy.deepcopy(a.indices)
    mode = e.retract([aid], hold=True)[aid]
    assert a.state == State.RETRACTED and a.hold
    bid = e.add_request(PROMPT_B, greedy(MAX_B))
    b = e.requests[bid]
    _step_until(e, lambda: len(b.output_ids) >= 2)
    assert a.state == State.RETRACTED  # held: not resumed automatically
    b_indices = copy.deepcopy(b.indices)
    resume_result = e.resume([aid])[aid]
    assert b.state == State.RUNNING  # B still owns A's old indices while A is restored
    a_new = copy.deepcopy(a.indices)
    run_to_completion(e)
    assert_idle_clean(e)
    return SlotReuse(e, a, b, a_old, b_indices, a_new, mode, resume_result)


def reference_a_b(model_layout: str, dtype: torch.dtype) -> tuple[list[int], list[int]]:
    """A's and B's outputs, each run uninterrupted."""
    ref_a = reference_outputs(model_layout, dtype, [PROMPT_A], MAX_A)[0]
    ref_b = reference_outputs(model_layout, dtype, [PROMPT_B], MAX_B)[0]
    return ref_a, ref_b
