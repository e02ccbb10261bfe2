"""Which attention kernel a layer gets, the errors when the requested one cannot run, and the
vllm_flash_attn adapter driving a whole engine (against a reference of the kernel's
documented semantics — tests/gpu runs the real kernel)."""
from __future__ import annotations

import copy
import pytest
import torch

from engine_helpers import make_engine, tiny_model
from flash_reference import varlen_paged_reference
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.local import run_to_completion
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.model.attn_backends import FlashPaged, SdpaPaged, select_backend
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.hybrid import HybridModel
from tiny_models import tiny_config


def kernel_present():
    return varlen_paged_reference


def kernel_absent():
    return None


@pytest.mark.parametrize("requested", ["auto", "sdpa"])
def test_cpu_layers_use_sdpa(requested):
    model = HybridModel(tiny_config("full_swa_mamba"), attn_backend=requested)
    assert [b.name for b in model.attention_backends] == ["sdpa", "sdpa"]
    assert model.attention_backend_name == "sdpa"
    assert HybridModel(tiny_config("mamba")).attention_backend_name is None


def test_auto_picks_flash_only_on_cuda_half_precision_when_it_imports():
    pick = lambda dev, dt, hd=64, imp=kernel_present: select_backend("auto", dev, dt, hd, imp)  # noqa: E731
    assert isinstance(pick("cuda", torch.bfloat16), FlashPaged)
    assert isinstance(pick("cuda:1", torch.float16), FlashPaged)
    assert isinstance(pick("cuda", torch.bfloat16, imp=kernel_absent), SdpaPaged)
    assert isinstance(pick("cuda", torch.float32), SdpaPaged)  # FlashAttention-2 has no fp32 kernels
    assert isinstance(pick("cuda", torch.float64), SdpaPaged)
    assert isinstance(pick("cpu", torch.bfloat16), SdpaPaged)
    assert isinstance(pick("cuda", torch.bfloat16, hd=12), SdpaPaged)
    assert isinstance(pick("cuda", torch.bfloat16, hd=512), SdpaPaged)
    assert isinstance(select_backend("sdpa", "cuda", torch.bfloat16, 64, kernel_present), SdpaPaged)


@pytest.mark.parametrize("device,dtype,importer,why", [
    ("cpu", torch.bfloat16, kernel_present, "needs CUDA"),
    ("cuda", torch.float32, kernel_present, "float16 or bfloat16"),
    ("cuda", torch.bfloat16, kernel_absent, "does not import"),
])
def test_requesting_flash_where_it_cannot_run_is_a_clear_error(device, dtype, importer, why):
    with pytest.raises(HyraxInputError, match=why):
        select_backend("vllm_flash_attn", device, dtype, 64, importer)


def test_unknown_backend_names_are_refused():
    with pytest.raises(HyraxInputError, match="attention backend must be one of"):
        select_backend("flashinfer", "cpu", torch.float32, 64)
    with pytest.raises(HyraxInputError, match="attention-backend must be one of"):
        EngineConfig(attention_backend="flashinfer")


def test_flash_needs_pages_of_a_multiple_of_16_tokens():
    FlashPaged(varlen_paged_reference).check_page_size(32)
    with pytest.raises(HyraxInputError, match="multiple of 16"):
        FlashPaged(varlen_paged_reference).check_page_size(8)
    model = copy.deepcopy(tiny_model("full_swa_mamba"))
    for layer in model.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.backend = FlashPaged(varlen_paged_reference)
    with pytest.raises(HyraxInputError, match="page-size must be a multiple of 16"):
        make_engine(model, page_size=8)


def _outputs(model, **overrides):
    engine = make_engine(model, **overrides)
    prompts = [[(5 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((3, 21, 40, 9, 33, 17))]
    ids = [engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    run_to_completion(engine)
    engine.check_invariants()
    assert engine.is_idle_clean()
    return [engine.finished_requests[i].output_ids for i in ids], engine.stats.summary()


@pytest.mark.parametrize("layout", ["full", "swa_mamba", "full_swa_mamba"])
def test_engine_through_the_flash_adapter_equals_sdpa_with_forced_retraction(layout):
    """Chunked prefill, mixed steps, released SWA pages and restores into new pages, all read
    through block tables: the same tokens as the SDPA engine (float64 weights)."""
    sdpa = tiny_model(layout, torch.float64)
    flash = copy.deepcopy(sdpa)
    for layer in flash.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.backend = FlashPaged(varlen_paged_reference)
    kw = dict(page_size=16, dtype="float64", forced_retraction_interval=3, max_batch_tokens=24, prefill_chunk=8)
    want, _ = _outputs(sdpa, **kw)
    got, stats = _outputs(flash, **kw)
    assert stats["retractions"] >= 3 and stats["restore_fallbacks"] == 0, stats
    assert got == want


def test_generate_cli_refuses_flash_on_cpu_with_one_line(capsys):
    from hyrax.cluster.cli import main

    rc = main(["generate", "--prompt", "hi", "--max-tokens", "2", "--attention-backend", "vllm_flash_attn"])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    assert "vllm_flash_attn attention backend cannot be used: it needs CUDA" in err
    assert len(err.strip().splitlines()) == 1, err
