"""Admission: what a new request must satisfy before it joins the queue (bad input raises
`HyraxInputError` and changes nothing), and what a plan's admitted requests take when they
start running."""
from __future__ import annotations

import time
from typing import Mapping, Sequence

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.lifecycle import RequestTable
from hyrax.actors.engine.pools import PoolSizes
from hyrax.actors.engine.request import Request, SamplingParams
from hyrax.actors.engine.scheduler import Scheduled
from hyrax.actors.engine.stats import EngineStats
from hyrax.actors.engine.statecopy import pages_needed
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.state import ComponentSpec, WINDOW


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  components: tuple[ComponentSpec, ...], sizes: PoolSizes, page_size: int, prefill_chunk: int) -> None:
    """Valid parameters, a non-empty prompt of token ids shorter than the context, that fits
    every paged pool once every other request is gone."""
    params.validate(vocab_size)
    if not prompt_ids:
        raise HyraxInputError("the prompt is empty")
    if any((not isinstance(t, int)) or t < 0 or t >= vocab_size for t in prompt_ids):
        raise HyraxInputError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(prompt_ids) >= max_model_len:
        raise HyraxInputError(f"prompt has {len(prompt_ids)} tokens; the model's context is {max_model_len} tokens")
    ps = page_size
    for c in components:
        if not c.paged:
            continue
        # the prompt (plus the first token); a window pool holds the window and one chunk
        tokens = len(prompt_ids) + 1 if c.kind != WINDOW else min(len(prompt_ids) + 1, c.window + prefill_chunk)
        if pages_needed(c, tokens, ps) > sizes.units[c.name]:
            raise HyraxInputError(f"prompt of {len(prompt_ids)} tokens can never fit the {c.name} pool "
                                  f"({sizes.units[c.name] * ps} tokens)")


def _claimed(req: Request, grants: Mapping[str, Sequence[int]], alloc: dict[str, IndexAllocator]):
    """`req`, once the units `grants` gives it (pool -> units) are claimed for it."""
    for name, units in grants.items():
        alloc[name].claim(req.id, units)
    return req


def claim(got: Scheduled, table: RequestTable, alloc: dict[str, IndexAllocator], stats: EngineStats) -> None:
    """The plan's units become its requests' (in the order the scheduler took them); the
    admitted requests start running."""
    for e in got.plan.entries:
        grants = got.grants.get(e.req_id)
        if not grants:
            continue  # took nothing: its tables and slots are the view's, i.e. its own already
        req = _claimed(table.get(e.req_id), grants, alloc)
        req.indices.update({name: tuple(t) for name, t in e.page_tables.items()})  # tuples: as the plan's, no copy
        req.indices.update({name: (slot,) for name, slot in e.slots.items()})
    for rid, tables in got.opened.items():  # lane rows that opened a page (scheduler.py)
        _claimed(table.get(rid), got.grants[rid], alloc).indices.update(tables)
    now = time.monotonic()
    for rid in got.admitted:
        r = table.get(rid)
        table.start(r)
        if r.first_scheduled_at is None:
            r.first_scheduled_at = now
            stats.queue_seconds.append(now - r.arrival)
