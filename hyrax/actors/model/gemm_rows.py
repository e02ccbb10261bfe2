"""Row plans: how a CPU linear layer runs a product of few rows, measured once per weight shape.

A CPU BLAS picks its kernel for y = x @ W^T by the number of rows m of x, and for small m that
choice is far from monotonic. Measured on the 2-core AVX-512 VM (MKL 2024.2, torch 2.13, one
thread), a (4096, 768) weight: 1-3 rows 0.55 ms, 4-6 rows 1.1, 7-9 1.8, 10-12 2.3, 13-15
3.0, and 16 rows 1.7 - MKL runs fewer than 16 rows three at a time and switches to its
blocked kernel at 16. A (128, 256) weight (the demo model's MLP) goes the other way: 1-10
rows ~10 us, 11 and more ~45 us. A decode step has one row per running request, so a
15-request step cost half as much again as a 16-request one on the bench's 110M-parameter
model (163 vs 112 ms per step with the rows padded to 16).

`row_plan` times the product at 1 .. MAX_ROWS rows with the weight's shape, dtype and bias,
and keeps, for each row count, the cheapest way to run it: as it is, padded with zero rows to
a count that runs faster, or split into pieces each run in its best way (by dynamic
programming over the measured times). A plan replaces the plain call only where it is
clearly cheaper (`MARGIN`), so a row count near a tie keeps its plain product and its exact
rounding. `plan_rows(model)` gives every `nn.Linear` of a CPU model its plan: the module
becomes a `PlannedLinear` (same parameters, names and state dict) whose forward consults it.
Products of more than MAX_ROWS rows run plain unless oneDNN or the native kernel (below) won
at the LARGE_ROWS counts; GPU models, traced code (torch.compile) and products autograd records
run plain.

A second library, oneDNN (`torch.ops.mkldnn._linear_pointwise` on the dense weight as it lies:
no copy, no other layout), runs the same products with its own kernels, and on large weights
faster at every row count. Measured, same VM, one thread, interleaved medians, MKL time over
oneDNN time: a (3224, 768) weight 1.14 / 1.36 / 1.10 / 1.17 at 1 / 15 / 16 / 256 rows, (4096,
768) 1.77 / 1.37 / 1.25 / 1.22, (8192, 768) 1.46 / 1.47 / 1.34 / 1.27; on the demo model's
small weights its fixed cost per call loses (0.24-0.78 below 16 rows, ~1 at 256). So the plan
also times oneDNN, at every planned row count and at LARGE_ROWS, and uses it for a row count
where it costs at most ONEDNN_MARGIN of the best MKL way, and for products of LARGE_ROWS[0] rows
or more where it costs at most LARGE_MARGIN of MKL at the next LARGE_ROWS count (past the last,
at the last): products that large take milliseconds, so their timings are steadier (the large
model's 256-token prefill step with every large product through oneDNN: 1.10x).

oneDNN builds a kernel for every shape it meets (its primitive cache keeps 1,024): measured, the
first product of a (3224, 768) weight at a new row count cost 0.5-6 ms more than the next ones,
and a prefill step's row count takes hundreds of values. So past MAX_ROWS its products run on
rows padded to `onednn_rows` (multiples of 16 up to 256, of 64 beyond): a few dozen shapes a
weight, built once; 17 .. LARGE_ROWS[0] - 1 rows, where that padding would cost most, stay MKL.

A third way is Hyrax's own kernel (kernels/gemm_rows.c, built like the other native kernels):
a BLAS packs the weight into its own layout on every call, which at 2-16 rows costs about as
much as the arithmetic; the kernel reads the weight where it lies, each vector of it serving
three rows of x at once, while the next rows of the weight are fetched. Measured, 2-core AVX2
VM (Zen 3), one thread, weights out of cache, GFLOP/s MKL / kernel: a (3224, 768) weight 9 / 20,
26 / 63, 42 / 79 at 2 / 8 / 16 rows, 58 / 79 at 32, 72 / 81 at 64; (8192, 768) 23 / 66 at 8 rows,
37 / 78 at 16. The plan times it at every planned row count and runs it where it costs at
most NATIVE_MARGIN of the best other way (MKL as planned, or oneDNN where that won); on a
weight large enough to time oneDNN on, also at LARGE_ROWS, and a product between two counts it
won at (16 and 64 rows: the decode steps of 17-64 running requests) runs through it too
(measured, same VM, out of cache: (3224, 768) at 24 / 32 / 64 rows, MKL 51 / 57 / 71, oneDNN
51 / 53 / 63, the kernel 77 / 79 / 79 GFLOP/s; at 256 rows MKL's 84 beat its 82, so prefill
products stay with the BLAS). Its sums run in one order for every row count (native rows are
batch-invariant, unlike a BLAS's).

Each row of the result is computed from its own row of x alone, so a padded or split product
gives each request the same values a product of that many rows would; which kernel computed
them (and so the last bits of rounding) depends on the plan, as it already depends on how
many requests share the step.
"""
from __future__ import annotations

