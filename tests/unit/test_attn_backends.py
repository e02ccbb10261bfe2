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
from hyrax.actors.model.paged_decode import available as cpu_paged_unavailable
from hyrax.actors.model.hybrid import HybridModel
from tiny_models import tiny_config


def kernel_present():
    return varlen_paged_reference


def kernel_absent():
    return None


def sm(major, minor):
    """A device query that answers compute capability (major, minor) for any device."""
    return lambda device: (major, minor)


def no_gpu_query(device):
    raise AssertionError(f"asked the compute capability of {device}")


@pytest.mark.parametrize("requested,dtype,expected", [
    ("auto", torch.float32, "cpu_paged" if cpu_paged_unavailable() is None else "sdpa"),
    ("auto", torch.float64, "sdpa"), ("sdpa", torch.float32, "sdpa")])
def test_cpu_layers_use_the_cpu_kernel_for_float32_else_sdpa(requested, dtype, expected):
    model = HybridModel(tiny_config("full_swa_mamba"), dtype=dtype, attn_backend=requested)
    assert [b.name for b in model.attention_backends] == [expected, expected]
    assert model.attention_backend_name == expected
    assert HybridModel(tiny_config("mamba")).attention_backend_name is None


def test_auto_picks_flash_only_on_cuda_half_precision_when_it_imports():
    pick = lambda dev, dt, hd=64, imp=kernel_present: select_backend("auto", dev, dt, hd, imp, sm(9, 0))  # noqa: E731
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


@pytest.mark.parametrize("capability,flash", [
    ((7, 0), False), ((7, 5), False),  # V100, T4: no vllm-flash-attn 2.6 kernels
    ((8, 0), True), ((8, 6), True), ((8, 9), True), ((9, 0), True),  # A100, A10/3090, L4/4090, H100
    ((10, 0), False), ((12, 0), False),  # newer than sm90: not in 2.6's build
])
def test_auto_picks_flash_only_on_gpus_its_kernels_were_built_for(capability, flash):
    notes = []
    backend = select_backend("auto", "cuda:1", torch.bfloat16, 64, kernel_present, sm(*capability), notes.append)
    assert isinstance(backend, FlashPaged if flash else SdpaPaged)
    if flash:
        assert notes == []
    else:
        assert notes == [f"note: attention uses SDPA: vllm-flash-attn 2.6 runs on sm8x and sm90 GPUs only "
                         f"(this one is sm{capability[0]}{capability[1]})"]
        with pytest.raises(HyraxInputError, match=f"sm8x and sm90 GPUs only \\(this one is sm{capability[0]}"):
            select_backend("vllm_flash_attn", "cuda", torch.float16, 64, kernel_present, sm(*capability))


def test_the_gpu_is_asked_only_when_flash_could_otherwise_run():
    notes = []
    for dev, dt, imp in [("cpu", torch.bfloat16, kernel_present), ("cuda", torch.float32, kernel_present),
                         ("cuda", torch.bfloat16, kernel_absent)]:
        assert isinstance(select_backend("auto", dev, dt, 64, imp, no_gpu_query, notes.append), SdpaPaged)
    assert notes == []  # expected fallbacks (CPU, float32, no kernel) say nothing


def test_the_fallback_note_is_one_line_per_process(caplog):
    from hyrax.actors.model import attn_backends

    attn_backends._noted.clear()
    with caplog.at_level("WARNING", logger="hyrax.attention"):
        for _ in range(3):  # three attention layers
            select_backend("auto", "cuda", torch.float16, 64, kernel_present, sm(7, 5))
    assert [r.getMessage() for r in caplog.records] == [
        "note: attention uses SDPA: vllm-flash-attn 2.6 runs on sm8x and sm90 GPUs only (this one is sm75)"]


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
