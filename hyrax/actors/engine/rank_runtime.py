"""What one TP rank runs: its model shard, its shard of every device pool, its host
backup memory. It owns tensors only and decides nothing: every index comes in a plan or
in a `save` / `load` from the coordinator. Ray-free; `actors/rank.py` wraps it.

Three calls carry everything: `execute(plan) -> StepResult`, `save(req, rows, location)`
(device rows -> RANK_MEMORY, HOST_POOL or OBJECT_STORE) and `load(req, rows, location,
expect)` (a place -> new device rows, read back and paired with what was meant to be written),
mirroring `StateMoves.save` / `load` on the coordinator (moves.py).
"""
from __future__ import annotations

import functools
from itertools import repeat
from operator import attrgetter

import numpy as np
import torch

from hyrax.actors.engine.config import UnsafeFaults
from hyrax.actors.engine.copy_lane import copy_lane
from hyrax.actors.engine.grammar import GrammarMasks
from hyrax.actors.engine.host_buffers import HostBuffers
from hyrax.actors.engine.manifest import StateShard
from hyrax.actors.engine.moves import Location, Place
from hyrax.actors.engine.packed_state import HASH_ROW_BYTES, PackedState, Packing, Packings, row_view
from hyrax.actors.engine.plan import CheckpointMismatch, StepPlan, StepResult
from hyrax.actors.engine.prefix_nodes import checkpoint_pool
from hyrax.actors.engine.pools import PoolSizes, allocate_device_pools
from hyrax.actors.engine.sampler import logprobs_of, sample
from hyrax.actors.engine.spec_columns import SpecColumns
from hyrax.actors.engine.state_hash import ROW_WORDS, hasher, with_length
from hyrax.actors.engine.state_rows import fused_row_moves
from hyrax.actors.engine.step_groups import length_groups
from hyrax.actors.engine.view import PLACEHOLDER
from hyrax.actors.model.batch import ForwardBatch, MixedBatch, build_forward_batch
from hyrax.actors.model.hybrid import HybridModel
from hyrax.actors.model.state import ComponentSpec

Rows = dict[str, list[int]]
_TOKEN_IDS = attrgetter("token_ids")


def make_rank_runtime(model: HybridModel, sizes: PoolSizes, host_rows: dict[str, int], rank: int = 0,
                      faults: UnsafeFaults = UnsafeFaults(), device: str | torch.device = "cpu", broadcast=None,
                      tokenizer_dir: str | None = None, all_reduce=None) -> RankRuntime:
    """The rank for `faults`: with test-only faults on this rank's saves (refused unless
    allow_unsafe), the fault-injecting one; chosen here, once, so the production rank has no
    fault branches."""
    faults.check_components({c.name for c in model.components})
    args = (model, sizes, host_rows, rank, device, broadcast, tokenizer_dir, all_reduce)
    if faults.applies_to(rank) and (faults.skipped or faults.corrupt_backup_component or faults.step_error_at_context
                                    or faults.step_delay_ms):
        from hyrax.testing.faults import UnsafeRankRuntime
        return UnsafeRankRuntime(faults, *args)
    return RankRuntime(*args)


