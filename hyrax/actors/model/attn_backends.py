"""Attention kernels over the paged K/V pool, and the one place that picks among them.

Pool layout per layer: (rows, 2, kv_heads, head_dim) with rows = pages * page_size — K and V
of one token in one row. Both backends read the same bytes, so a backup, a transfer or a
migration never depends on which backend wrote them.

- `sdpa`: gathers each request's visible rows and calls torch SDPA with an explicit mask.
  The CPU path, the CUDA fallback, and the oracle the GPU tests compare against.
- `cpu_paged`: on the CPU, decode steps (one query token per sequence) through a C kernel
  that reads each key and value row where it lies in the pool (paged_decode.py), with no
  gathered copy, no padding to the longest sequence and no per-head matmul; every other step
  (prefill, mixed chunks) and autograd or traced code as `sdpa`. float32 only.
- `vllm_flash_attn`: FlashAttention-2's varlen kernel with a paged cache (vllm-flash-attn
  2.6.x, the `gpu` extra). K and V are strided views of the pool,
  (pages, page_size, kv_heads, head_dim) each; the kernel finds a request's pages through
  its block table and applies the causal mask and the sliding window itself. Its 2.6.x build
  has kernels for sm8x and sm90 GPUs only; `auto` uses SDPA on any other (with a note).

`auto` picks `vllm_flash_attn` on a suitable GPU, `cpu_paged` for a float32 CPU model where
the machine can build it (a C compiler; native.py), and `sdpa` otherwise.

`select_backend` runs once per layer at construction (STYLE: decide dispatch at
construction, never per step).
"""
from __future__ import annotations

import logging
from typing import Callable, Protocol

import torch
from torch import nn

from hyrax.actors.model.batch import AttnIndex, ForwardBatch
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.paged_decode import available as cpu_paged_unavailable
from hyrax.actors.model.paged_decode import paged_decode, traced_paged_decode
from hyrax.actors.model.row_copy import index_copy_rows_, index_select_rows, recorded

BACKENDS = ("auto", "sdpa", "vllm_flash_attn", "cpu_paged")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_PAGE_MULTIPLE = 16  # vllm-flash-attn: "Paged KV cache block size must be divisible by 16"
FLASH_MAX_HEAD_DIM = 256

log = logging.getLogger("hyrax.attention")


class PagedAttentionBackend(Protocol):
    name: str

    def __call__(self, q: torch.Tensor, pool: torch.Tensor, idx: AttnIndex, batch: ForwardBatch,
                 window: int | None, scale: float) -> torch.Tensor:
        """q: (B, T, H, D) of this step's queries (K/V already written) -> (B, T, H, D)."""

    def check_page_size(self, page_size: int) -> None:
        """Raise HyraxInputError when the engine's page size does not suit the kernel."""


def visible_mask(positions: torch.Tensor, q_valid: torch.Tensor, idx: AttnIndex, window: int | None) -> torch.Tensor:
    """(B, T, K) bool: key k is visible to query t (causal, within the window, valid).

    Padding queries see key 0 only, so that softmax never runs over an empty row.
    """
    kp = idx.key_pos[:, None, :]
    qp = positions[:, :, None]
    m = idx.key_valid[:, None, :] & (kp <= qp)
    if window is not None:
        m = m & (kp > qp - window)
    first = torch.zeros_like(m)
    first[:, :, 0] = True
    return m | ((~q_valid)[:, :, None] & first)


