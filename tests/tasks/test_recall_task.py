"""The recall task generator: deterministic, splits that never overlap, answers that depend
on tokens farther back than the demo model's sliding window."""
from __future__ import annotations

import random

from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.demo import DEMO_CONFIG, DEMO_DIR, EOS
from hyrax.tasks import recall
from hyrax.tasks.train import TrainConfig, encode, max_delay_at


def test_generator_is_a_pure_function_of_split_count_and_seed():
    assert recall.generate("train", 200, 7) == recall.generate("train", 200, 7)
    assert recall.generate("heldout", 50, 7) == recall.generate("heldout", 50, 7)
    assert recall.generate("train", 50, 7) != recall.generate("train", 50, 8)
    assert recall.heldout(30) == recall.heldout(100)[:30]  # --limit takes a prefix of one fixed list
    a, b = random.Random(3), random.Random(3)
    assert [recall.training_problem(a) for _ in range(50)] == [recall.training_problem(b) for _ in range(50)]


def test_heldout_split_never_overlaps_training_data():
    held = recall.heldout(1000)
    assert len({p.prompt for p in held}) == 1000
    assert all(recall.split_of(p.prompt) == "heldout" for p in held)
    rng = random.Random("train-stream:0")  # the stream `hyrax train-demo --seed 0` draws from
    trained = set()
    for _ in range(20000):
        p = recall.training_problem(rng)
        assert recall.split_of(p.prompt) == "train"
        trained.add(p.prompt)
    trained |= {p.prompt for p in recall.generate("train", 3000, 0)}
    assert not trained & {p.prompt for p in held}
    # the split is a property of the text: roughly 1 in HELDOUT_MOD of all prompts
    draws = [recall.make_problem(random.Random(i)) for i in range(4000)]
    frac = sum(recall.split_of(p.prompt) == "heldout" for p in draws) / len(draws)
    assert abs(frac - 1 / recall.HELDOUT_MOD) < 0.02


def test_answers_depend_on_tokens_beyond_the_sliding_window():
    cfg = ModelConfig.from_dir(DEMO_DIR)
    window = cfg.sliding_window
    assert window == DEMO_CONFIG.sliding_window
    assert recall.MIN_DISTANCE > window
    # Nothing in a single layer can bridge the delay line: sliding attention sees window - 1
    # tokens back and Mamba's convolution d_conv - 1; even chained, the layers before the
    # full-attention layer (conv, sliding, conv) reach less far back than the delay line is
    # long. So once the first digit is due, the question has travelled through per-request
    # state carried across decode steps (conv state, sliding-window rows, SSM state) — which
    # a retraction must restore — or not at all.
    types = cfg.layer_types
    full = types.index("full_attention")
    assert types.count("full_attention") == 1
    reach = {"mamba2": cfg.mamba_d_conv - 1, "sliding_attention": window - 1}
    before = sum(reach[t] for t in types[:full])
    assert len(recall.DELAY) > before and len(recall.DELAY) > max(reach.values()), before
    for p in recall.heldout(500):
        body, key = p.prompt[:-2], p.prompt[-1]
        assert p.prompt == f"{body}?{key}"
        at = body.index(key)  # the asked pair (keys are distinct)
        assert body[at:].startswith(f"{key}{p.answer}")
        assert len(p.prompt) - at == p.distance > recall.MIN_DISTANCE
        # the first digit is predicted from the last delay letter: by then the question is
        # farther back than the chained reach before the full-attention layer
        last_delay = len(p.prompt) - 1 + len(recall.DELAY)
        assert last_delay - (len(p.prompt) - 1) > before


def test_scoring_counts_exact_matches_and_malformed_completions_as_invalid():
    ps = recall.heldout(5)
    d = recall.DELAY
    comps = [(d + ps[0].answer, True),  # right
             (d + ("0" if ps[1].answer[0] != "0" else "1") + ps[1].answer[1:], True),  # wrong, well formed
             (d[:-1] + ps[2].answer, True),  # delay line broken
             (d + ps[3].answer, False),  # no terminator
             (d + "12", True)]  # too short
    assert recall.score(ps, comps) == {"accuracy": 0.2, "invalid_rate": 0.6, "n": 5}
    assert recall.parse_answer(d + "0123") == "0123"


def test_training_scores_exactly_the_completion_and_terminator():
    p = recall.training_problem(random.Random(1), max_delay=len(recall.DELAY))
    p = recall.Problem(p.prompt, p.answer, p.distance)  # the whole delay line
    ids, scored = encode(p)
    assert bytes(ids[: len(p.prompt)]).decode() == p.prompt
    assert [ids[t + 1] for t in scored] == list((recall.DELAY + p.answer).encode()) + [EOS]


def test_curriculum_grows_the_delay_line_and_never_scores_an_undetermined_first_letter():
    tc = TrainConfig(steps=1000, delay_ramp=0.5)
    lines = [max_delay_at(s, tc) for s in range(0, 1000, 50)]
    assert lines[0] == 0 and lines == sorted(lines) and max_delay_at(500, tc) == len(recall.DELAY)
    assert max_delay_at(0, TrainConfig(delay_ramp=0.0)) == len(recall.DELAY)
    rng = random.Random(2)
    cut = [recall.training_problem(rng, max_delay=5) for _ in range(400)]
    assert {p.delay for p in cut} == set(range(6))
    for p in cut[:50]:
        ids, scored = encode(p)
        assert p.completion == recall.DELAY[len(recall.DELAY) - p.delay:] + p.answer
        assert scored[0] == len(p.prompt)  # the first completion token is not scored
        assert [ids[t + 1] for t in scored] == list(p.completion[1:].encode()) + [EOS]
