"""Helpers for the integration tests: streaming clients over a RoleCoordinator, the
in-process reference engine, and the post-scenario cleanliness checks.

Imported by the test modules next to it (pytest puts this folder on sys.path).
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import ray

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.local import load_engine, run_to_completion
from hyrax.actors.engine.request import SamplingParams

DEMO_MODEL = str(Path(__file__).resolve().parents[2] / "hyrax" / "models" / "demo")

# The shared demo deployment: one TP=1 and one TP=2 replica, deterministic float32.
# overlap and the compiled graph: the defaults of `hyrax serve`
DEMO_CONFIG = EngineConfig(deterministic=True, overlap=True, compiled_graph=True)
# The tiny SWA+Mamba2 deployment: small pages and chunks, so prompts cross pages, the
# window (8 tokens) and prefill-chunk boundaries.
SWA_CONFIG = EngineConfig(deterministic=True, page_size=4, prefill_chunk=16, kv_capacity_tokens=2048, overlap=True,
                          compiled_graph=True)

# Every test request ignores EOS, so output lengths (and the number of steps in which
# retraction can strike) are fixed by max_tokens alone.
PARAMS = {"ignore_eos": True}


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(length)]


# ---- deployments -------------------------------------------------------------------------
@contextmanager
def deployed(model_dir: str, roles, config: EngineConfig, rank_timeout_s: float = 60.0):
    """Start a Deployment and always shut it down (placement groups included).

    Placement groups, coordinators and ranks are named after the role (hyrax/<role>/<i>),
    so deployments alive at the same time need distinct role names."""
    from hyrax.cluster.deployment import Deployment

    d = Deployment(model_dir, roles, config, rank_timeout_s=rank_timeout_s)
    try:
        d.start(timeout_s=300)
        yield d
    finally:
        d.shutdown()


def replica(d, role: str):
    return next(r for r in d.replicas if r.role == role)


# ---- reference ---------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _reference(model_dir: str, config: EngineConfig, prompts: tuple[tuple[int, ...], ...],
               max_tokens: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    engine = load_engine(model_dir, config)
    ids = [engine.add_request(list(p), SamplingParams(max_tokens=m, **PARAMS)) for p, m in zip(prompts, max_tokens)]
    run_to_completion(engine)
    return tuple(tuple(engine.finished_requests[i].output_ids) for i in ids)


def reference(model_dir: str, config: EngineConfig, prompts: list[list[int]], max_tokens: list[int] | int
              ) -> list[list[int]]:
    """Greedy outputs of the uninterrupted single-process engine (no retraction, no faults)."""
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    # host_pool_mb=0: nothing is retracted here, and the default 256 MB host pool (zero-filled
    # when the engine is built) cost ~1 s of every reference run on the loaded 2-core machine
    clean = EngineConfig(
        page_size=config.page_size, kv_capacity_tokens=config.kv_capacity_tokens,
        swa_capacity_tokens=config.swa_capacity_tokens, mamba_slots=config.mamba_slots,
        max_batch_tokens=config.max_batch_tokens, prefill_chunk=config.prefill_chunk,
        deterministic=True, dtype=config.dtype, host_pool_mb=0,
    )
    out = _reference(model_dir, clean, tuple(tuple(p) for p in prompts), tuple(max_tokens))
    return [list(o) for o in out]


# ---- streaming client --------------------------------------------------------------------
class Stream:
    """One streaming generate call, consumed by a background thread.

    The test thread can watch the tokens arrive (`wait_tokens`) and act mid-stream
    (retract, abort, kill a rank) while the stream keeps flowing.
    """

    def __init__(self, coord, request_id: str, prompt_ids: list[int], max_tokens: int, gateway: str | None = None,
                 **params):
        self.id = request_id
        self.prompt = list(prompt_ids)
        self.tokens: list[int] = []
        self.items: list[dict] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._gen = coord.generate.remote(request_id, self.prompt, {"max_tokens": max_tokens, **PARAMS, **params},
                                          gateway=gateway)  # the gateway lease holding the stream (None: none)
        self._thread = threading.Thread(target=self._consume, name=f"stream-{request_id}", daemon=True)
        self._thread.start()

    def _consume(self) -> None:
        try:
            for ref in self._gen:
                item = ray.get(ref)
                with self._cv:
                    self.items.append(item)
                    self.tokens.extend(item.get("token_ids", []))
                    if item.get("finished"):
                        self.finish_reason = item.get("finish_reason")
                    self._cv.notify_all()
                if item.get("finished"):
                    break
        except BaseException as e:  # noqa: BLE001 - surfaced to the test by `done`
            with self._cv:
                self.error = e
                self._cv.notify_all()
        finally:
            with self._cv:
                self._cv.notify_all()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def wait_tokens(self, n: int, timeout: float = 60.0) -> int:
        """Block until at least n tokens arrived (or the stream ended); returns the count."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while len(self.tokens) < n and not self.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.id}: {len(self.tokens)} of {n} tokens after {timeout}s")
                self._cv.wait(left)
            return len(self.tokens)

    def wait_done(self, timeout: float = 120.0) -> "Stream":
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.id}: stream still open after {timeout}s ({len(self.tokens)} tokens)")
        if self.error is not None:
            raise AssertionError(f"{self.id}: stream raised {self.error!r}") from self.error
        return self


