"""Shared helpers for the per-family checkpoint tests (test_models_*.py): tiny random
transformers checkpoints, teacher-forced logits, greedy generation through the engine at
TP 1 and TP 2 (ranks in threads, lockstep all-reduce), under forced retraction.

Imported by the test modules next to it (pytest puts this folder on sys.path).
"""
from __future__ import annotations


import torch

from engine_helpers import BASE_CONFIG, assert_idle_clean, greedy
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.engine import Engine
from hyrax.actors.engine.executor import RankCalls, StepResult
from hyrax.actors.engine.local import engine_for_model
from hyrax.actors.engine.pools import host_pool_rows, pool_sizes_for
from hyrax.actors.engine.rank_runtime import RankRuntime, make_rank_runtime
from hyrax.actors.model.loader import load_model
from hyrax.actors.model.sharding import TP
from hyrax.actors.model.state import derive_components
from test_tp_math import LockstepAllReduce, in_threads
from tiny_models import run_in_chunks  # noqa: F401 - re-exported for the tests

MODES = ("cpu_tensor", "host_pool", "recompute")
VOCAB = 128
NEW_TOKENS = 8
# 9 prompt lengths: shorter than, equal to and longer than BASE_CONFIG's prefill_chunk (8)
PROMPT_LENGTHS = (2, 3, 5, 8, 11, 13, 17, 21, 30)


def randomize_hf_(hf: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give the recurrent and routing parameters values whose mistakes show (the library
    defaults, A_log = log(1..H), dt_bias = D = 1, zero correction bias, would hide them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
            elif name.endswith("dt_bias") or name.endswith(".D"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) - (1 if _zero_centred(hf) else 0))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return hf


def _zero_centred(hf) -> bool:
    return hf.config.model_type == "qwen3_next"


def save_checkpoint(hf: torch.nn.Module, path) -> None:
    hf.save_pretrained(path)


def prompts(lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_generate(hf, ids: list[int], new: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=new, min_new_tokens=new)
    return out[0, len(ids):].tolist()


def teacher_forced_max_diff(path, hf, ids: list[int], chunks: list[int]) -> float:
    model = load_model(path, dtype=torch.float32)
    got = run_in_chunks(model, ids, chunks)
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 0.5, "logits too small for a 1e-4 tolerance to mean anything"
    return float((got - ref).abs().max())


# ---- engines -------------------------------------------------------------------------------

def engine_config(**overrides) -> EngineConfig:
    return EngineConfig(**{**BASE_CONFIG, **overrides})


class ThreadedTPExecutor(RankCalls):
    """The executor interface over `tp_size` in-process ranks: every call runs on all ranks
    concurrently (threads), all-reduces and the token broadcast go through lockstep barriers."""

    def __init__(self, ranks: list[RankRuntime]):
        self.ranks = ranks
        self.num_ranks = len(ranks)

    def _each(self, method: str, *args) -> list:
        return in_threads([lambda rk=rk: getattr(rk, method)(*args) for rk in self.ranks])

    def submit(self, plan):
        return StepResult.gathered(self._each("execute", plan))

    def collect(self, handle: StepResult) -> StepResult:
        return handle


class _Broadcast:
    def __init__(self, ar: LockstepAllReduce):
        self.ar = ar

    def for_rank(self, rank: int):
        def broadcast(tokens):
            self.ar.posted[rank] = tokens
            self.ar.barrier.wait()
            out = list(self.ar.posted[0])
            self.ar.barrier.wait()
            return out

        return broadcast


def make_engine(path, tp_size: int = 1, **overrides) -> Engine:
    config = engine_config(**overrides)
    if tp_size == 1:
        return engine_for_model(load_model(path, dtype=torch.float32), config)
    ar = LockstepAllReduce(tp_size)
    models = [load_model(path, TP(r, tp_size), torch.float32, allreduce=ar.for_rank(r)) for r in range(tp_size)]
    cfg = models[0].cfg
    comps = derive_components(cfg, TP(0, tp_size), torch.float32)
    sizes = pool_sizes_for(comps, config)
    host = host_pool_rows(comps, sizes, config.host_pool_mb)
    bc = _Broadcast(ar)
    ranks = [make_rank_runtime(m, sizes, host, rank=r, faults=config.faults, broadcast=bc.for_rank(r))
             for r, m in enumerate(models)]
    return Engine(comps, sizes, host, ThreadedTPExecutor(ranks), config, cfg.vocab_size,
                  cfg.max_position_embeddings, cfg.eos_token_id, None)


def engine_greedy(engine: Engine, prompt_list: list[list[int]], new: int = NEW_TOKENS) -> list[list[int]]:
    return run_to_end(engine, [engine.add_request(p, greedy(new)) for p in prompt_list])


def run_to_end(engine: Engine, ids: list[str]) -> list[list[int]]:
    """Step until nothing is left, checking invariants; the requests' outputs, in order."""
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        engine.step()
        engine.check_invariants()
    assert_idle_clean(engine)
    return [engine.finished_requests[i].output_ids for i in ids]


def hand_off_all(prefill: Engine, decode: Engine, ids: list[str]) -> None:
    """Step the prefill engine until each of `ids` was offered, imported by `decode` (every
    import must verify) and acknowledged."""
    from hyrax.actors.engine.lifecycle import Outcome

    offered: set[str] = set()
    for _ in range(1_000):
        if len(offered) == len(ids):
            break
        for out in prefill.step():
            if out.handoff is not None:
                assert decode.import_request(out.handoff) == Outcome.VERIFIED
                assert prefill.release_handoff(out.req_id)
                offered.add(out.req_id)
    assert offered == set(ids)


def rank_logits(path, tp_size: int, ids: list[int], chunks: list[int]) -> list[torch.Tensor]:
    """Every rank's teacher-forced logits, ranks in threads with a lockstep all-reduce."""
    ar = LockstepAllReduce(tp_size)
    models = [load_model(path, TP(r, tp_size), torch.float32, allreduce=ar.for_rank(r)) for r in range(tp_size)]
    return in_threads([lambda m=m: run_in_chunks(m, ids, chunks) for m in models], ar.barrier.abort)
