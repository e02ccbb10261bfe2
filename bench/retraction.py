"""Suite 3 — retraction cost, in-process (one `RankRuntime`, demo checkpoint: full_kv, swa_kv,
mamba_conv, mamba_ssm — every component kind).

Throughput: requests with long prompts run until they decode; then, round after round, each
is retracted (`Engine.retract(..., mode="cpu_tensor", hold=True)`: backup of every component
on the rank, state hashes of the gathered rows, manifest, device indices freed) and resumed
(`Engine.resume`: new indices, restore, the written rows hashed on the device and verified). Bytes = the manifest's
bytes of all components. Per request, the median over rounds; summed over requests.
Baseline in the same process: `torch.empty(n, dtype=uint8).copy_(src)` for the same n bytes
per request (contiguous, no checksum), median of repetitions.
Rows: backup GB/s, restore GB/s, and the round trip (bytes / (backup + restore) vs
bytes / (2 copies)); target: round trip >= 0.5 of the plain copy. Informational: the share of
the round trip spent in the rank's own save + load (copies and hashes; the rest is the engine's
bookkeeping: rows, allocation, manifest), and a bulk round trip (every request retracted in one
call, then resumed in one call).

Data path at a larger state (informational): the rank's own save + load (`RankRuntime.save` /
`load`: gathers, packed-buffer hashes, restore writes and read-back hashes; no engine
bookkeeping) of `LARGE_ROWS` rows of every paged component (page-contiguous, pages shuffled, as
after churn) and one slot of each slot component, several MB where the demo model's requests stop
at 2,048 tokens (~1 MB): what the copies and hashes themselves cost against two plain copies
into a reused buffer (the moves reuse theirs too), without the per-request fixed cost that
dominates the rows above.

Restore vs recompute: for prompt length L, time restoring a retracted request (the resume
above) vs prefilling L tokens from scratch (a fresh request's steps up to its first token:
what a `recompute` resume has to redo). The crossover row gives the smallest swept L from
which restoring is faster at every longer swept L (hyrax = L; no baseline: informational).
"""
from __future__ import annotations

import random
import time

import torch

from bench.common import BENCH_SEED, Profile, load_demo_engine, median, progress, prompt_ids, run_until, time_call
from bench.report import Row, ratio

LARGE_ROWS = 8192  # rows of each paged component in the data-path row (full_kv 4 MB, swa_kv 8 MB)


def _config():
    from hyrax.actors.engine.config import EngineConfig

    return EngineConfig(kv_capacity_tokens=32768, mamba_slots=32, max_running=32, retraction_backup="cpu_tensor")


def _start(engine, lengths, rng) -> list[str]:
    from hyrax.actors.engine.request import SamplingParams

    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    ids = [engine.add_request(prompt_ids(rng, n), params) for n in lengths]
    run_until(engine, lambda: all(len(engine.requests[i].output_ids) >= 1 for i in ids))
    return ids


def _cycle(engine, rid: str) -> tuple[float, float, int]:
    """Retract (backup) and resume (restore) one running request: (backup s, restore s, bytes)."""
    t0 = time.perf_counter()
    mode = engine.retract([rid], mode="cpu_tensor", hold=True)[rid]
    t1 = time.perf_counter()
    req = engine.requests[rid]
    if mode != "cpu_tensor" or req.backup is None:
        raise RuntimeError(f"retraction: backup of {rid} fell back to {mode}")
    nbytes = sum(rec.bytes * len(rec.checksums) for rec in req.backup.manifest.components.values())
    t2 = time.perf_counter()
    result = engine.resume([rid])[rid]
    t3 = time.perf_counter()
    if result != "verified":
        raise RuntimeError(f"retraction: restore of {rid} gave {result!r}")
    return t1 - t0, t3 - t2, nbytes


def copy_seconds(nbytes: int, reps: int = 7) -> float:
    """Median seconds of one contiguous copy of `nbytes` bytes into a fresh tensor."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    return time_call(lambda: torch.empty(nbytes, dtype=torch.uint8).copy_(src), reps=reps, warmup=2)


def warm_copy_seconds(nbytes: int, reps: int = 7) -> float:
    """Median seconds of one contiguous copy of `nbytes` bytes into a buffer reused every time
    (no page faults of fresh memory: at several MB those made the fresh-buffer copy swing 10x here)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    return time_call(lambda: dst.copy_(src), reps=reps, warmup=2)


def _throughput(profile: Profile) -> list[Row]:
    engine = load_demo_engine(_config())
    rng = random.Random(BENCH_SEED)
    ids = _start(engine, profile.retract_prompts, rng)
    for rid in ids:  # warm-up round
        _cycle(engine, rid)
    rank_s = _time_rank_calls(engine.executor.rank)
    cycles = {rid: [_cycle(engine, rid) for _ in range(profile.retract_rounds)] for rid in ids}
    in_rank = rank_s[0] / profile.retract_rounds
    bulk = [_bulk_cycle(engine, ids) for _ in range(profile.retract_rounds)]
    engine.check_invariants()
    for rid in ids:
        engine.abort(rid)
    engine.step_outputs_flush()
    data_path = _data_path_row(engine, profile)
    # per request: median over rounds (one preemption by another process must not decide a row)
    moved = sum(runs[0][2] for runs in cycles.values())
    back = sum(median(r[0] for r in runs) for runs in cycles.values())
    rest = sum(median(r[1] for r in runs) for runs in cycles.values())
    base = sum(copy_seconds(runs[0][2]) for runs in cycles.values())
    whole = sum(sum(r[0] + r[1] for r in runs) for runs in cycles.values()) / profile.retract_rounds
    gb = 1e9
    return [
        Row("retraction backup GB/s vs contiguous torch copy", moved / back / gb, moved / base / gb,
            ratio(base, back)),
        Row("retraction restore GB/s vs contiguous torch copy", moved / rest / gb, moved / base / gb,
            ratio(base, rest)),
        Row("retraction backup+restore round trip GB/s vs 2 contiguous copies", moved / (back + rest) / gb,
            moved / (2 * base) / gb, ratio(2 * base, back + rest), profile.target(">= 0.5")),
        Row("retraction round trip: seconds in the rank's save + load (copies, hashes) vs the whole round trip",
            in_rank, whole, ratio(in_rank, whole)),
        Row(f"retraction bulk ({len(ids)} requests per retract and per resume call) round trip GB/s vs "
            "2 contiguous copies", moved / median(bulk) / gb, moved / (2 * base) / gb, ratio(2 * base, median(bulk))),
        data_path,
    ]


