"""CUDA-graph decode steps (hyrax/actors/model/cuda_graphs.py) against the eager CUDA run
(skipped without CUDA; one CPU check of the runs' batch sizes). NOT YET RUN: no GPU was
available when the path was written; this is the check to run first where one is."""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import demo_greedy
from hyrax.actors.model.errors import HyraxInputError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LENGTHS = (5, 40, 130, 77, 9)


def _same_but_one(a: list[list[int]], b: list[list[int]]) -> None:
    """Equal for all requests but at most one: a graph's batch is padded (rows to its bucket, keys
    to a power of two), so its products may run other kernels and sum in another order than the
    eager batch's, which can flip one greedy near-tie (as tests/gpu/test_cuda_paths.py allows)."""
    differ = sum(x != y for x, y in zip(a, b, strict=True))
    assert differ <= 1, (a, b)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decode_gives_the_eager_tokens_with_retraction():
    kw = dict(dtype="float32", attention_backend="sdpa", forced_retraction_interval=3)
    eager, _ = demo_greedy("cuda", LENGTHS, **kw)
    graphs, stats = demo_greedy("cuda", LENGTHS, captured_decode="cuda_graphs", **kw)
    _same_but_one(graphs, eager)
    assert stats["retractions"] >= 3


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decode_refuses_the_flash_backend():
    pytest.importorskip("vllm_flash_attn")
    with pytest.raises(HyraxInputError, match="needs --attention-backend sdpa"):
        demo_greedy("cuda", (5,), dtype="bfloat16", attention_backend="vllm_flash_attn",
                    captured_decode="cuda_graphs")


def _moe_model(device: str):
    """A tiny model with routed experts (Mamba2 and attention layers, each with an MoE of 6
    experts, top 2, and a shared expert), random weights N(0, 0.3) from a fixed seed, on `device`."""
    from hyrax.actors.model.config import ModelConfig, MoeConfig
    from hyrax.actors.model.hybrid import HybridModel

    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                      mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, max_position_embeddings=1024,
                      layer_types=("mamba2", "full_attention", "mamba2", "full_attention"), ffn_types=("moe",) * 4,
                      moe=MoeConfig(num_experts=6, top_k=2, intermediate_size=32, shared_intermediate_size=32,
                                    router="topk_softmax"))
    model = HybridModel(cfg, dtype=torch.float32, device=device, attn_backend="sdpa")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
            else:
                p.copy_((1.0 if "norm" in name else 0.0) + torch.randn(p.shape, generator=g) * 0.3)
    return model.to(device)


def _staggered(device: str, captured_decode: str, moe: bool = False):
    """Five requests ending at different steps, greedy, batched (not deterministic mode, whose
    forwards run one request each, so every decode batch would be of one sequence): their tokens,
    the model's decode forward (a CapturedDecode with cuda_graphs, holding its graphs), and the
    size of every decode-only batch it ran (5, 4, 3, 2 and 1 sequences as the requests end).
    The demo model, or with `moe` the tiny model with routed experts."""
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.local import engine_for_model, run_to_completion
    from hyrax.actors.engine.request import SamplingParams
    from hyrax.actors.model.demo import DEMO_DIR
    from hyrax.actors.model.loader import load_model

    model = _moe_model(device) if moe else load_model(str(DEMO_DIR), dtype=torch.float32, device=device,
                                                      attn_backend="sdpa", row_plans=False)
    e = engine_for_model(model, EngineConfig(dtype="float32", attention_backend="sdpa",
                                             captured_decode=captured_decode), device=device)
    forward, sizes = model.forward, []

    def counted(batch, pools, all_logits=False):
        if batch.max_len == 1 and not all_logits:
            sizes.append(batch.num_seqs)
        return forward(batch, pools, all_logits)
    model.forward = counted
    ids = [e.add_request([(7 * i + j) % 256 for j in range(n)], SamplingParams(max_tokens=6 + 4 * i, ignore_eos=True))
           for i, n in enumerate(LENGTHS)]
    run_to_completion(e)
    e.check_invariants()
    assert e.is_idle_clean()
    return [e.finished_requests[i].output_ids for i in ids], forward, sizes


@pytest.mark.parametrize("moe", [False, True], ids=["demo", "moe"])
def test_the_staggered_run_decodes_batches_of_five_down_to_one(moe):
    """What the CUDA tests below rely on, checked on the CPU: the run's decode steps batch
    5, 4, 3, 2 and 1 sequences (in deterministic mode all of them were of one), and the requests'
    tokens differ (the MoE model's random weights do not collapse to one token)."""
    tokens, _, sizes = _staggered("cpu", "off", moe)
    assert {5, 4, 3, 2, 1} <= set(sizes), sizes
    assert len({t for out in tokens for t in out}) > 5, tokens


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decode_pads_batches_to_buckets_and_gives_the_eager_tokens():
    """Batches of 5 to 1 sequences replay the graphs of buckets 8, 4, 2 and 1 (padding rows on
    the pools' scratch unit), and every request's tokens are the eager run's."""
    eager, _, sizes = _staggered("cuda", "off")
    graphs, decode, graph_sizes = _staggered("cuda", "cuda_graphs")
    _same_but_one(graphs, eager)
    assert graph_sizes == sizes and {5, 4, 3, 2, 1} <= set(sizes), sizes
    buckets = {key[0] for key in decode.decode.graphs}
    assert buckets == {8, 4, 2, 1}, buckets  # batches of 5 replay the graph of 8, of 3 the graph of 4


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decode_of_a_model_with_routed_experts_gives_the_eager_tokens():
    """The graphs run the MoE layers in their static dispatch (moe.py: every expert over every
    padded row, no host reads), the eager run their sparse one: the same tokens but at most one
    request's (the products sum in another order)."""
    eager, _, sizes = _staggered("cuda", "off", moe=True)
    graphs, decode, graph_sizes = _staggered("cuda", "cuda_graphs", moe=True)
    _same_but_one(graphs, eager)
    assert graph_sizes == sizes
    assert {key[0] for key in decode.decode.graphs} == {8, 4, 2, 1}
