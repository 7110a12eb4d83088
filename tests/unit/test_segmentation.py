"""Segmentation: a pure function of the tokens; cuts of a prefix are the prefix's cuts."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from vllm_hybridcache.segmentation import Segmentation

END = 5


def test_grid_only():
    seg = Segmentation(grid=64)
    assert seg.cuts(list(range(200))) == [64, 128, 192]
    assert seg.cuts(list(range(64))) == [64]
    assert seg.cuts(list(range(63))) == []


def test_message_end_cut_needs_min_tokens_since_previous_cut():
    seg = Segmentation(grid=64, message_end_ids=(END,), message_end_min=10)
    toks = [1] * 5 + [END] + [1] * 20 + [END] + [1] * 50
    # END at index 5: only 6 tokens since 0 -> no cut; END at index 26: cut at 27
    assert seg.cuts(toks) == [27, 64]


@given(st.lists(st.integers(0, 8), max_size=400), st.integers(0, 400))
def test_cuts_of_a_prefix_are_the_prompts_cuts_inside_it(tokens, n):
    seg = Segmentation(grid=64, message_end_ids=(END,), message_end_min=7)
    full = seg.cuts(tokens)
    prefix = tokens[:n]
    assert seg.cuts(prefix) == [c for c in full if c <= len(prefix)]
    assert full == sorted(set(full))


def test_next_cut():
    seg = Segmentation(grid=64)
    toks = list(range(150))
    assert seg.next_cut(toks, 0) == 64
    assert seg.next_cut(toks, 64) == 128
    assert seg.next_cut(toks, 130) == 150
    rnd = random.Random(0)
    toks = [rnd.randrange(10) for _ in range(1000)]
    seg = Segmentation(grid=128, message_end_ids=(3,), message_end_min=50)
    cuts = seg.cuts(toks)
    for c in cuts:
        assert c % 128 == 0 or toks[c - 1] == 3
