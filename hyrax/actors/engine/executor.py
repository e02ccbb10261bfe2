"""Executors fan a coordinator's calls out to its ranks and gather per-rank answers.

`Executor` is the contract the engine drives; `RankCalls` implements the state moves over
per-rank calls once, for every executor; `LocalExecutor` runs one in-process rank (tp_size 1)
for `hyrax generate` and unit tests. The Ray executor lives beside the Ray actors
(`hyrax/actors/ray_executor.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from hyrax.actors.engine.moves import Location, Place, Rows
from hyrax.actors.engine.plan import StepPlan
from hyrax.actors.engine.rank_runtime import RankRuntime


class RankFailure(RuntimeError):
    """A rank died, hung past the timeout, or raised."""


@dataclass(frozen=True)
class StepResult:
    """What one step sampled: a token per sampling entry, in plan order, and the logprobs of
    the sampling rows that asked for them."""

    tokens: list[int]
    logprobs: dict[int, dict] = field(default_factory=dict)

    @classmethod
    def of(cls, raw) -> StepResult:
        """From rank 0's answer: the token list, or (tokens, logprobs) when some entry asked."""
        return cls(*raw) if isinstance(raw, tuple) else cls(list(raw))


Sums = dict[int, dict[str, int]]  # rank -> component -> checksum


class Executor(Protocol):
    num_ranks: int

    def submit(self, plan: StepPlan) -> Any:
        """Start a step on every rank; returns a handle for `collect`."""

    def collect(self, handle: Any) -> StepResult: ...

    def save(self, req_id: str, rows: Rows, location: Location) -> tuple[Sums, list | None]:
        """Copy `rows` of every component to `location` on every rank: (checksums, the
        exported shards for OBJECT_STORE, else None)."""

    def load(self, req_id: str, rows: Rows, location: Location, expect: Sums) -> dict[int, dict]:
        """Write saved state into `rows` on every rank: rank -> component -> [read back, written]
        (or an error string). `expect`: the checksums the saving ranks reported."""

    def discard(self, req_id: str) -> None: ...

    def num_backups(self) -> dict[int, int]: ...


class RankCalls:
    """The state moves over the ranks' calls (`backup`/`restore` for this replica's places,
    `export`/`import_state` for the object store); a subclass says how to call every rank."""

    def _each(self, method: str, *args) -> list:
        raise NotImplementedError

    def _export(self, req_id: str, rows: Rows) -> tuple[list, list]:
        pairs = self._each("export", req_id, rows)
        return [s for s, _ in pairs], [p for _, p in pairs]

    def save(self, req_id: str, rows: Rows, location: Location) -> tuple[Sums, list | None]:
        if location.place == Place.OBJECT_STORE:
            sums, shards = self._export(req_id, rows)
            return dict(enumerate(sums)), shards
        return dict(enumerate(self._each("backup", req_id, rows, location.host_rows))), None

    def load(self, req_id: str, rows: Rows, location: Location, expect: Sums) -> dict[int, dict]:
        if location.place == Place.OBJECT_STORE:
            return dict(enumerate(self._each("import_state", req_id, rows, expect, *location.payload)))
        read = self._each("restore", req_id, rows, location.host_rows)
        return {r: {name: [crc, expect.get(r, {}).get(name)] for name, crc in sums.items()}
                for r, sums in enumerate(read)}

    def discard(self, req_id: str) -> None:
        self._each("discard", req_id)

    def num_backups(self) -> dict[int, int]:
        return dict(enumerate(self._each("num_backups")))


class LocalExecutor(RankCalls):
    def __init__(self, rank: RankRuntime):
        self.rank = rank
        self.num_ranks = 1

    def _each(self, method: str, *args) -> list:
        return [getattr(self.rank, method)(*args)]

    def submit(self, plan: StepPlan):
        """In-process, a step simply runs now."""
        return self.rank.execute(plan)

    def collect(self, handle) -> StepResult:
        return StepResult.of(handle)
