"""Counters and timings the engine keeps for metrics and `--json` stats."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hyrax.actors.engine.histogram import Histogram


@dataclass
class PrefixCacheStats:
    query_tokens: int = 0  # tokens of the requests that asked the cache
    hit_tokens: int = 0  # of those, tokens a hit covered (not prefilled)
    hits: int = 0
    checkpoints: int = 0  # checkpoints handed to the tree
    checkpoints_skipped: int = 0  # boundaries passed without a free checkpoint slot
    corrupt: int = 0  # hits refused: a checkpoint's checksum did not match on some rank
    evicted: Counter = field(default_factory=Counter)  # pool -> units evicted (or flushed)
    flushes: int = 0

    def summary(self) -> dict:
        return {"query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens, "hits": self.hits,
                "checkpoints": self.checkpoints, "checkpoints_skipped": self.checkpoints_skipped,
                "corrupt_checkpoints": self.corrupt, "evicted_units": dict(self.evicted), "flushes": self.flushes}


@dataclass
class BatchCapStats:
    """Out-of-memory steps and the batch cap they lowered (batch_cap.py)."""

    out_of_memory_steps: int = 0  # steps that ran out of device memory on live ranks
    rebuilt: int = 0  # requests of those steps put back and rebuilt from their tokens
    failed: int = 0  # requests ended with error: they ran out of memory alone in the smallest step
    shrinks: int = 0
    grows: int = 0
    max_running: int = 0  # the cap now
    max_batch_tokens: int = 0

    def summary(self) -> dict:
        return dict(vars(self))


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    retractions: Counter = field(default_factory=Counter)  # (trigger, mode) -> n
    restores: Counter = field(default_factory=Counter)  # result -> n
    finished: Counter = field(default_factory=Counter)  # finish_reason -> n
    bytes_backed_up: Counter = field(default_factory=Counter)  # component -> bytes (all ranks)
    bytes_restored: Counter = field(default_factory=Counter)
    bytes_transferred: Counter = field(default_factory=Counter)  # imported from another replica
    transfers_in: Counter = field(default_factory=Counter)  # import result -> n
    transfers_out: int = 0  # requests handed to another replica (PD or migration)
    transfer_seconds: Histogram = field(default_factory=Histogram)  # export + import, per side
    backup_seconds: Histogram = field(default_factory=Histogram)
    restore_seconds: Histogram = field(default_factory=Histogram)
    queue_seconds: Histogram = field(default_factory=Histogram)  # arrival -> first scheduled
    checksum_failures: int = 0
    restore_fallbacks: int = 0
    host_pool_full: int = 0
    recoveries: int = 0
    step_errors: int = 0  # steps that raised on live ranks: their requests failed, the ranks stayed
    offers_reclaimed: int = 0  # hand-offs whose lease ended without an acknowledgement
    offers_taken_back: int = 0  # hand-offs no other replica took, run on here (Transfers.take_back)
    prefix: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    batch_cap: BatchCapStats = field(default_factory=BatchCapStats)

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "retractions": sum(self.retractions.values()),
            "retractions_by": {f"{t}/{m}": n for (t, m), n in sorted(self.retractions.items())},
            "restores": self.restores.get("verified", 0),
            "restores_by": dict(self.restores),
            "restore_fallbacks": self.restore_fallbacks,
            "checksum_failures": self.checksum_failures,
            "host_pool_full": self.host_pool_full,
            "recoveries": self.recoveries,
            "step_errors": self.step_errors,
            "offers_reclaimed": self.offers_reclaimed,
            "offers_taken_back": self.offers_taken_back,
            "finished": dict(self.finished),
            "bytes_backed_up": dict(self.bytes_backed_up),
            "bytes_restored": dict(self.bytes_restored),
            "bytes_transferred": dict(self.bytes_transferred),
            "transfers_in": dict(self.transfers_in),
            "transfers_out": self.transfers_out,
            "prefix_cache": self.prefix.summary(),
            "batch_cap": self.batch_cap.summary(),
            "backup_seconds_total": round(self.backup_seconds.sum, 6),
            "restore_seconds_total": round(self.restore_seconds.sum, 6),
            "histograms": {
                "backup_duration_seconds": self.backup_seconds.to_dict(),
                "restore_duration_seconds": self.restore_seconds.to_dict(),
                "pd_transfer_duration_seconds": self.transfer_seconds.to_dict(),
                "queue_time_seconds": self.queue_seconds.to_dict(),
            },
        }
