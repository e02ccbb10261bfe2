"""Forward batches of a mixed step: every slice once, decode tokens together, prompt slices
together (they run packed)."""
from __future__ import annotations

import random

from hyrax.actors.engine.step_groups import length_groups


def test_decode_tokens_form_one_batch_and_prompt_slices_another():
    assert length_groups([1, 1, 1]) == [[0, 1, 2]]
    assert length_groups([256, 1, 256, 1]) == [[1, 3], [0, 2]]
    assert length_groups([256, 40, 1, 250, 30]) == [[2], [0, 1, 3, 4]]
    assert length_groups([7]) == [[0]]


def test_random_steps_cover_every_slice_once():
    rng = random.Random(3)
    for _ in range(2_000):
        lengths = [rng.choice([1, 1, 1, rng.randint(2, 300)]) for _ in range(rng.randint(1, 20))]
        groups = length_groups(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert len(groups) <= 2 and all(g == sorted(g) for g in groups)
        for g in groups:
            assert len({lengths[i] == 1 for i in g}) == 1  # decode tokens never share a batch with a chunk
