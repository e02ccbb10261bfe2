"""Mamba2 state-space duality (SSD) kernels in pure torch: chunked scan, one-step update,
and the token-by-token recurrence they are tested against.

Per head h, with state S (head_dim P x state N):
    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t ⊗ B_t
    y_t = S_t · C_t + D_h * x_t
Heads are split into `G` groups sharing B and C. All math runs in the state dtype
(float32, or float64 for float64 models). Padding tokens carry dt == 0, which leaves the
state unchanged, so right-padded batches need no special casing.
"""
from __future__ import annotations

import functools

import torch


# Log-decays below this are taken as it before exp. A float32 exp whose result underflows (an
# argument below about -87.3, -inf included) leaves the CPU's vectorised path: measured, one
# thread, 131k elements 32 us, or 1.3 ms when half of them are -1000 or -inf. exp(-80) is
# 1.8e-35, below what a float32 or float64 sum of O(1) terms can tell from 0.
LOG_DECAY_FLOOR = -80.0


def decay_exp(log_decay: torch.Tensor) -> torch.Tensor:
    """exp of a log-decay (<= 0), arguments below LOG_DECAY_FLOOR taken as it (out of place)."""
    return torch.exp(log_decay.clamp(min=LOG_DECAY_FLOOR))


def _heads_from_groups(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(..., G, N) -> (..., H, N), each group shared by H/G consecutive heads."""
    g = t.shape[-2]
    return t.repeat_interleave(n_heads // g, dim=-2)


def ssd_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
    Bm: torch.Tensor, Cm: torch.Tensor, D: torch.Tensor, transposed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence. Updates `state` IN PLACE (pass a copy to keep the old
    one: the model passes the rows it gathered from its pool) and returns it.

    state: (B, H, P, N), contiguous; x: (B, H, P); dt: (B, H) (after softplus); A: (H,)
    negative; Bm, Cm: (B, G, N); D: (H,). Returns y: (B, H, P) and the new state, in state's
    dtype. The state is the step's largest tensor (a 110M-parameter Bamba: 6 MB per layer at
    batch 16), so it is scaled and accumulated in place, with B and C broadcast over each
    group's heads rather than repeated: two passes over it instead of five, no new state-sized
    tensor (7.7 -> 4.7 ms per layer at that size, gather and write-back included).
    """
    f = state.dtype
    Bsz, H, P, N = state.shape
    G = Bm.shape[1]
    R = H // G  # heads per group (consecutive heads share a group's B and C)
    x, dt, A, D = x.to(f), dt.to(f), A.to(f), D.to(f)
    s = state.view(Bsz, G, R, P, N)
    s.mul_(decay_exp(dt * A).view(Bsz, G, R, 1, 1))
    s.addcmul_((dt[:, :, None] * x).view(Bsz, G, R, P, 1), Bm.to(f).view(Bsz, G, 1, 1, N))
    # y = S . C per group as one batched matrix-vector product (B*G, R*P, N) @ (B*G, N, 1), or
    # `transposed`, (C^T @ S^T)^T: which is faster depends on the CPU (ssd_readout.py measures it)
    S = state.view(Bsz * G, R * P, N)
    if transposed and Bsz * G > 1:
        y = torch.bmm(Cm.to(f).reshape(Bsz * G, 1, N), S.transpose(1, 2)).view(Bsz, H, P)
    else:
        y = torch.bmm(S, Cm.to(f).reshape(Bsz * G, N, 1)).view(Bsz, H, P)
    return y + D[None, :, None] * x, state


def ssd_step_rows_(
    pool: torch.Tensor, rows: list[int], x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
    Bm: torch.Tensor, Cm: torch.Tensor, D: torch.Tensor,
) -> torch.Tensor:
    """`ssd_step` on a pool's rows where they lie: sequence b's state is pool[rows[b]], updated
    in place; no other row is touched. `rows` are distinct host integers.

    pool: (slots, H, P, N), contiguous; x: (B, H, P); dt: (B, H); A: (H,); Bm, Cm: (B, G, N);
    D: (H,). Returns y: (B, H, P) in pool's dtype.

    One row at a time, so the row stays in the core's cache from its first pass to its last:
    scale, accumulate and contract each read it once from memory, and no gathered copy is
    written and scattered back. At a 110M-parameter Bamba's rows (24 x 64 x 64 float32, 393 kB;
    16 rows are 6.3 MB, past the L2 cache) the gathered form made five passes over memory.
    """
    f = pool.dtype
    Bsz, H, P = x.shape
    G, N = Bm.shape[1], Bm.shape[2]
    R = H // G
    x, dt = x.to(f), dt.to(f)
    y = torch.empty(Bsz, G, 1, R * P, dtype=f, device=pool.device)
    states = pool.view(pool.shape[0], G, R, P, N)
    decays = decay_exp(dt * A.to(f)).view(Bsz, G, R, 1, 1).unbind(0)
    dtxs = (dt[:, :, None] * x).view(Bsz, G, R, P, 1).unbind(0)
    # per row: S = decay * S + (dt x) (x) B, then y = S . C per group, as C^T . S^T (G, 1, R*P):
    # with several groups the batched matrix-vector form is ~3x slower (2 groups of (768, 64):
    # 111 vs 34 us; 8 of (512, 128): 637 vs 192 us), with one it is the same (17 vs 18 us)
    for row, decay, dtx, Bb, Cb, yb in zip(rows, decays, dtxs, Bm.to(f).view(Bsz, G, 1, 1, N).unbind(0),
                                           Cm.to(f).view(Bsz, G, 1, N).unbind(0), y.unbind(0)):
        torch.bmm(Cb, states[row].mul_(decay).addcmul_(dtx, Bb).view(G, R * P, N).transpose(1, 2), out=yb)
    return y.view(Bsz, H, P).addcmul_(D.to(f)[:, None], x)


@functools.lru_cache(maxsize=64)
def _masks(L: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(strict, lower), (L, L) float each, made once per chunk length and device (they were
    rebuilt by every layer of every step): `strict` 1 where row > column, `lower` 1 where
    row >= column."""
    with torch.inference_mode(False):  # normal tensors: a cached inference tensor breaks autograd (training)
        ones = torch.ones(L, L, device=device)
        return torch.tril(ones, diagonal=-1), torch.tril(ones)


def _decay(a: torch.Tensor) -> torch.Tensor:
    """a: (..., L) -> (..., L, L) with out[..., l, s] = exp(sum(a[s+1 .. l])) for l >= s, 0 above.

    The sums are masked cumulative sums (no subtraction of large cumsums), for accuracy.
    """
    strict, lower = _masks(a.shape[-1], a.device)
    seg = torch.cumsum(a[..., :, None] * strict.to(a.dtype), dim=-2)  # rows s+1..l of column s
    # exact zeros above, made after the exp (an exp of -inf is slow: LOG_DECAY_FLOOR) by a product
    # with the 0/1 mask (the exp's values are finite, so the same bits as a masked fill, which with
    # a broadcast (L, L) mask ran ~17x slower: 257 vs 15 us for 64 chunks of 32); in place unless
    # autograd keeps the exp's output for its backward (the demo model trains through here)
    out = decay_exp(seg)
    if torch.is_grad_enabled() and out.requires_grad:
        return out * lower.to(out.dtype)
    return out.mul_(lower.to(out.dtype))


def _per_group(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The groups' results stacked along a new `dim`; one group's without a copy."""
    return parts[0].unsqueeze(dim) if len(parts) == 1 else torch.stack(parts, dim=dim)


def ssd_chunked(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
    D: torch.Tensor, chunk_size: int, init_state: torch.Tensor, with_starts: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Chunked scan over a right-padded batch.

    x: (B, T, H, P); dt: (B, T, H) with 0 at padding; A: (H,); Bm, Cm: (B, T, G, N); D: (H,);
    init_state: (B, H, P, N). Returns y: (B, T, H, P) and the final state (B, H, P, N),
    both in init_state's dtype; `with_starts`: also the state at each chunk's start
    (B, chunks, H, P, N), which `ssd_states_at` reads states inside the step from.

    A step shorter than `chunk_size` is one chunk of its own length (a short prefill used
    to pad to a whole chunk and pay for it). The contractions shared by a group's heads run as
    one matrix product per (batch, chunk, group) over the token-major layout the inputs come
    in, with the group's heads side by side as columns (R * P of them): no copy of x into a
    head-major layout for them, and GEMMs of R * P columns instead of R products of P. Only
    the within-chunk product, whose decay matrix differs per head, runs per head.
    Measured (one thread, (2, 256) tokens, 24 heads of 64, one group, state 64, chunks of 64:
    the large bench model's layer): 15-17 ms; with every product over a head-major copy, as
    this ran before, 21-25 ms.
    """
    f = init_state.dtype
    Bsz, T, H, P = x.shape
    G, N = Bm.shape[2], Bm.shape[3]
    R = H // G
    L = min(chunk_size, T)
    pad = (-T) % L
    x, dt, Bg, Cg = x.to(f), dt.to(f), Bm.to(f), Cm.to(f)
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        dt = torch.nn.functional.pad(dt, (0, 0, 0, pad))
        Bg = torch.nn.functional.pad(Bg, (0, 0, 0, 0, 0, pad))
        Cg = torch.nn.functional.pad(Cg, (0, 0, 0, 0, 0, pad))
    nc = (T + pad) // L
    xdt = (x * dt[..., None]).view(Bsz, nc, L, H * P)  # (b, c, l, h*p): token-major, contiguous
    a = (dt * A.to(f)).view(Bsz, nc, L, H)  # (b, c, l, h)
    acum = torch.cumsum(a, dim=2)  # (b, c, l, h)
    Bc = Bg.view(Bsz, nc, L, G, N)  # (b, c, l, g, n)
    Cc = Cg.view(Bsz, nc, L, G, N)

    # within each chunk: y_l = sum_{s<=l} (C_l·B_s) exp(a_{s+1..l}) dt_s x_s, per head
    cb = torch.matmul(Cc.transpose(2, 3), Bc.permute(0, 1, 3, 4, 2))  # (b, c, g, l, s): once per group
    scores = _decay(a.transpose(2, 3).contiguous()).view(Bsz, nc, G, R, L, L) * cb[:, :, :, None]
    xdt_h = xdt.view(Bsz, nc, L, H, P).transpose(2, 3).contiguous()  # (b, c, h, l, p)
    y_in = torch.matmul(scores.view(Bsz, nc, H, L, L), xdt_h)  # (b, c, h, l, p)

    # each chunk's own contribution to the state at its end, a group's heads as R * P rows:
    # (x dt exp(a_{l+1..end}))^T (R*P, L) @ B (L, N) -> (b, c, g, r*p, n)
    to_end = decay_exp(acum[:, :, -1:] - acum)  # (b, c, l, h)
    xw = (xdt.view(Bsz, nc, L, H, P) * to_end[..., None]).view(Bsz, nc, L, G, R * P)
    chunk_states = _per_group([torch.matmul(xw[:, :, :, g].transpose(-1, -2), Bc[:, :, :, g])
                               for g in range(G)], dim=2).view(Bsz, nc, H, P, N)
    chunk_decay = decay_exp(acum[:, :, -1])  # (b, c, h)

    # carry the state across chunks; each chunk's start state adds C_l·S exp(a_{..l}) to y
    state = init_state.to(f)
    starts = []
    for c in range(nc):
        starts.append(state)
        state = state * chunk_decay[:, c, :, None, None] + chunk_states[:, c]
    start = starts[0][:, None] if nc == 1 else torch.stack(starts, dim=1)  # (b, c, h, p, n)
    # C (L, N) @ S^T (N, R*P) per group: token-major (b, c, l, g, r*p) directly
    start_g = start.view(Bsz, nc, G, R * P, N)
    from_start = _per_group([torch.matmul(Cc[:, :, :, g], start_g[:, :, g].transpose(-1, -2)) for g in range(G)],
                            dim=3).view(Bsz, nc, L, H, P)
    y = from_start.mul_(decay_exp(acum)[..., None]).add_(y_in.transpose(2, 3))
    y = y.addcmul_(x.view(Bsz, nc, L, H, P), D.to(f)[:, None]).view(Bsz, nc * L, H, P)
    if with_starts:
        return (y[:, :T] if pad else y), state, start
    return (y[:, :T] if pad else y), state


def ssd_states_at(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, starts: torch.Tensor,
    rows: torch.Tensor, lens: torch.Tensor, chunk_size: int,
) -> torch.Tensor:
    """The state of batch row rows[i] after its first lens[i] tokens (0 < lens < T), for several
    points at once (a row may appear more than once): the start state of the `ssd_chunked` chunk
    holding the point, advanced by that chunk's tokens before it (none at a chunk start; fewer
    than `chunk_size` otherwise), so a point costs one chunk's contraction, not the whole step's.

    x: (B, T, H, P); dt: (B, T, H); A: (H,); Bm: (B, T, G, N); starts: ssd_chunked's chunk
    start states (B, chunks, H, P, N); rows, lens: (n,) long. Returns (n, H, P, N) in starts'
    dtype.
    """
    Bsz, T, H, P = x.shape
    G, N = Bm.shape[2], Bm.shape[3]
    L = min(chunk_size, T)
    chunk = torch.div(lens, L, rounding_mode="floor")
    ar = torch.arange(L, device=x.device)
    at = chunk[:, None] * L + ar[None, :]  # (n, L): the tokens of each point's chunk
    flat = (rows[:, None] * T + at.clamp(max=T - 1)).reshape(-1)  # a last partial chunk: clamped, masked below
    before = (ar[None, :] < (lens - chunk * L)[:, None]).to(dt.dtype)  # (n, L): tokens before the point
    n = rows.shape[0]
    xw = x.reshape(Bsz * T, H, P).index_select(0, flat).view(n, L, H, P)
    dtw = dt.reshape(Bsz * T, H).index_select(0, flat).view(n, L, H) * before[..., None]
    Bw = Bm.reshape(Bsz * T, G, N).index_select(0, flat).view(n, L, G, N)
    return ssd_state_after(xw, dtw, A, Bw, starts[rows, chunk])


def ssd_state_after(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, init_state: torch.Tensor,
) -> torch.Tensor:
    """The state after a batch's tokens, without the outputs: what `ssd_chunked` returns as its
    final state, in one contraction over the whole length. Zero `dt` from a token on to get the
    state before it (a prefix-cache checkpoint inside a prefill chunk).

    x: (B, T, H, P); dt: (B, T, H); A: (H,); Bm: (B, T, G, N); init_state: (B, H, P, N).
    Returns (B, H, P, N) in init_state's dtype.
        S_T = exp(sum_t a_t) S_0 + sum_s exp(sum_{t>s} a_t) dt_s x_s (x) B_s,   a_t = dt_t A
    """
    f = init_state.dtype
    Bsz, T, H, P = x.shape
    G, N = Bm.shape[2], Bm.shape[3]
    dt = dt.to(f)
    acum = torch.cumsum(dt * A.to(f), dim=1)  # (b, t, h)
    total = acum[:, -1:]  # (b, 1, h)
    weight = decay_exp(total - acum) * dt  # (b, t, h): token s's share of the final state
    xw = (x.to(f) * weight[..., None]).view(Bsz, T, G, H // G, P)  # heads grouped as B is
    contrib = torch.einsum("btgrp,btgn->bgrpn", xw, Bm.to(f)).reshape(Bsz, H, P, N)
    return contrib.add_(init_state.to(f) * decay_exp(total[:, 0])[:, :, None, None])


def ssd_sequential(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
    D: torch.Tensor, init_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the plain recurrence, one token at a time (same shapes as ssd_chunked)."""
    f = init_state.dtype
    Bsz, T, H, P = x.shape
    G = Bm.shape[2]
    state = init_state.clone()
    ys = []
    for t in range(T):
        for h in range(H):
            g = h // (H // G)
            d = dt[:, t, h].to(f)[:, None, None]
            state[:, h] = torch.exp(d * A[h].to(f)) * state[:, h] + d * x[:, t, h].to(f)[:, :, None] * Bm[:, t, g].to(f)[:, None, :]
        yt = torch.einsum("bhpn,bhn->bhp", state, _heads_from_groups(Cm[:, t].to(f), H)) + D.to(f)[None, :, None] * x[:, t].to(f)
        ys.append(yt)
    return torch.stack(ys, dim=1), state
