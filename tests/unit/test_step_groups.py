"""Forward batches of a mixed step: every slice once, decode tokens together, and no slice
padded by more than the budget (the padding a single batch would add is the cost avoided)."""
from __future__ import annotations

import random

from hyrax.actors.engine.step_groups import PAD_BUDGET, length_groups


def padded(lengths: list[int], groups: list[list[int]]) -> int:
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def test_decode_tokens_form_one_batch_and_equal_chunks_share_one():
    assert length_groups([1, 1, 1]) == [[0, 1, 2]]
    assert length_groups([256, 1, 256, 1]) == [[1, 3], [0, 2]]


def test_a_short_chunk_is_not_padded_to_a_long_one():
    lengths = [256, 40, 1, 250, 30]
    groups = length_groups(lengths)
    assert groups == [[2], [0, 3], [1, 4]]
    assert padded(lengths, groups) == 1 + 2 * 256 + 2 * 40  # one batch would cost 5 * 256


def test_random_steps_cover_every_slice_once_within_the_budget():
    rng = random.Random(3)
    for _ in range(2_000):
        lengths = [rng.choice([1, 1, 1, rng.randint(2, 300)]) for _ in range(rng.randint(1, 20))]
        groups = length_groups(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            top = max(lengths[i] for i in g)
            assert all(top - lengths[i] <= PAD_BUDGET for i in g)
            assert (top == 1) == all(lengths[i] == 1 for i in g)
        assert padded(lengths, groups) <= len(lengths) * max(lengths)
