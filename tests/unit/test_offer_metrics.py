"""/metrics counts the hand-offs a replica took back and those it reclaimed.

A prefill replica whose hand-off no decode replica takes decodes that request itself
(docs/lifecycle.md): an operator of a prefill/decode deployment must be able to see that
happen, as its stats count it (`offers_taken_back`, and `offers_reclaimed` for an offer freed
without an acknowledgement). Neither was exported: only tests could read them.

The real app over real in-process engine loops: prefill/0 and decode/0, whose loop is shut down
(it refuses the hand-off at admission), so prefill/0 takes its hand-off back.
"""
from __future__ import annotations

from engine_helpers import HYBRID, make_engine, tiny_model
from gateway_fakes import gateway
from hyrax.actors.engine.loop import EngineLoop
from hyrax.api.client import LocalBackend
from prometheus_client.parser import text_string_to_metric_families


def _counters(text: str, family: str) -> dict[tuple[str, str], float]:
    """(role, replica) -> the value of counter `family` (its `_total` sample) in a scrape."""
    return {(s.labels["role"], s.labels["replica"]): s.value
            for f in text_string_to_metric_families(text) if f.name == family
            for s in f.samples if s.name == f"{family}_total"}


def test_a_hand_off_the_prefill_replica_took_back_is_counted_in_metrics():
    model = tiny_model(HYBRID)
    loops = [EngineLoop(make_engine(model, role="prefill"), "prefill"),
             EngineLoop(make_engine(model, prefix_cache=False, role="decode"), "decode")]
    loops[1].shutdown()
    try:
        http = gateway(replicas=[LocalBackend(loops[0], "prefill", 0), LocalBackend(loops[1], "decode", 0)])
        r = http.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 12,
                                               "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text
        scrape = http.get("/metrics").text
        assert _counters(scrape, "hyrax_offers_taken_back") == {("prefill", "0"): 1.0, ("decode", "0"): 0.0}
        assert _counters(scrape, "hyrax_offers_reclaimed") == {("prefill", "0"): 0.0, ("decode", "0"): 0.0}
    finally:
        loops[0].shutdown()
