"""A Hugging Face Bamba checkpoint loads unchanged and computes what transformers computes."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.model.batch import SeqSlice
from hyrax.actors.model.loader import load_model
from tiny_models import fresh_pools, run_in_chunks, shuffled_pages, slots_for, step

transformers = pytest.importorskip("transformers")

PROMPT = 37


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model) of a tiny random Bamba: mamba, attention, mamba, attention."""
    torch.manual_seed(0)
    hc = transformers.BambaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3],
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_chunk_size=8, max_position_embeddings=256,
        initializer_range=0.1,  # logits of order 1, so an error of 1e-4 means something
        bos_token_id=None, eos_token_id=None, pad_token_id=0,  # greedy runs never stop early
    )
    hf = transformers.BambaForCausalLM(hc).eval()
    with torch.no_grad():  # the defaults (A_log = log(1..H), dt_bias = D = 1) would hide mistakes
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1, 1)
            elif name.endswith("dt_bias") or name.endswith(".D"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("bamba")
    hf.save_pretrained(path)
    return path, hf


def prompt(n: int = PROMPT) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("chunks", [[PROMPT], [16, 5, 16]], ids=["one_chunk", "chunked"])
def test_teacher_forced_logits_match_transformers(checkpoint, chunks):
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    assert model.cfg.layer_types == ("mamba2", "full_attention", "mamba2", "full_attention")
    ids = prompt()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.abs().max() > 1.0
    got = run_in_chunks(model, ids, chunks)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_greedy_decode_through_pools_matches_transformers_generate(checkpoint):
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    ids, new = prompt(10), 32
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new)[0, len(ids):].tolist()
    assert len(ref) == new
    pools = fresh_pools(model)
    pages, slots = shuffled_pages(model, 11, seed=2), slots_for(model, 0)
    logits = step(model, pools, [SeqSlice(ids, 0, pages, slots)])[0, -1]
    out = [int(logits.argmax())]
    while len(out) < new:
        pos = len(ids) + len(out) - 1
        logits = step(model, pools, [SeqSlice([out[-1]], pos, pages, slots)])[0, -1]
        out.append(int(logits.argmax()))
    assert out == ref
