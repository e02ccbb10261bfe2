"""Helpers for the prefill/decode (PD) integration tests: a PD deployment with its
EngineClient, asyncio drivers over `EngineClient.generate` (with hooks to act mid-stream:
migrate, drain), per-replica stats, the byte formula, and the post-scenario checks.

PD deployments use the role names "prefill" and "decode" (that is what makes a replica
hand requests off), and placement groups/actors are named after the role, so only one PD
deployment can be alive at a time: every test module starts them one after the other.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from contextlib import contextmanager
from functools import lru_cache

import ray

from ray_harness import DEMO_MODEL, PARAMS, assert_clean, call, deployed, stats_delta

from hyrax.actors.engine.config import EngineConfig


# ---- deployments -------------------------------------------------------------------------
@contextmanager
def pd_deployed(roles, config: EngineConfig, model_dir: str = DEMO_MODEL, borrowed: dict | None = None):
    """A PD deployment and its EngineClient; always shut down.

    `borrowed` (role -> a replica of another live deployment, which must run `config`, the same
    checkpoint and the same engine role, e.g. "colocated"): the tests see it as one more
    replica of that role (index 0), and the client routes to it; shutting down stops only the
    replicas started here, so a borrowed one must end as it came, idle and clean."""
    from hyrax.cluster.deployment import Replica
    from hyrax.cluster.ray_client import client_for

    with deployed(model_dir, roles, config) as d:
        view = d if not borrowed else Joined(d, [Replica(role, 0, r.tp, r.coordinator, r.pg)
                                                 for role, r in borrowed.items()])
        yield view, client_for(view, "pd-test")


class Joined:
    """A deployment plus borrowed replicas, as the test helpers read one (`replicas`,
    `model_dir`); replicas are added and removed on the deployment itself (`own`)."""

    def __init__(self, own, borrowed: list):
        self.own, self.borrowed, self.model_dir = own, borrowed, own.model_dir

    @property
    def replicas(self) -> list:
        return self.own.replicas + self.borrowed


def with_role_tp(d, role: str, tp: int):
    """`d` with its one replica of `role` at TP `tp`: a replica of another TP is replaced (removed,
    then the role re-added at `tp`, under the next replica index), the others stay. Lets one
    deployment serve several TP layouts one after the other, at one replica's start each.
    Returns that replica."""
    from hyrax.cluster.deployment import RoleSpec

    [old] = [r for r in d.replicas if r.role == role]
    if old.tp == tp:
        return old
    own = d.own if isinstance(d, Joined) else d  # a borrowed replica is never replaced
    own.remove_replica(old)
    own.roles = [RoleSpec(role, 1, tp) if r.name == role else r for r in own.roles]
    return own.add_replica(role)


@contextmanager
def decode_on(client, target):
    """Hand every request to `target` only: the other decode targets ("decode" and
    "colocated" replicas) are marked draining for the duration (they hold no requests)."""
    others = [b for b in client.backends if b.role != "prefill" and b is not target]
    for b in others:
        client.draining.add(id(b))
    try:
        yield target
    finally:
        for b in others:
            client.draining.discard(id(b))


def coordinator(d, role: str, index: int = 0):
    return next(r.coordinator for r in d.replicas if r.role == role and r.index == index)


def stats(d, role: str, index: int = 0) -> dict:
    return call(coordinator(d, role, index).stats)


def all_stats(d) -> dict[tuple[str, int], dict]:
    return {(r.role, r.index): s for r, s in
            zip(d.replicas, ray.get([r.coordinator.stats.remote() for r in d.replicas], timeout=60))}


def assert_all_clean(d, timeout: float = 30.0) -> None:
    """Every replica: no request, every pool empty, no rank backup, invariants hold."""
    for r in d.replicas:
        try:
            assert_clean(r.coordinator, timeout)
        except AssertionError as e:
            raise AssertionError(f"{r.role}/{r.index}: {e}") from e


def wait_until(pred, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


# ---- byte formula ------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _components(model_dir: str, tp_rank: int, tp_size: int, dtype: str):
    from hyrax.actors.model.config import ModelConfig
    from hyrax.actors.model.hybrid import resolve_dtype
    from hyrax.actors.model.sharding import TP
    from hyrax.actors.model.state import derive_components

    return derive_components(ModelConfig.from_dir(model_dir), TP(tp_rank, tp_size), resolve_dtype(dtype, "cpu"))


def formula_bytes(num_tokens: int, tp: int = 1, model_dir: str = DEMO_MODEL, dtype: str = "float32") -> dict[str, int]:
    """Bytes of a request's state with `num_tokens` committed tokens, summed over the shards
    of `tp` ranks (tp=1: the unsharded formula)."""
    from hyrax.actors.model.state import bytes_formula

    total: Counter = Counter()
    for r in range(tp):
        total.update(bytes_formula(_components(model_dir, r, tp, dtype), num_tokens))
    return dict(total)


def row_bytes(model_dir: str = DEMO_MODEL, dtype: str = "float32") -> dict[str, int]:
    """Unsharded bytes of one row of each component (one token, or a request's slot)."""
    return {c.name: c.row_bytes for c in _components(model_dir, 0, 1, dtype)}


# ---- streaming over EngineClient.generate ------------------------------------------------
class Run:
    """One request streamed through `EngineClient.generate`: the tokens, the items, the end."""

    def __init__(self, rid: str, prompt_ids: list[int], max_tokens: int):
        self.id, self.prompt, self.max_tokens = rid, list(prompt_ids), max_tokens
        self.tokens: list[int] = []
        self.items: list[dict] = []
        self.finish_reason: str | None = None
        self.error: str | None = None

    async def consume(self, client) -> "Run":
        async for item in client.generate(self.id, self.prompt, {"max_tokens": self.max_tokens, **PARAMS}):
            self.items.append(item)
            self.tokens.extend(item.get("token_ids", []))
            if item.get("error"):
                self.error = item["error"]
            if item.get("finished"):
                self.finish_reason = item.get("finish_reason")
        return self


async def wait_for(pred, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def run_concurrently(client, runs: list[Run], during=None, timeout: float = 180.0) -> list[Run]:
    """Stream every run concurrently; `during(runs)` (a coroutine function) runs alongside,
    e.g. to migrate or drain mid-decode. Raises whatever `during` raised."""
    tasks = [asyncio.ensure_future(r.consume(client)) for r in runs]
    try:
        if during is not None:
            await asyncio.wait_for(during(runs), timeout)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return runs


def drive(client, runs: list[Run], during=None, timeout: float = 180.0) -> list[Run]:
    return asyncio.run(run_concurrently(client, runs, during, timeout))


def assert_outputs(runs: list[Run], want: list[list[int]]) -> None:
    for r, w in zip(runs, want):
        assert r.error is None, f"{r.id}: {r.error}"
        assert r.finish_reason == "length", f"{r.id}: finish_reason {r.finish_reason!r}"
        assert r.tokens == w, f"{r.id}: output differs from the single-process engine\n got {r.tokens}\nwant {w}"


__all__ = ["Run", "all_stats", "assert_all_clean", "assert_outputs", "coordinator", "decode_on", "drive",
           "formula_bytes", "pd_deployed", "row_bytes", "run_concurrently", "stats", "stats_delta", "wait_for", "wait_until",
           "with_role_tp"]