def _data_path_row(engine, profile: Profile) -> Row:
    """The rank's save + load of a large synthetic request (no request holds those rows: every
    request was aborted; the load writes back the bytes the save took, verified)."""
    import numpy as np

    from hyrax.actors.engine.moves import Location, Place

    rank, ps = engine.executor.rank, engine.config.page_size
    rng = np.random.default_rng(BENCH_SEED)
    rows = {}
    for c in rank.components:
        n = rank.pools[c.name].shape[1]
        if c.paged:
            pages = rng.permutation(n // ps)[:LARGE_ROWS // ps]
            rows[c.name] = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
        else:
            rows[c.name] = np.array([int(rng.integers(n))])
    here = Location(Place.RANK_MEMORY)

    def cycle() -> tuple[float, float]:
        t0 = time.perf_counter()
        sums, _ = rank.save("bench-large", rows, here)
        t1 = time.perf_counter()
        got = rank.load("bench-large", rows, here, {rank.rank: sums})
        t2 = time.perf_counter()
        if any(h != want for h, want in got.values()) or set(got) != set(sums):
            raise RuntimeError(f"retraction: data-path restore did not verify: {got}")
        return t1 - t0, t2 - t1

    cycle()  # warm-up
    runs = [cycle() for _ in range(profile.retract_rounds)]
    rank.discard("bench-large")
    nbytes = sum(len(r) * c.row_bytes for c, r in zip(rank.components, rows.values()))
    moved = median(a + b for a, b in runs)
    base = warm_copy_seconds(nbytes)
    return Row(f"retraction data path at {nbytes / 2**20:.0f} MB ({LARGE_ROWS} rows per paged component): rank "
               "save + load GB/s vs 2 contiguous copies into a reused buffer", nbytes / moved / 1e9,
               nbytes / (2 * base) / 1e9, ratio(2 * base, moved))


def _time_rank_calls(rank) -> list[float]:
    """Accumulate the seconds `rank.save` and `rank.load` take from now on (in [0])."""
    total = [0.0]
    for name in ("save", "load"):
        call = getattr(rank, name)

        def timed(*args, _call=call):
            t0 = time.perf_counter()
            try:
                return _call(*args)
            finally:
                total[0] += time.perf_counter() - t0
        setattr(rank, name, timed)
    return total


def _bulk_cycle(engine, ids: list[str]) -> float:
    """Retract every request in one call and resume them in one call: seconds."""
    t0 = time.perf_counter()
    modes = engine.retract(ids, mode="cpu_tensor", hold=True)
    results = engine.resume(ids)
    dt = time.perf_counter() - t0
    if set(modes.values()) != {"cpu_tensor"} or set(results.values()) != {"verified"}:
        raise RuntimeError(f"retraction: bulk cycle gave {modes} / {results}")
    return dt


def _prefill_seconds(engine, n: int, rng) -> float:
    from hyrax.actors.engine.request import SamplingParams

    rid = engine.add_request(prompt_ids(rng, n), SamplingParams(max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    run_until(engine, lambda: rid not in engine.requests)
    dt = time.perf_counter() - t0
    engine.finished_requests.pop(rid, None)
    return dt


def _crossover(profile: Profile) -> list[Row]:
    engine = load_demo_engine(_config())
    rng = random.Random(BENCH_SEED + 1)
    rows, wins = [], []
    _prefill_seconds(engine, 64, rng)  # warm-up
    for n in profile.crossover_lengths:
        [rid] = _start(engine, [n], rng)
        _cycle(engine, rid)
        restore = median(_cycle(engine, rid)[1] for _ in range(profile.crossover_reps))
        engine.abort(rid)
        engine.step_outputs_flush()
        prefill = median(_prefill_seconds(engine, n, rng) for _ in range(profile.crossover_reps))
        wins.append((n, restore < prefill))
        rows.append(Row(f"restore vs recompute, prompt {n}: restore ms vs prefill ms", restore * 1e3,
                        prefill * 1e3, ratio(restore, prefill)))
    engine.check_invariants()
    # the smallest L from which restoring wins at every larger swept L
    cross = None
    for n, win in reversed(wins):
        if not win:
            break
        cross = n
    rows.append(Row(f"restore beats recompute from prompt length (smallest of {wins[0][0]}..{wins[-1][0]} swept "
                    "from which restore always wins)", cross, None, None))
    return rows


def run(profile: Profile) -> list[Row]:
    progress(f"retraction: backup/restore throughput, prompts {list(profile.retract_prompts)}")
    rows = _throughput(profile)
    progress(f"retraction: restore vs recompute, prompts {list(profile.crossover_lengths)}")
    return rows + _crossover(profile)