import ctypes
import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from hyrax.actors.model.native import NativeUnavailable, function, unavailable
from hyrax.actors.model.row_copy import recorded, traced_or_recorded

MAX_ROWS = 16  # row counts planned: 1 .. MAX_ROWS (larger products run plain, or all through oneDNN)
MARGIN = 0.8  # a plan is used for m rows only if it costs at most this share of the plain product
PIECE_OVERHEAD_S = 3e-6  # added per extra piece or padding copy when comparing plans (a small op's dispatch)
LARGE_ROWS = (64, 256)  # the row counts that decide oneDNN for products of more than MAX_ROWS rows
ONEDNN_MARGIN = 0.9  # oneDNN runs a row count only if it costs at most this share of MKL's best way
LARGE_MARGIN = 0.95  # ... and a count past MAX_ROWS if this share at its LARGE_ROWS count
NATIVE_MARGIN = 0.9  # the native kernel runs a row count only if it costs at most this share of the best other way
LLC_GUESS_BYTES = 32 << 20  # the last-level cache where the system does not say
# weights smaller than this are not timed through oneDNN: measured, its fixed cost per call never
# paid on the demo model's (~0.3 MB, MKL/oneDNN 0.24-1.06 at 1-256 rows), it always did on the
# large model's (0.8-25 MB, 1.1-1.8), and at ~1.05 a noisy timing could hand a small weight's
# prefill products to oneDNN (seen once: the demo's at 256 rows, then slower at 65-255)
ONEDNN_MIN_WEIGHT_BYTES = 512 * 1024

Piece = tuple[int, int]  # (rows of x, rows the product runs with: more means zero padding)


@dataclass(frozen=True)
class RowPlan:
    """pieces[m - 1]: how a product of m rows runs through MKL, None where it runs plain;
    onednn[m - 1]: whether it runs through oneDNN instead (none where empty); onednn_large[i]:
    whether products of more than len(pieces) rows, up to LARGE_ROWS[i] (past the last: any
    more), do; native[m - 1]: whether it runs through the native kernel instead of either."""

    pieces: tuple[tuple[Piece, ...] | None, ...]
    onednn: tuple[bool, ...] = ()
    onednn_large: tuple[bool, ...] = ()
    native: tuple[bool, ...] = ()  # native[m - 1]: whether m rows run through the native kernel (first)
    # native_large[i]: whether the native kernel won at LARGE_ROWS[i] rows; a product of more than
    # len(native) rows runs through it when it won at the measured counts on both sides of it
    # (past the last: at the last). It needs no padding, so the counts between them go with it.
    native_large: tuple[bool, ...] = ()

    def for_rows(self, m: int) -> tuple[Piece, ...] | None:
        return self.pieces[m - 1] if 0 < m <= len(self.pieces) else None

    def onednn_for(self, m: int) -> bool:
        if m > len(self.pieces):
            if not self.onednn_large or m < LARGE_ROWS[0]:
                return False
            return self.onednn_large[_large_index(m)]
        return 0 < m <= len(self.onednn) and self.onednn[m - 1]

    def native_for(self, m: int) -> bool:
        if m > len(self.native):
            if not self.native or not self.native_large:
                return False
            at = _large_index(m)
            below = self.native[-1] if at == 0 else self.native_large[at - 1]
            return self.native_large[at] and (below or m > LARGE_ROWS[-1])
        return 0 < m <= len(self.native) and self.native[m - 1]


