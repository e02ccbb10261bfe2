"""Which replica owns each request, from every replica's listing (`ListRequests`).

A request handed from one replica to another (prefill -> decode, a migration) is held by both for
a moment: the source lists it `offered` until the importer's acknowledgement frees it there, and
the importer lists it from its import on. The replicas also answer one by one, so the source may
answer from before its export while the importer answers from after its import. Each import
counts a hop (`hops`, carried in the hand-off: transfer.py), so the row with the most hops is the
request's one owner now; at equal hops a row that is not `offered` wins over the offer.
"""
from __future__ import annotations

from typing import NamedTuple

OFFERED = "offered"  # request.State.OFFERED's value: exported, held until the importer acknowledges


class Owned(NamedTuple):
    replica: object  # the backend whose replica holds it
    row: dict  # that replica's row for it


def _rank(row: dict) -> tuple[int, bool]:
    return row.get("hops", 0), row["state"] != OFFERED


def owners(answers: list[tuple[object, list[dict]]]) -> dict[str, Owned]:
    """Request id -> its owner and row, from (backend, its rows) answers; each id once."""
    out: dict[str, Owned] = {}
    for backend, rows in answers:
        for row in rows:
            have = out.get(row["id"])
            if have is None or _rank(row) > _rank(have.row):
                out[row["id"]] = Owned(backend, row)
    return out