class RankRuntime:
    def __init__(self, model: HybridModel, sizes: PoolSizes, host_rows: dict[str, int], rank: int = 0,
                 device: str | torch.device = "cpu", broadcast=None, tokenizer_dir: str | None = None,
                 all_reduce=None):
        self.model = model
        for backend in model.attention_backends:
            backend.check_page_size(sizes.page_size)
        self.rank = rank
        self.device = torch.device(device)
        self.components = model.components
        self.sizes = sizes
        self.pools = allocate_device_pools(self.components, sizes, self.device)
        # slot component -> its checkpoint pool, where a forward writes checkpoints inside a step
        self._capture_into = {c.name: checkpoint_pool(c.name) for c in self.components
                              if not c.paged and checkpoint_pool(c.name) in self.pools}
        self.paged = frozenset(c.name for c in self.components if c.paged)
        pin = self.device.type == "cuda"
        # the host pool's rows are only read after a backup wrote them: not zero-filled (filling
        # the default 256 MB took 1.2 s of every rank's start, and made all of it resident at once)
        self.host = {
            c.name: torch.empty(len(c.layers), host_rows.get(c.name, 0), *c.unit_shape, dtype=c.dtype, pin_memory=pin)
            for c in self.components
        }
        self.backups: dict[str, PackedState] = {}
        self.buffers = HostBuffers(pin)  # the host tensors of backups, reused
        self.hash = hasher(self.device)  # state hashes of rows where they are (state_hash.py)
        self.host_hash = hasher("cpu")  # ... of host tensors (shards another replica exported)
        self.packings = Packings(self.hash)  # where each component lies in a packed move buffer
        # CPU: backups and restores move and hash each component's rows in one pass (state_rows.py)
        self.fused = fused_row_moves(self.hash) if self.device.type == "cpu" else None
        # state moves copy whole rows: the pools (device and host) as (layers, rows, k) of the widest
        # element that divides a row (packed_state.row_view), and a part's (layers, k, dtype)
        self._row_pools = {c.name: row_view(self.pools[c.name]) for c in self.components}
        self._host_row_pools = {c.name: row_view(self.host[c.name]) for c in self.components}
        self._part = {n: (p.shape[0], p.shape[2], p.dtype) for n, p in self._row_pools.items()}
        cuda = self.device.type == "cuda"
        # plain functions, never bound methods kept on the runtime: one would refer back to it, and
        # that cycle kept a dropped runtime and its pools alive until the cyclic collector ran
        # (memory_budget.measure reads the device right after dropping its throw-away runtime)
        self._gather = self._gather_cuda if cuda else self._gather_cpu
        self._idx = functools.partial(self._idx_on, self.device) if cuda else self._idx_cpu
        self.lane = copy_lane(self.device, self.buffers)  # state moves: a copy stream of their own on a GPU
        # tokens sampled last for each request, so a plan made before they were known can
        # refer to them (overlap scheduling); rank 0 samples and broadcasts them to the group
        self.last_token: dict[str, int] = {}
        self.eos = tuple(model.cfg.eos_token_id)  # masked by min_tokens unless a request ignores EOS
        self.broadcast = broadcast
        self.all_reduce = all_reduce  # the TP group's sum (None: one rank), for what every rank must agree on
        # structured output: rank 0's grammar matchers (request state rebuilt from each plan's tokens)
        self.grammars = GrammarMasks(tokenizer_dir, model.cfg.vocab_size, self.eos) if rank == 0 else None

    # ---- forward ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step; returns the sampled tokens of the entries that sample (rank 0; other
        ranks: an empty result), with logprobs where an entry asked."""
        if self.grammars is not None and plan.grammars:
            self.grammars.prepare(plan.grammars)  # compiled in the background (grammar_gate.py)
        if not plan.num_rows:  # only grammars to start, or a coordinator asking which compiles ended
            return self._result([])
        if plan.copies:  # before anything is written: the hits' checkpoints are what was cached
            self._verify_hits(plan.copies)
        # before the step: a request that left and came back (migrated away and home again)
        # runs in this plan under the same id, and what its first stay left must not outlive it
        for rid in plan.forget:
            self.last_token.pop(rid, None)
            if self.grammars is not None:
                self.grammars.forget(rid)
        for name, slots in plan.zero_slots.items():
            if slots:
                self.pools[name][:, list(slots)] = 0
        for cp in plan.copies:
            self._copy_units(cp)
        block, entries, nb = plan.decode, plan.entries, plan.num_decode
        ids = plan.req_ids  # row order: the decode block's rows, then the entries
        # the token each row's in-flight placeholder stands for (sampled by an earlier step), or
        # PLACEHOLDER where there is none; batch building fills them in (and refuses a missing one)
        fills = list(map(self.last_token.get, ids, repeat(PLACEHOLDER)))
        captures, inside = self._captures(plan) if plan.checkpoints else ({}, frozenset())
        if plan.deterministic:
            # batch-invariant: each request runs alone, with shapes that depend only on itself
            logits = torch.cat([self._forward(block, entries, captures, fills, [i]) for i in range(len(ids))])
        else:
            logits = self._forward_grouped(block, entries, captures, fills)
        sampling = [e for e in entries if e.sample is not None]
        # the block's rows as the columns they are (no object per row), then the entries' specs
        specs = SpecColumns.of_block(block) if nb else SpecColumns.of([])
        if sampling:
            specs = specs.then(SpecColumns.of([e.sample for e in sampling]))
        if len(sampling) < len(entries):
            ids = ids[:nb] + tuple(e.req_id for e in sampling)
            # the sampling rows' logits: all of them in a decode step (no copy), else one index tensor
            logits = logits.index_select(0, self._idx(list(range(nb)) + [nb + i for i, e in enumerate(entries)
                                                                         if e.sample is not None]))
        picked = logits
        if self.rank == 0:
            grammars = specs.grammars()
            allowed = self.grammars.allowed(ids, grammars, self.last_token) if grammars is not None else None
            histories = ([None] * nb + [self._history(e) for e in sampling]) if specs.processed_rows else None
            tokens = sample(picked, specs, histories, self.eos, allowed)
            if grammars is not None:
                self.grammars.advance(ids, grammars, tokens)
        else:
            tokens = [0] * len(specs)
        if self.broadcast is not None and len(specs):
            tokens = self.broadcast(tokens)
        self.last_token.update(zip(ids, tokens))
        sums = self._write_checkpoints(plan.checkpoints, inside) if plan.checkpoints else {}
        if self.rank != 0:
            return StepResult([], checkpoints=sums)
        return self._result(tokens, logprobs_of(picked, tokens, specs) if specs.asks_logprobs else {}, sums)

    def _result(self, tokens: list[int], logprobs: dict | None = None, sums: dict | None = None) -> StepResult:
        """A step's result, with (rank 0) the background grammar compiles that ended since the last."""
        ready, failed = self.grammars.settled() if self.grammars is not None else ((), ())
        return StepResult(tokens, logprobs or {}, sums or {}, ready, failed)

    # ---- prefix cache: a hit's copies in, checkpoints out -------------------------------------
    def _unit_rows(self, pool: str, units: tuple[int, ...]) -> torch.Tensor:
        """Pool rows of `units`: every row of each page of a paged pool, the slot itself otherwise."""
        if pool in self.paged:
            ps = self.sizes.page_size
            return (self._idx(list(units)).unsqueeze(1) * ps + torch.arange(ps, device=self.device)).flatten()
        return self._idx(list(units))

    def _copy_units(self, cp) -> None:
        src, dst = self.pools[cp.src_pool], self.pools[cp.dst_pool]
        dst.index_copy_(1, self._unit_rows(cp.dst_pool, cp.dst), src.index_select(1, self._unit_rows(cp.src_pool, cp.src)))

    @staticmethod
    def _captures(plan: StepPlan) -> tuple[dict[int, list[tuple[int, dict[str, int]]]], frozenset[tuple[str, int]]]:
        """Checkpoints inside an entry's slice (not at its end) are the forward's to write:
        ({row: [(tokens before the capture, {slot component: checkpoint slot}), ...]}, their
        (request, position) keys)."""
        at: dict[str, list] = {}
        for w in plan.checkpoints:
            at.setdefault(w.req_id, []).append(w)
        captures, inside = {}, []
        for i, e in enumerate(plan.entries, start=plan.num_decode):
            for w in at.get(e.req_id, ()):
                if w.position < e.start + len(e.token_ids):
                    captures.setdefault(i, []).append((w.position - e.start, {name: ckpt for name, _, ckpt in w.slots}))
                    inside.append((e.req_id, w.position))
        return captures, frozenset(inside)

    def _write_checkpoints(self, writes, captured: frozenset[tuple[str, int]]) -> dict:
        """Copy each write's request slots into its checkpoint slots (unless the forward
        `captured` them inside the step); their state hashes, as this rank's, from one host
        read: {(request, position): {component: {rank: hash}}}."""
        for w in writes:
            if (w.req_id, w.position) not in captured:
                for name, slot, ckpt in w.slots:
                    self.pools[checkpoint_pool(name)][:, ckpt] = self.pools[name][:, slot]
        keys = [((w.req_id, w.position), name) for w in writes for name, _, _ in w.slots]
        hashes = self.hash.many([self.pools[checkpoint_pool(name)][:, ckpt] for w in writes for name, _, ckpt in w.slots])
        out: dict = {}
        for (key, name), h in zip(keys, hashes):
            out.setdefault(key, {})[name] = {self.rank: h}
        return out

    def _verify_hits(self, copies) -> None:
        """Each checkpoint a hit copies hashed where it lies and compared with the hash this rank
        recorded when it was cached; the verdicts summed over the TP group, so that every rank
        raises the same `CheckpointMismatch` (one rank alone raising would leave the others
        waiting in the forward's collectives)."""
        checked = [cp for cp in copies if cp.expect is not None]
        if not checked:
            return
        got = self.hash.many([self.pools[cp.src_pool][:, cp.src[0]] for cp in checked])
        bad = [dict(cp.expect).get(self.rank) != h for cp, h in zip(checked, got)]
        if self.all_reduce is not None:
            bad = (self.all_reduce(torch.tensor(bad, dtype=torch.int64, device=self.device)) > 0).tolist()
        if any(bad):
            raise CheckpointMismatch(sorted({cp.req_id for cp, b in zip(checked, bad) if b}))

    def _history(self, e) -> np.ndarray | None:
        """Prompt + output ids (int64) of a sampling entry that processes logits, in-flight token filled in."""
        if e.sample.process is None:
            return None
        ids = np.array(e.sample.process.history, dtype=np.int64)
        if len(ids) and ids[-1] < 0:
            ids[-1] = self.last_token[e.req_id]
        return ids

    def _forward_grouped(self, block, entries, captures: dict, fills: list[int]) -> torch.Tensor:
        """A mixed step's decode tokens (one per sequence) and prompt chunks in one packed
        forward (`MixedBatch`, step_groups.py): padding a decode token to the longest chunk
        would multiply the step's work, and a forward of their own would pay every layer's
        fixed cost again."""
        lengths = list(map(len, map(_TOKEN_IDS, entries)))
        if max(lengths, default=1) == 1:  # a decode step: one batch, in row order
            return self._forward(block, entries, captures, fills)
        nb = len(block) if block is not None else 0
        groups = length_groups([1] * nb + lengths)
        if len(groups) == 1:  # prompt chunks only
            return self._forward(block, entries, captures, fills)
        ones, longer = groups
        batch = MixedBatch(self._batch(block, entries, captures, fills, ones),
                           self._batch(block, entries, captures, fills, longer))
        logits = self.model(batch, self.pools)  # rows: the decode tokens', then the chunks'
        if ones[-1] == len(ones) - 1:  # already in step order (the block's rows, then the entries)
            return logits
        return torch.empty_like(logits).index_copy_(0, self._idx(ones + longer), logits)

    def _forward(self, block, entries, captures: dict, fills: list[int], rows: list[int] | None = None) -> torch.Tensor:
        """The forward of the step's rows `rows` (all of them: None; block rows before entries,
        as length_groups keeps them) as one batch."""
        return self.model(self._batch(block, entries, captures, fills, rows), self.pools)

    def _batch(self, block, entries, captures: dict, fills: list[int], rows=None) -> ForwardBatch:
        """The batch of the step's rows `rows` (a sequence of row numbers; all of them: None)."""
        if rows is not None:
            nb = len(block) if block is not None else 0
            captures = {k: captures[i] for k, i in enumerate(rows) if i in captures}
            fills = [fills[i] for i in rows]
            picked = [i for i in rows if i < nb]
            block = block.rows(np.array(picked, dtype=np.int64)) if picked else None
            entries = [entries[i - nb] for i in rows if i >= nb]
        return build_forward_batch(entries, self.components, self.sizes.page_size, self.device, self._capture_into,
                                   captures=captures, fills=fills, block=block)

    # ---- state moves: save and load over a location ----------------------------------------
    def save(self, req_id: str, rows: Rows, location: Location) -> tuple[dict[str, int], StateShard | None]:
        """Copy the request's `rows` of every component to `location`. Returns (checksum per
        component, this rank's shard for OBJECT_STORE, else None)."""
        with self.lane.moving():
            if location.place == Place.OBJECT_STORE:
                return self._export(rows)
            return self._backup(req_id, rows, location.host_rows), None

    def load(self, req_id: str, rows: Rows, location: Location, expect: dict[int, dict[str, int]]) -> dict:
        """Write saved state into `rows` (newly allocated by the coordinator) and read it back.
        `expect`: rank -> component -> the checksum the saving ranks reported; for OBJECT_STORE
        `location.payload` holds every exporting rank's shard. Returns {component: [read back,
        meant to be written]} or {component: "error ..."}; a component not saved is left out."""
        with self.lane.moving():
            if location.place == Place.OBJECT_STORE:
                return self._import(rows, expect, location.payload)
            mine = expect.get(self.rank, {})
            return {name: [h, mine.get(name)] for name, h in self._restore(req_id, rows, location.host_rows).items()}

    # what a save copies: every component, the bytes it checksummed (hyrax/testing/faults.py
    # overrides both to leave a component out or corrupt one, for the tests' mutation checks)
    def _saving(self) -> tuple[ComponentSpec, ...]:
        return self.components

    def _checksummed(self, name: str, data: torch.Tensor) -> None:
        """data: a component's saved rows (layers, rows, *unit), just checksummed."""

    @staticmethod
    def _idx_cpu(rows) -> torch.Tensor:
        """Row indices ((n,) int64 array, or a list) as a tensor: indexing with one is ~15x faster
        than with a Python list; numpy reads a list of ints ~2.5x faster than torch.as_tensor
        (1,024 rows, one core), and an int64 array it takes as it is."""
        return torch.from_numpy(np.asarray(rows, dtype=np.int64))

    @staticmethod
    def _idx_on(device: torch.device, rows) -> torch.Tensor:
        """`_idx_cpu`, on `device` (the rank's)."""
        return RankRuntime._idx_cpu(rows).to(device)

    @staticmethod
    def _gather_cpu(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """src: (layers, pool rows, *unit); idx: (n,) -> out (layers, n, *unit) filled; returns out."""
        return torch.index_select(src, 1, idx, out=out)

    @staticmethod
    def _gather_cuda(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The rows gathered on the device (returned, to hash there) and copied into `out`, the
        export's host buffer (pageable: CUDA returns from such a copy once it is done)."""
        rows = src.index_select(1, idx)
        out.copy_(rows, non_blocking=True)
        return rows

    def _packing(self, idx: dict[str, torch.Tensor]) -> Packing:
        """The packing of these components' rows (idx: component -> (rows,) pool rows), in order."""
        part = self._part
        return self.packings(tuple((n, (part[n][0], i.shape[0], part[n][1]), part[n][2]) for n, i in idx.items()))

    @staticmethod
    def _gather_into(words: torch.Tensor, packing: Packing, pools: dict[str, torch.Tensor],
                     idx: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each component's rows `idx[name]` of `pools[name]` (layers, pool rows, *unit) gathered
        into its part of the packed buffer `words` (R, ROW_WORDS); returns the parts' views."""
        parts = packing.views(words)
        for name, out in parts.items():
            torch.index_select(pools[name], 1, idx[name], out=out)
        return parts

    def _hashed_gather(self, idx: dict[str, torch.Tensor]) -> tuple[PackedState, torch.Tensor | list[int]]:
        """The rows `idx` of the device pools gathered into a packed buffer on the device and
        hashed there: (the buffer, (parts,) hashes before their length terms, not yet read)."""
        packing = self._packing(idx)
        words = self.lane.device_words(packing.rows)
        if self.fused is not None:  # hashes each part's bytes alone: the padding between parts is never read
            at = words.data_ptr()
            sums = self.fused.gather_many([(self._row_pools[p.name], idx[p.name], at + p.first * HASH_ROW_BYTES)
                                           for p in packing.parts])
            return PackedState(words, packing, packing.views(words)), sums
        packing.clear_padding(words)  # the row sums read the whole buffer: its padding must be zero
        parts = self._gather_into(words, packing, self._row_pools, idx)
        return PackedState(words, packing, parts), packing.hash(words)

    def _backup(self, req_id: str, rows: Rows, host_rows: Rows | None) -> dict[str, int]:
        """Copy the request's rows of every component to host memory; returns their state hashes,
        computed where the rows are (on a CUDA rank on the GPU, one host read for all components).

        The rows are gathered into one packed buffer (packed_state.py) and hashed there, all
        components in one pass; on a GPU that buffer is then copied to a pinned host buffer.
        host_rows given: the parts are copied on into the pre-allocated host pool; else the host
        buffer (from `self.buffers`, which `discard` gives back) is the backup.
        """
        staged, sums = self._hashed_gather({c.name: self._idx(rows[c.name]) for c in self._saving()})
        host = self.lane.to_host(staged.words)
        hashes = staged.packing.read(sums)  # the one host read: on a GPU, after the copy to `host`
        kept = staged if host is staged.words else PackedState(host, staged.packing, staged.packing.views(host))
        for name, data in kept.parts.items():
            self._checksummed(name, data)
        if host_rows is not None:
            for name, data in kept.parts.items():
                self._host_row_pools[name].index_copy_(1, self._idx_cpu(host_rows[name]), data)
            self.buffers.give(host)
        else:
            self.discard(req_id)  # an older backup of the request: its buffer goes back
            self.backups[req_id] = kept
        return hashes

    def _read_host_pool(self, host_rows: Rows) -> PackedState:
        """The request's rows of the host pool, packed into a host buffer from `self.buffers`."""
        idx = {c.name: self._idx_cpu(host_rows[c.name]) for c in self.components if c.name in host_rows}
        packing = self._packing(idx)
        words = self.buffers.take((packing.rows, ROW_WORDS), torch.int64)
        return PackedState(words, packing, self._gather_into(words, packing, self._host_row_pools, idx))

    def _restore(self, req_id: str, rows: Rows, host_rows: Rows | None) -> dict[str, int]:
        """Write the backup into `rows` (newly allocated by the coordinator); return the state
        hash of what is now in those rows, per component restored, hashed on the device (the rows
        are never read back to the host): they are gathered again into a packed buffer on the
        device and hashed there, all components in one pass."""
        saved = self._read_host_pool(host_rows) if host_rows is not None else self.backups.get(req_id)
        if saved is None:
            return {}
        words = self.lane.to_device(saved.words)
        data = saved.parts if words is saved.words else saved.packing.views(words)
        idx = {c.name: self._idx(rows[c.name]) for c in self.components if c.name in saved.parts}
        if self.fused is not None:  # each component written and its written rows hashed, in one pass
            sums = self.fused.scatter_many([(self._row_pools[n], i, data[n]) for n, i in idx.items()])
            hashes = saved.packing.read_parts(dict(zip(idx, sums)))
        else:
            for name, i in idx.items():
                self._row_pools[name].index_copy_(1, i, data[name])
            check, sums = self._hashed_gather(idx)
            hashes = check.packing.read(sums)
            self.lane.drop(check.words)
        if host_rows is not None:
            self.buffers.give(saved.words)
        return hashes

    # ---- transfer (PD hand-off, migration) -------------------------------------------------
    def _export(self, rows: Rows) -> tuple[dict[str, int], StateShard]:
        """This rank's shard of every component of a request, for another replica to import:
        the rows gathered straight into one host byte buffer (`StateShard`), hashed where they
        are (on the device). Returns (state hash per component, the shard); the shard's header
        names the global indices it holds along each component's sharded dimension, so the
        importer can re-shard to its own TP layout.
        """
        saving = self._saving()
        idx = {c.name: self._idx(rows[c.name]) for c in saving}
        parts, nbytes = StateShard.layout({
            c.name: ((self.pools[c.name].shape[0], len(idx[c.name]), *self.pools[c.name].shape[2:]),
                     self.pools[c.name].dtype, c.shard_index) for c in saving})
        shard = StateShard(np.empty(nbytes, dtype=np.uint8), parts)
        views = {c.name: shard.tensor(c.name) for c in saving}
        if self.fused is not None:  # gathered into the shard and hashed in one pass
            f = self.fused
            raw = f.gather_many([(self._row_pools[n], idx[n], t.data_ptr()) for n, t in views.items()])
            sums = {n: with_length(h, parts[n].nbytes) for n, h in zip(views, raw)}
        else:
            hashed = [self._gather(self.pools[c.name], idx[c.name], views[c.name]) for c in saving]
            sums = dict(zip(views, self.hash.many(hashed)))
        for name, t in views.items():
            self._checksummed(name, t)
        return sums, shard

    def _import(self, rows: Rows, expect: dict[int, dict[str, int]], shards: tuple[StateShard, ...]) -> dict:
        """Write each component's slice for this rank into `rows` and hash the written rows on
        the device: {component: [hash of the written rows, hash of the slice meant to be
        written]}, or {component: "error ..."}; a component some shard lacks is left out.

        Where one exporting rank held exactly this rank's slice (the same TP layout on both
        sides), its rows are written as they arrived and compared with the hash the exporter
        computed: one hash on each side. Re-sharding (another TP layout) first verifies every
        shard on the host where it arrived, assembles the component and keeps this rank's slice.
        """
        out: dict = {}
        written: dict[str, tuple[torch.Tensor, int | None]] = {}
        for c in self.components:
            if not all(c.name in s.parts for s in shards):
                continue
            target, idx = self.pools[c.name], self._idx(rows[c.name])
            same = [k for k, s in enumerate(shards) if s.parts[c.name].shard_index == tuple(c.shard_index)]
            if same:
                k = same[0]
                rows_in = shards[k].tensor(c.name)
                if self.fused is not None:  # written and the written rows hashed in one pass
                    raw = self.fused.scatter(self._row_pools[c.name], idx, rows_in)
                    out[c.name] = [with_length(raw, shards[k].parts[c.name].nbytes), expect.get(k, {}).get(c.name)]
                    continue
                target.index_copy_(1, idx, rows_in.to(self.device, non_blocking=True))
                written[c.name] = (target.index_select(1, idx), expect.get(k, {}).get(c.name))
                continue
            mine = self._reshard(c, shards, expect)
            if isinstance(mine, str):
                out[c.name] = mine
                continue
            target.index_copy_(1, idx, mine.to(self.device))
            written[c.name] = (target.index_select(1, idx), self.host_hash.many([mine])[0])
        hashes = self.hash.many([t for t, _ in written.values()])
        for (name, (_, want)), h in zip(written.items(), hashes):
            out[name] = [h, want]
        return out

    def _reshard(self, c: ComponentSpec, shards: tuple[StateShard, ...], expect: dict[int, dict[str, int]]):
        """This rank's slice of component `c` (layers, rows, *unit), assembled from every shard
        after verifying each one's hash on the host; or an error string."""
        got = self.host_hash.many([s.tensor(c.name) for s in shards])
        bad = [k for k, h in enumerate(got) if h != expect.get(k, {}).get(c.name)]
        if bad:
            return f"error: state hash mismatch in shard(s) {bad}"
        dim = 2 + c.shard_dim  # (layers, rows, *unit)
        first = shards[0].tensor(c.name)
        shape = list(first.shape)
        shape[dim] = c.global_size
        full = torch.zeros(shape, dtype=first.dtype)
        for s in shards:
            full.index_copy_(dim, torch.tensor(s.parts[c.name].shard_index), s.tensor(c.name))
        return full.index_select(dim, torch.tensor(c.shard_index)).contiguous()

    def discard(self, req_id: str) -> None:
        saved = self.backups.pop(req_id, None)
        if saved is not None:
            self.buffers.give(saved.words)

    def num_backups(self) -> int:
        return len(self.backups)