class SdpaPaged:
    """Gathers each request's visible K/V rows (one `index_select` over the pool's first dim:
    advanced indexing with a (B, K) index takes ~60x longer on CPU), zeroes the padding keys
    in place through their host-computed flat indices, and attends (on the CPU, a step of
    several slices one sequence at a time: `_per_sequence`): a decode step (T == 1)
    with batched matmuls per K/V head over strided views of the gathered rows (no K/V copy at
    all, none per query head; an additive mask, as einsum's planning and a masked_fill per
    layer cost more than the math at this size), a longer step with torch
    SDPA and an explicit mask. Masks are computed once per step and window and shared by
    every layer."""

    name = "sdpa"

    def __call__(self, q, pool, idx, batch, window, scale):
        B, T, H, D = q.shape
        if T > 1 and B > 1 and q.device.type == "cpu" and idx.keys is not None:
            return self._per_sequence(q, pool, idx, batch, window, scale)
        return self._padded(q, pool, idx, batch, window, scale)

    def _per_sequence(self, q, pool, idx, batch, window, scale):
        """A step of several slices, on the CPU (their lengths known to the host for free): one
        SDPA per sequence over its own queries and keys, none padded to the step's longest.
        Measured, one thread, the quick c=16 workload's 32 prompts prefilled in 256-token steps
        (a step's slices padded to the longest, keys to the longest context), interleaved A/B:
        0.610 -> 0.577 s for the whole prefill. Padding queries' rows are zeros."""
        B, T, H, D = q.shape
        mask = self._visible(idx, batch, window)
        out = q.new_zeros(B, T, H, D)
        for b, (n, k) in enumerate(zip(batch.q_lens.tolist(), idx.keys.n_keys.tolist())):
            kv = index_select_rows(pool, idx.read_rows[b, :k])[None]  # (1, k, 2, KVH, D): its keys only
            keys, values = _per_query_head(kv, H)
            o = nn.functional.scaled_dot_product_attention(q[b:b + 1, :n].transpose(1, 2), keys, values,
                                                           attn_mask=mask[b:b + 1, None, :n, :k], scale=scale)
            out[b, :n] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _visible(idx, batch, window) -> torch.Tensor:
        mask = idx.derived.get(("visible", window))
        if mask is None:
            mask = idx.derived[("visible", window)] = visible_mask(batch.positions, batch.q_valid, idx, window)
        return mask

    def _padded(self, q, pool, idx, batch, window, scale):
        B, T, H, D = q.shape
        K = idx.read_rows.shape[1]
        kv = index_select_rows(pool, idx.read_rows.view(-1))  # (B * K, 2, KVH, D)
        # padding keys point at row 0, which may belong to another request: never let its bytes in
        kv.view(B * K, -1).index_fill_(0, idx.pad_keys, 0)
        kv = kv.view(B, K, *pool.shape[1:])
        mask = self._visible(idx, batch, window)
        kvh = kv.shape[3]
        if T == 1:
            bias = idx.derived.get(("bias", window))  # (B, 1, K): 0 where visible, -inf elsewhere
            if bias is None:
                bias = idx.derived[("bias", window)] = torch.zeros(
                    B, 1, K, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            # per K/V head, batched over the requests: its keys and values are (B, K, D) strided
            # views of the gathered rows that the batched matmuls read as they are, and its query
            # heads (B, R, D) rows of q. Measured, one thread, 16 requests x 336 keys, 2 K/V heads
            # of 32: 0.65 ms a layer; copying K and V into one (K, D) matrix per head first, as
            # this did before, 3.0 ms
            qg = q.view(B, kvh, H // kvh, D)  # query heads grouped by the K/V head they share
            heads = [torch.softmax(torch.baddbmm(bias, qg[:, g], kv[:, :, 0, g].transpose(1, 2), alpha=scale),
                                   dim=-1) for g in range(kvh)]  # (B, R, K) each
            if torch.compiler.is_compiling():  # `out=` into a view breaks a torch.compile graph (and
                # with it the whole decode forward, which then ran eager layer by layer): stacked instead
                return torch.stack([torch.bmm(p, kv[:, :, 1, g]) for g, p in enumerate(heads)], 1).view(B, 1, H, D)
            out = torch.empty_like(qg)
            for g, p in enumerate(heads):
                torch.bmm(p, kv[:, :, 1, g], out=out[:, g])
            return out.view(B, 1, H, D)
        k, v = _per_query_head(kv, H)
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale)
        return out.transpose(1, 2)

    def check_page_size(self, page_size: int) -> None:
        return None


def _per_query_head(kv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered rows (B, K, 2, KVH, D) -> keys and values (B, heads, K, D) each, every K/V head
    repeated for the query heads that share it (what SDPA takes)."""
    rep = heads // kv.shape[3]
    return tuple(kv[:, :, i].repeat_interleave(rep, dim=2).transpose(1, 2) for i in (0, 1))


class CpuPaged:
    """Decode steps through the C kernel over the pool as it lies (paged_decode.py); anything
    else through `SdpaPaged`. The kernel computes each sequence on its own, so a request's
    decode attention does not depend on which others share the step."""

    name = "cpu_paged"

    def __init__(self):
        self.sdpa = SdpaPaged()

    def __call__(self, q, pool, idx, batch, window, scale):
        B, T, H, D = q.shape
        lay = idx.keys
        if T != 1 or lay is None or recorded(q) or recorded(pool):
            return self.sdpa(q, pool, idx, batch, window, scale)
        args = (q.view(B, H, D), pool, idx.page_table, lay.first, lay.n_keys, batch.positions[:, 0], lay.page_size)
        if torch.compiler.is_compiling():  # a compiled decode forward: the kernel as one opaque op
            if traced_paged_decode is None:
                return self.sdpa(q, pool, idx, batch, window, scale)
            return traced_paged_decode(*args, window or 0, scale).view(B, 1, H, D)
        return paged_decode(*args, window, scale).view(B, 1, H, D)

    def check_page_size(self, page_size: int) -> None:
        return None


VarlenKernel = Callable[..., torch.Tensor]


class FlashPaged:
    """FlashAttention-2 varlen over the paged pool. `kernel` has the signature of
    `vllm_flash_attn.flash_attn_varlen_func` (2.6.x)."""

    name = "vllm_flash_attn"

    def __init__(self, kernel: VarlenKernel):
        self.kernel = kernel

    def __call__(self, q, pool, idx, batch, window, scale):
        B, T, H, D = q.shape
        page = batch.page_size
        rows, _, kvh, _ = pool.shape
        if rows % page:
            raise RuntimeError(f"pool rows {rows} are not a whole number of {page}-row pages")
        paged = pool.view(rows // page, page, 2, kvh, D)
        k_cache, v_cache = paged[:, :, 0], paged[:, :, 1]  # strided views; last dim contiguous
        cu_q, cu_k = batch.cu_seqlens
        packed = q.reshape(B * T, H, D).index_select(0, batch.token_index)  # (N, H, D), request by request
        out = self.kernel(
            packed, k_cache, v_cache, cu_q, cu_k, T, batch.max_context,
            softmax_scale=scale, causal=True,
            window_size=(window - 1, 0) if window is not None else (-1, -1),
            block_table=idx.block_table,
        )
        return index_copy_rows_(q.new_zeros(B * T, H, D), batch.token_index, out).view(B, T, H, D)

    def check_page_size(self, page_size: int) -> None:
        if page_size % FLASH_PAGE_MULTIPLE:
            raise HyraxInputError(f"page-size must be a multiple of {FLASH_PAGE_MULTIPLE} with the vllm_flash_attn "
                                  f"attention backend, got {page_size}")


def _import_flash() -> VarlenKernel | None:
    try:
        from vllm_flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch/CUDA: fall back to SDPA
        return None
    return flash_attn_varlen_func


def flash_unsuitable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the flash kernel cannot run this layer, or None when it can (GPU model aside)."""
    if device.type != "cuda":
        return f"it needs CUDA (device is {device.type})"
    if dtype not in FLASH_DTYPES:
        return f"it needs float16 or bfloat16 (dtype is {str(dtype).removeprefix('torch.')})"
    if head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        return f"head_dim {head_dim} is not a multiple of 8 up to {FLASH_MAX_HEAD_DIM}"
    return None


Capability = Callable[[torch.device], tuple[int, int]]


def cpu_paged_unsuitable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the CPU decode kernel cannot run this layer, or None when it can (its build aside)."""
    if device.type != "cpu":
        return f"it runs on the CPU (device is {device.type})"
    if dtype != torch.float32:
        return f"it computes in float32 (model dtype is {str(dtype).removeprefix('torch.')})"
    return None


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device: (9, 0) for sm90."""
    return torch.cuda.get_device_capability(device)


def flash_gpu_unsupported(capability: tuple[int, int]) -> str | None:
    """vllm-flash-attn 2.6.x builds `mha_varlen_fwd` for sm8x and sm90 only and raises on any
    other GPU at the first forward; None when `capability` is one of those."""
    major, minor = capability
    if major == 8 or (major, minor) == (9, 0):
        return None
    return f"vllm-flash-attn 2.6 runs on sm8x and sm90 GPUs only (this one is sm{major}{minor})"


_noted: set[str] = set()


def note_once(message: str) -> None:
    """One log line per distinct message and process (every attention layer asks)."""
    if message not in _noted:
        _noted.add(message)
        log.warning(message)


def select_backend(requested: str, device: torch.device | str, dtype: torch.dtype, head_dim: int,
                   importer: Callable[[], VarlenKernel | None] = _import_flash,
                   capability: Capability = cuda_capability,
                   note: Callable[[str], None] = note_once,
                   native: Callable[[], str | None] = cpu_paged_unavailable) -> PagedAttentionBackend:
    """`auto`: vllm_flash_attn when it imports and suits the layer and the GPU; on the CPU,
    cpu_paged for float32 when its kernel builds here (`native` answers why not, then a `note`);
    else SDPA (with a `note` when only the GPU model is in the way). `vllm_flash_attn`,
    `cpu_paged`: that kernel or a clear error. `sdpa`: always SDPA. `capability` answers the
    device's compute capability."""
    if requested not in BACKENDS:
        raise HyraxInputError(f"attention backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested == "sdpa":
        return SdpaPaged()
    device = torch.device(device)
    if requested == "cpu_paged" or (requested == "auto" and device.type == "cpu"):
        why = cpu_paged_unsuitable(device, dtype) or native()
        if why is None:
            return CpuPaged()
        if requested == "cpu_paged":
            raise HyraxInputError(f"the cpu_paged attention backend cannot be used: {why}")
        if dtype == torch.float32:  # the kernel would suit this model: say why it is not used
            note(f"note: decode attention uses SDPA: {why}")
        return SdpaPaged()
    why = flash_unsuitable(device, dtype, head_dim)
    kernel = importer() if why is None else None
    gpu = flash_gpu_unsupported(capability(device)) if kernel is not None else None
    if kernel is not None and gpu is None:
        return FlashPaged(kernel)
    if requested == "vllm_flash_attn":
        raise HyraxInputError("the vllm_flash_attn attention backend cannot be used: "
                              + (why or gpu or "vllm_flash_attn does not import (pip install '.[gpu]')"))
    if gpu is not None:
        note(f"note: attention uses SDPA: {gpu}")
    return SdpaPaged()