def _large_index(m: int) -> int:
    """The first of LARGE_ROWS at least m (past the last: the last)."""
    return next((i for i, rows in enumerate(LARGE_ROWS) if m <= rows), len(LARGE_ROWS) - 1)


def _onednn_op():
    """oneDNN's linear on a dense weight, or None where this torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return None
    return torch.ops.mkldnn._linear_pointwise


_ONEDNN = _onednn_op()


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for a 2-D x through oneDNN."""
    return _ONEDNN(x, weight, bias, "none", [], "")


def available() -> str | None:
    """None when the native kernel builds and loads here, else why not."""
    return unavailable("gemm_rows")


def _native_kernel():
    """The native kernel's entry point, or None where it cannot be built here."""
    try:
        return function("gemm_rows", "hyrax_gemm_rows_f32", [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3)
    except NativeUnavailable:
        return None


# the kernel, built when a plan first asks for it (`_native_serves`); False: it cannot be built here
_NATIVE = None


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (m, in) through the native kernel: x, weight and bias
    float32 and contiguous (`_native_serves` and the caller check)."""
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    _NATIVE(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            x.shape[0], weight.shape[0], weight.shape[1])
    return y


def native_reads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel reads x (..., in), weight (out, in) and bias (out,) as F.linear does:
    all float32 in CPU memory (a layer's dtype or device may change after planning), weight and
    bias contiguous (a shard may be a strided view), x's rows as long as the weight's and one
    bias value per output (else F.linear's error or broadcast)."""
    return x.dtype is weight.dtype is torch.float32 and weight.is_contiguous() and x.shape[-1] == weight.shape[1] \
        and x.device.type == weight.device.type == "cpu" \
        and (bias is None or (bias.dtype is torch.float32 and bias.is_contiguous() and bias.shape == weight.shape[:1]
                              and bias.device.type == "cpu"))


def _native_serves(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the native kernel is worth timing for this weight (float32, contiguous, the
    kernel built here) and gives F.linear's values on a trial (a kernel that computes something
    else gets no plan rather than a wrong token)."""
    global _NATIVE
    if weight.dtype != torch.float32 or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return False
    if _NATIVE is None:
        _NATIVE = _native_kernel() or False
    if _NATIVE is False:
        return False
    return _computes_linear(native_linear, weight, bias)


def _computes_linear(product, weight: torch.Tensor, bias: torch.Tensor | None, rows: int = 5) -> bool:
    """Whether `product` gives F.linear's values for `rows` random rows with this weight and bias
    (an error raised, or another shape or values: no)."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    try:
        got = product(x, weight, bias)
    except RuntimeError:
        return False
    return got.shape == (rows, weight.shape[0]) and torch.allclose(got, F.linear(x, weight, bias), rtol=1e-4,
                                                                   atol=1e-4)


def onednn_rows(m: int) -> int:
    """The rows a oneDNN product of m rows runs on: m up to MAX_ROWS, then m rounded up to a
    multiple of 16 (up to 256) or of 64 (beyond), so that it meets few shapes."""
    if m <= MAX_ROWS:
        return m
    step = 16 if m <= 256 else 64
    return -(-m // step) * step


def pieces_seconds(seconds: list[float], pieces: tuple[Piece, ...] | None, m: int,
                   overhead: float = PIECE_OVERHEAD_S) -> float:
    """What `best_pieces` counted for m rows run as `pieces` (None: plain)."""
    if pieces is None:
        return seconds[m - 1]
    return sum(seconds[run_as - 1] + (overhead if run_as > rows else 0.0) for rows, run_as in pieces) \
        + overhead * (len(pieces) - 1)


def best_pieces(seconds: list[float], overhead: float = PIECE_OVERHEAD_S,
                margin: float = MARGIN) -> tuple[tuple[Piece, ...] | None, ...]:
    """seconds[m - 1]: the measured plain product of m rows. For each m, the cheapest pieces
    (each run plain or padded to a larger measured count) if they cost at most `margin` of
    the plain product, else None."""
    n = len(seconds)
    cost: list[float] = [0.0] * (n + 1)
    plan: list[tuple[Piece, ...]] = [()] * (n + 1)
    for m in range(1, n + 1):
        # one piece: the cheapest count of at least m rows (m itself: plain)
        run_as = min(range(m, n + 1), key=lambda r: seconds[r - 1] + (overhead if r > m else 0.0))
        cost[m] = seconds[run_as - 1] + (overhead if run_as > m else 0.0)
        plan[m] = ((m, run_as),)
        for k in range(1, m):  # or a first piece of k rows and the best plan for the rest
            c = cost[k] + cost[m - k] + overhead
            if c < cost[m]:
                cost[m], plan[m] = c, plan[k] + plan[m - k]
    return tuple(None if plan[m] == ((m, m),) or cost[m] > margin * seconds[m - 1] else plan[m]
                 for m in range(1, n + 1))


def _time_rows(weight: torch.Tensor, bias: torch.Tensor | None, m: int, product=F.linear,
               others: tuple[torch.Tensor, ...] = ()) -> float:
    """Seconds of one plain product of m rows (`product`: F.linear, MKL; onednn_linear; or
    native_linear): the fastest of a few repetitions. `others`: more weights of the same shape,
    the products cycling through them all (weights that do not stay in the cache)."""
    x = torch.randn(m, weight.shape[1], dtype=weight.dtype)
    weights = (weight, *others)
    product(x, weight, bias)
    t0 = time.perf_counter()
    product(x, weight, bias)
    calls = max(len(weights), int(2e-4 / max(time.perf_counter() - t0, 1e-7)))  # ~0.2 ms a repetition
    best = float("inf")
    for _ in range(1 if others else 3):  # cold: a repetition already averages several weights
        t0 = time.perf_counter()
        for i in range(calls):
            product(x, weights[i % len(weights)], bias)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


@functools.lru_cache(maxsize=None)
def last_level_cache_bytes() -> int:
    """The CPU's largest cache (Linux sysfs, read once a process), else LLC_GUESS_BYTES."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return max(sizes, default=LLC_GUESS_BYTES)


def _cold_copies(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """More weights of `weight`'s shape (views of one buffer) such that all of them together span
    1.5 times the last-level cache: a product cycling through them reads its weight from memory,
    as a decode step over a model larger than the cache does."""
    if not weight.numel():  # nothing to read
        return ()
    n = -(-3 * last_level_cache_bytes() // (2 * weight.numel() * weight.element_size())) - 1
    if n < 1:  # the weight alone is that large: it is read from memory on every product as it is
        return ()
    buf = torch.full((n, *weight.shape), 0.01, dtype=weight.dtype)  # any normal value times the same
    return tuple(buf.unbind(0))


_plans: dict[tuple, RowPlan] = {}  # (out, in, dtype, has bias, cold) -> plan, measured once per process


def row_plan(weight: torch.Tensor, bias: torch.Tensor | None, cold: bool = False) -> RowPlan:
    """The plan for products with a weight of this shape, dtype and bias (measured with a
    random weight of the same kind the first time it is asked for). `cold`: timed with the
    weight read from memory (`_cold_copies`), as in a model whose weights do not fit in the
    cache, where a BLAS's packing of the weight costs most; else with it in the cache."""
    key = (*weight.shape, weight.dtype, bias is not None, cold)
    if key not in _plans:
        with torch.inference_mode():
            w = torch.randn(weight.shape, dtype=weight.dtype)
            b = None if bias is None else torch.randn(bias.shape, dtype=bias.dtype)
            others = _cold_copies(w) if cold else ()
            # MKL: two passes over the small counts, each keeping its fastest, so that a burst of
            # other load during one count's timing does not make it look slow. oneDNN and the
            # native kernel: one pass (a burst there only keeps MKL), and the large counts (asked
            # only where oneDNN is timed: milliseconds a product) once per kind. Cold, one pass of
            # each (a cold repetition cycles through several weights): ~1-2 s a large weight shape
            # where a hot plan takes ~0.2-0.4 s; the large model loads in ~6 s so, ~3 s hot
            kinds = {"mkl": F.linear} | ({"onednn": onednn_linear} if _onednn_serves(w, b) else {}) \
                | ({"native": native_linear} if _native_serves(w, b) else {})
            seconds = {kind: [float("inf")] * MAX_ROWS for kind in kinds}
            for k in range(1 if cold else 2):
                for kind, product in kinds.items():
                    if k == 0 or kind == "mkl":
                        seconds[kind] = [min(s, _time_rows(w, b, m, product, others))
                                         for m, s in enumerate(seconds[kind], 1)]
            if len(kinds) > 1 and w.numel() * w.element_size() >= ONEDNN_MIN_WEIGHT_BYTES:  # (oneDNN's own floor)
                for kind, product in kinds.items():
                    # (hot: products this large are bound by their arithmetic, not by the weight's reads)
                    seconds[kind] += [_time_rows(w, b, m, product) for m in LARGE_ROWS]
        _plans[key] = _plan_from(seconds)
    return _plans[key]


def _onednn_serves(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether oneDNN is worth timing for this weight (float32, at least ONEDNN_MIN_WEIGHT_BYTES)
    and runs its products here with F.linear's values (a torch whose operator refuses a dense
    weight, or computes something else, gets no oneDNN plan rather than an error or a wrong
    token)."""
    if _ONEDNN is None or weight.dtype != torch.float32 or weight.numel() * 4 < ONEDNN_MIN_WEIGHT_BYTES:
        return False
    return _computes_linear(onednn_linear, weight, bias, rows=3)


def _plan_from(seconds: dict[str, list[float]]) -> RowPlan:
    """The plan from measured seconds per kind ("mkl"; "onednn" and "native" where they ran) at
    1 .. MAX_ROWS rows, then (for a weight large enough, each kind) at each of LARGE_ROWS."""
    mkl = seconds["mkl"][:MAX_ROWS]
    pieces = best_pieces(mkl)
    best = [min(mkl[m - 1], pieces_seconds(mkl, pieces[m - 1], m)) for m in range(1, MAX_ROWS + 1)]
    onednn, large = (), ()
    dnn = seconds.get("onednn")
    if dnn is not None:
        onednn = tuple(dnn[m - 1] <= ONEDNN_MARGIN * best[m - 1] for m in range(1, MAX_ROWS + 1))
        large = tuple(d <= LARGE_MARGIN * k for d, k in zip(dnn[MAX_ROWS:], seconds["mkl"][MAX_ROWS:]))
        best = [min(b, d) if use else b for b, d, use in zip(best, dnn, onednn)]
    native = seconds.get("native")
    if native is None:
        return RowPlan(pieces, onednn, large)
    small = tuple(t <= NATIVE_MARGIN * b for t, b in zip(native[:MAX_ROWS], best))
    # at each of LARGE_ROWS (where timed): the way a product of that many rows runs otherwise
    others = [dnn[MAX_ROWS + i] if i < len(large) and large[i] else k
              for i, k in enumerate(seconds["mkl"][MAX_ROWS:])]
    native_large = tuple(t <= NATIVE_MARGIN * b for t, b in zip(native[MAX_ROWS:], others))
    return RowPlan(pieces, onednn, large, small, native_large)


def run_pieces(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               pieces: tuple[Piece, ...]) -> torch.Tensor:
    """F.linear(x, weight, bias) for x: (m, in) run as `pieces` -> (m, out)."""
    if len(pieces) == 1:  # padded: the first m rows of the longer product
        (m, run_as), = pieces
        return F.linear(F.pad(x, (0, 0, 0, run_as - m)), weight, bias)[:m]
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    start = 0
    for rows, run_as in pieces:
        xi = x[start:start + rows]
        if run_as > rows:
            out[start:start + rows] = F.linear(F.pad(xi, (0, 0, 0, run_as - rows)), weight, bias)[:rows]
        elif bias is None:
            torch.mm(xi, weight.t(), out=out[start:start + rows])
        else:
            torch.addmm(bias, xi, weight.t(), out=out[start:start + rows])
        start += rows
    return out


class PlannedLinear(nn.Linear):
    """An `nn.Linear` whose products of few rows follow its `RowPlan` (set by `plan_rows`)."""

    row_plan: RowPlan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # traced first: looking the row count up would make torch.compile specialise the graph
        # on it (one recompile per batch size, then eager past its recompile limit)
        if traced_or_recorded(self.weight) or recorded(x) or (self.bias is not None and recorded(self.bias)):
            return F.linear(x, self.weight, self.bias)  # traced or differentiated: plain
        m = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if m and self.row_plan.native_for(m) and native_reads(x, self.weight, self.bias):
            y = native_linear(x.reshape(m, x.shape[-1]).contiguous(), self.weight, self.bias)
            return y.view(*x.shape[:-1], y.shape[-1])
        if m and self.row_plan.onednn_for(m) and x.dtype is self.weight.dtype is torch.float32 \
                and (self.bias is None or self.bias.is_contiguous()):  # (as timed; it reads the bias as contiguous)
            x2, rows = x.reshape(m, x.shape[-1]), onednn_rows(m)
            y = onednn_linear(F.pad(x2, (0, 0, 0, rows - m)) if rows > m else x2, self.weight, self.bias)
            return (y[:m] if rows > m else y).view(*x.shape[:-1], y.shape[-1])
        pieces = self.row_plan.for_rows(m)
        if pieces is None:
            return F.linear(x, self.weight, self.bias)
        y = run_pieces(x.reshape(m, x.shape[-1]), self.weight, self.bias, pieces)
        return y.view(*x.shape[:-1], y.shape[-1])


def plan_rows(model: nn.Module) -> int:
    """Give every `nn.Linear` of a CPU model its row plan; returns how many were planned. The
    plans are timed with weights out of the cache where the model's linear weights together
    are larger than the last-level cache (a step then reads each from memory)."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"]
    cold = sum(m.weight.numel() * m.weight.element_size() for m in linears) > last_level_cache_bytes()
    for module in linears:
        plan = row_plan(module.weight, module.bias, cold)
        module.__class__ = PlannedLinear  # same object, parameters and state dict; a new forward
        module.row_plan = plan
    return len(linears)


@contextmanager
def plain_products(model: nn.Module):
    """Inside, every planned linear layer of `model` runs plain (what the plans save is
    measured against this: bench/row_plans.py)."""
    planned = [m for m in model.modules() if type(m) is PlannedLinear]
    for m in planned:
        m.__class__ = nn.Linear
    try:
        yield
    finally:
        for m in planned:
            m.__class__ = PlannedLinear