def run_all(coord, prompts: list[list[int]], max_tokens: list[int] | int, prefix: str = "r",
            timeout: float = 180.0) -> list[Stream]:
    """Submit every prompt concurrently and wait for all of them to finish."""
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    streams = [Stream(coord, uid(f"{prefix}{i}"), p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    for s in streams:
        s.wait_done(timeout)
    return streams


def sigkill_rank_and_wait_for_replacement(coord, restarts: int, timeout: float = 120.0) -> dict:
    """SIGKILL the process of the replica's only rank (as the OOM killer does) and wait until the
    coordinator counts more than `restarts` restarts and is healthy; its health then. Raises
    AssertionError when the coordinator died with the rank or did not replace it in time."""
    [rank] = call(coord.rank_handles)
    os.kill(ray.get(rank.__ray_call__.remote(lambda self: os.getpid()), timeout=30), signal.SIGKILL)
    t0 = time.monotonic()
    while True:
        try:
            health = call(coord.health, timeout=30)
        except ray.exceptions.RayActorError as e:
            raise AssertionError(f"the coordinator died with its rank: {type(e).__name__}") from e
        if health["restarts"] > restarts and health["healthy"]:
            return health
        assert time.monotonic() - t0 < timeout, f"the rank was not replaced: {health}"
        time.sleep(0.1)


# ---- inspection --------------------------------------------------------------------------
def call(handle_method, *args, timeout: float = 60.0, **kwargs):
    return ray.get(handle_method.remote(*args, **kwargs), timeout=timeout)


def request_info(coord, request_id: str) -> dict | None:
    for r in call(coord.list_requests):
        if r["id"] == request_id:
            return r
    return None


def rank_backups(coord) -> list[int]:
    return ray.get([h.num_backups.remote() for h in call(coord.rank_handles)], timeout=60)


def assert_clean(coord, timeout: float = 30.0) -> None:
    """The replica drained: no request, no used index on any pool, no backup on any rank,
    and the allocation invariants hold. Polls: the loop thread finishes asynchronously."""
    deadline = time.monotonic() + timeout
    while not call(coord.is_idle_clean):
        if time.monotonic() > deadline:
            raise AssertionError(f"replica not idle-clean after {timeout}s: pools={call(coord.pools)} "
                                 f"requests={call(coord.list_requests)}")
        time.sleep(0.05)
    assert call(coord.check_invariants) is True
    assert call(coord.list_requests) == []
    for name, use in call(coord.pools)["components"].items():
        assert use["used"] == 0 and use["host_used"] == 0, (name, use)
    assert rank_backups(coord) == [0] * len(call(coord.rank_handles))


def assert_manifest_from_every_rank(manifest: dict, components: list[str], tp: int) -> None:
    """Every declared component is in the backup manifest, with a checksum from every rank."""
    got = manifest["components"]
    assert sorted(got) == sorted(components), f"manifest components {sorted(got)} != {sorted(components)}"
    for name in components:
        ranks = sorted(got[name]["checksums"])
        assert ranks == [str(r) for r in range(tp)], f"{name}: checksums from ranks {ranks}, want 0..{tp - 1}"
        assert got[name]["rows"] > 0 and got[name]["bytes"] > 0, (name, got[name])


def stats_delta(before: dict, after: dict) -> dict:
    """Counters of `after` minus `before`; a nested dict of counters lists only the ones that
    moved, so a replica's earlier history (a replica shared between modules) leaves no 0 entries."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, dict):
            moved = {kk: vv - (b or {}).get(kk, 0) for kk, vv in v.items() if isinstance(vv, (int, float))}
            out[k] = {kk: n for kk, n in moved.items() if n}
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(b, (int, float, type(None))):
            out[k] = v - (b or 0)
    return out
