"""`hyrax eval` over the OpenAI HTTP API (official openai client) against the gateway: the
shipped demo checkpoint answers the held-out recall split, and forced retraction on the
server changes no answer."""
from __future__ import annotations

import json

from hyrax.cluster.cli import main
from hyrax.tasks import recall
from hyrax.tasks.evaluate import run_server

N = 100


def test_hyrax_eval_scores_the_demo_model_and_forced_retraction_changes_no_answer(local, capsys):
    problems = recall.heldout(N)
    plain, errors = run_server(local.url, problems, concurrency=8)
    assert errors == 0
    base = recall.score(problems, plain)
    assert base["accuracy"] >= 0.95, base

    before = local.loop.stats()["retractions"]
    local.loop.set_forced_retraction(3)
    try:
        assert main(["eval", "--base-url", local.url, "--limit", str(N), "--concurrency", "8", "--json"]) == 0
        forced, errors = run_server(local.url, problems, concurrency=8)
    finally:
        local.loop.set_forced_retraction(0)
    assert local.loop.stats()["retractions"] - before >= 20
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["n"] == N and out["accuracy"] >= 0.95 and out["errors"] == 0, out
    assert set(out) >= {"accuracy", "invalid_rate", "n"}
    assert errors == 0 and forced == plain  # the same text for every problem


def test_hyrax_eval_rejects_bad_options_with_one_line(capsys):
    assert main(["eval", "--base-url", "http://127.0.0.1:9", "--limit", "0"]) == 2
    assert capsys.readouterr().err.strip() == "hyrax: error: --limit must be >= 1"
    assert main(["eval", "--base-url", "http://127.0.0.1:9", "--concurrency", "0"]) == 2
    assert capsys.readouterr().err.strip() == "hyrax: error: --concurrency must be >= 1"
