"""Executors fan a coordinator's calls out to its ranks and gather per-rank answers.

`Executor` is the contract the engine drives; `RankCalls` implements the state moves over
per-rank calls once, for every executor; `LocalExecutor` runs one in-process rank (tp_size 1)
for `hyrax generate` and unit tests. The Ray executor lives beside the Ray actors
(`hyrax/actors/ray_executor.py`).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from hyrax.actors.engine.moves import Location, Place, Rows
from hyrax.actors.engine.plan import CheckpointMismatch, StepPlan, StepResult
from hyrax.actors.engine.rank_failure import RankFailure  # noqa: F401 - the executors' error, named with them
from hyrax.actors.engine.rank_runtime import RankRuntime


class StepError(RuntimeError):
    """Every rank is alive and answered, but running a step raised on one of them (out of
    memory, a kernel refusing its input): a deterministic error of that step's requests, not
    a rank death. The engine fails those requests and keeps its ranks."""


class StepOutOfMemory(StepError):
    """A rank ran out of device memory in a step (`torch.OutOfMemoryError`, which
    `torch.cuda.OutOfMemoryError` is): the batch was too big, not the requests wrong. The
    engine rebuilds the step's requests from their tokens and lowers its batch cap."""


class StepCorruptHit(StepError):
    """A prefix-cache hit's checkpoint changed since it was cached (`CheckpointMismatch`, raised
    by every rank before the step wrote anything): the engine revokes those hits, keeps the
    checkpoint from being matched again and rebuilds the step's requests."""

    def __init__(self, message: str, req_ids: tuple[str, ...]):
        super().__init__(message)
        self.req_ids = req_ids


def step_error(cause: BaseException | None, where: str) -> StepError:
    """The typed error of a step that raised `cause` on live ranks: by the exception's type,
    never by its message."""
    message = f"the step raised on {where}: {type(cause).__name__}: {cause}"
    if isinstance(cause, CheckpointMismatch):
        return StepCorruptHit(message, cause.req_ids)
    kind = StepOutOfMemory if isinstance(cause, torch.OutOfMemoryError) else StepError
    return kind(message)


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
    """The state moves over the ranks' own `save` and `load` (RankRuntime), for every
    executor; a subclass says how to call every rank (`_each`)."""

    def _each(self, method: str, *args) -> list:
        raise NotImplementedError

    def save(self, req_id: str, rows: Rows, location: Location) -> tuple[Sums, list | None]:
        pairs = self._each("save", req_id, rows, location)
        shards = [p for _, p in pairs] if location.place == Place.OBJECT_STORE else None
        return dict(enumerate(s for s, _ in pairs)), shards

    def load(self, req_id: str, rows: Rows, location: Location, expect: Sums) -> dict[int, dict]:
        return dict(enumerate(self._each("load", req_id, rows, location, expect)))

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
        """In-process, a step simply runs now (an error is raised when it is collected)."""
        try:
            return self.rank.execute(plan)
        except Exception as e:  # noqa: BLE001 - reported by collect, as the Ray executor does
            return _Raised(e)

    def collect(self, handle: StepResult) -> StepResult:
        if isinstance(handle, _Raised):
            raise step_error(handle.error, "rank 0") from handle.error
        return handle


class _Raised:
    def __init__(self, error: Exception):
        self.error = error
