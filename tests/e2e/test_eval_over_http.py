"""`hyrax eval` over the OpenAI HTTP API (official openai client) against the gateway: the
shipped demo checkpoint answers the held-out recall split, and forced retraction on the
server changes no answer."""
from __future__ import annotations

import json

from gateway_harness import free_port
from hyrax.cluster.cli import main
from hyrax.tasks import recall
from hyrax.tasks.evaluate import run_server

# 2 passes over the same problems: plain, then `hyrax eval` under forced retraction. Two waves of 8
# concurrent requests a pass (~15 forced retractions in the second); the accuracy over the whole
# held-out split is tests/tasks/test_demo_accuracy.py's claim, this one is the HTTP path.
N = 16


def _answers(local, since: int) -> dict[tuple[int, ...], list[int]]:
    """Token ids of every request the gateway served since its `since`-th, by prompt."""
    return {r["prompt"]: r["tokens"] for r in list(local.client.requests.values())[since:]}


def test_hyrax_eval_scores_the_demo_model_and_forced_retraction_changes_no_answer(local, capsys):
    problems = recall.heldout(N)
    since = len(local.client.requests)
    plain, errors = run_server(local.url, problems, concurrency=8)
    assert errors == 0
    base = recall.score(problems, plain)
    assert base["accuracy"] >= 0.95, base
    plain_answers = _answers(local, since)

    before = local.loop.stats()["retractions"]
    since = len(local.client.requests)
    local.loop.set_forced_retraction(3)
    try:
        assert main(["eval", "--base-url", local.url, "--limit", str(N), "--concurrency", "8", "--json"]) == 0
    finally:
        local.loop.set_forced_retraction(0)
    assert local.loop.stats()["retractions"] - before >= 8, local.loop.stats()["retractions"] - before
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["n"] == N and out["accuracy"] >= 0.95 and out["errors"] == 0, out
    assert set(out) >= {"accuracy", "invalid_rate", "n"}
    # the same tokens for every problem (the gateway recorded both passes' requests)
    forced_answers = _answers(local, since)
    assert len(plain_answers) == N and forced_answers == plain_answers


def test_hyrax_eval_rejects_bad_options_with_one_line(capsys):
    assert main(["eval", "--base-url", "http://127.0.0.1:9", "--limit", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("hyrax eval: error: argument --limit: must be an int >= 1, got '0' "
                                               "(see hyrax eval --help)")
    assert main(["eval", "--base-url", "http://127.0.0.1:9", "--concurrency", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("hyrax eval: error: argument --concurrency: must be an int >= 1, "
                                               "got '0' (see hyrax eval --help)")
    # nothing listening there: one line, no traceback
    assert main(["eval", "--base-url", f"http://127.0.0.1:{free_port()}", "--limit", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hyrax: error: cannot list the models at http://127.0.0.1:") and "\n" not in err, err


def test_hyrax_eval_writes_the_heldout_split_for_other_harnesses(tmp_path, capsys):
    out = tmp_path / "heldout.jsonl"
    assert main(["eval", "--write-jsonl", str(out), "--limit", "25"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    problems = recall.heldout(25)
    assert [r["prompt"] for r in rows] == [p.prompt for p in problems]
    assert [r["target"] for r in rows] == [recall.DELAY + p.answer for p in problems]
    assert all(recall.parse_answer(r["target"]) == r["answer"] for r in rows)
    assert main(["eval", "--limit", "3"]) == 2
    assert "--base-url is required" in capsys.readouterr().err
