"""Which pool rows hold a request's state — written once over the component list.

The coordinator computes rows from its index tables; ranks copy those rows out to host
memory (backup, export) and back in through new rows (restore, import).
"""
from __future__ import annotations

import numpy as np

from hyrax.actors.model.state import ComponentSpec


def live_rows(comp: ComponentSpec, indices: list[int], num_tokens: int, page_size: int) -> np.ndarray:
    """Device pool rows of a request's live state for `comp`, in canonical order
    (by token position for paged components; the slot for slot components): (rows,) int64, the
    form a rank indexes with (no list to build here and convert back there). Built page by page:
    every row of the live pages, (pages, page_size), cut to the live positions."""
    if not comp.paged:
        return np.asarray(indices, dtype=np.int64)
    live = comp.live_positions(num_tokens)
    if not len(live):
        return np.empty(0, dtype=np.int64)
    first = live.start // page_size
    pages = np.asarray(indices[first:(live.stop - 1) // page_size + 1], dtype=np.int64)  # (live pages,)
    if pages.min() < 0:
        p = max(live.start, (first + int(np.argmax(pages < 0))) * page_size)
        raise RuntimeError(f"{comp.name}: live position {p} has no page")
    rows = (pages[:, None] * page_size + _offsets(page_size)).reshape(-1)  # (live pages * page_size,)
    start = live.start - first * page_size
    return rows[start:start + len(live)]


_OFFSETS: dict[int, np.ndarray] = {}


def _offsets(page_size: int) -> np.ndarray:
    """(page_size,) int64: 0 .. page_size - 1, made once per page size."""
    o = _OFFSETS.get(page_size)
    if o is None:
        o = _OFFSETS[page_size] = np.arange(page_size, dtype=np.int64)
    return o


def pages_needed(comp: ComponentSpec, num_tokens: int, page_size: int) -> int:
    """Length of a page table covering positions 0..num_tokens-1."""
    return -(-num_tokens // page_size) if comp.paged else 1


def live_page_numbers(comp: ComponentSpec, num_tokens: int, page_size: int) -> list[int]:
    """Page numbers (positions // page_size) that must be allocated to hold the live rows."""
    if not comp.paged:
        return [0]
    pos = comp.live_positions(num_tokens)
    if not len(pos):
        return []
    return list(range(pos.start // page_size, (pos.stop - 1) // page_size + 1))


def releasable_pages(comp: ComponentSpec, table: list[int], num_tokens: int, page_size: int) -> list[int]:
    """Page numbers of a window component whose every position has left the window."""
    if comp.kind != "window":
        return []
    gone = (num_tokens - comp.live_rows(num_tokens)) // page_size  # pages before the first live one
    if gone == 0 or max(table[:gone]) < 0:  # one C-level scan: usually all released already
        return []
    return [n for n in range(gone) if table[n] >= 0]
