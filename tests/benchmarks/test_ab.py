"""The alternating A/B harness (benchmarks/ab.py) the cold-prefill benchmarks share: the order
flips every round, the paired ratio is the median of the rounds' own ratios, the load range is
what was read. Fake arms, no engine."""

from __future__ import annotations

import pytest

from benchmarks.ab import alternate, round_order


class NoSampler:
    peak = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_the_order_flips_every_round():
    assert round_order(("a", "b", "c"), 0) == ["a", "b", "c"]
    assert round_order(("a", "b", "c"), 1) == ["c", "b", "a"]
    seen = []
    alternate(("off", "on"), 4, lambda arm, r: seen.append((r, arm)) or {"t": 1.0},
              read_load=None, sampler=NoSampler)
    assert seen == [(0, "off"), (0, "on"), (1, "on"), (1, "off"), (2, "off"), (2, "on"),
                    (3, "on"), (3, "off")]


def test_the_paired_ratio_cancels_what_moves_between_rounds():
    """Round r's load multiplies both arms' times by 1, 3, 1, 3, 9; `on` costs 1.1x `off` in
    every round. The paired ratio is 1.1; the ratio of the medians is too here, but the
    rounds' values are kept per arm in round order for either."""
    load = [1, 3, 1, 3, 9]
    ab = alternate(("off", "on"), 5,
                   lambda arm, r: {"t": load[r] * (1.1 if arm == "on" else 1.0)},
                   read_load=None, sampler=NoSampler)
    assert ab.values("t", "off") == [1, 3, 1, 3, 9]
    assert ab.paired("t", "on", "off") == pytest.approx(1.1)
    assert ab.median("t", "on") == pytest.approx(3.3)
    # negative control: pairing the wrong way round gives the inverse
    assert ab.paired("t", "off", "on") == pytest.approx(1 / 1.1)


def test_a_minority_of_rounds_slowed_in_one_arm_moves_neither_figure():
    """Two of five rounds slowed in one arm only (the load rose between its two requests):
    both medians hold; with three of five slowed, the paired figure says so."""
    off = [1.0, 1.0, 1.0, 1.0, 1.0]
    on = [1.2, 5.0, 5.0, 1.2, 1.2]
    ab = alternate(("off", "on"), 5, lambda arm, r: {"t": (on if arm == "on" else off)[r]},
                   read_load=None, sampler=NoSampler)
    assert ab.paired("t", "on", "off") == pytest.approx(1.2)
    assert ab.ratio("t", "on", "off") == pytest.approx(1.2)
    on[:] = [1.2, 5.0, 5.0, 5.0, 1.2]  # three slow rounds: now the majority
    ab = alternate(("off", "on"), 5, lambda arm, r: {"t": (on if arm == "on" else off)[r]},
                   read_load=None, sampler=NoSampler)
    assert ab.paired("t", "on", "off") == pytest.approx(5.0)


def test_the_load_is_read_at_each_round_end_and_its_peak_kept():
    reads = iter([0.5, 0.7, 0.6])

    class Peak(NoSampler):
        peak = 1.9

    ab = alternate(("a", "b"), 2, lambda arm, r: {"t": 1.0}, read_load=lambda: next(reads),
                   sampler=Peak)
    assert ab.loads == [0.5, 0.7, 0.6, 1.9] and ab.load_range() == "0.5-1.9"
    none = alternate(("a", "b"), 1, lambda arm, r: {"t": 1.0}, read_load=None,
                     sampler=NoSampler)
    assert none.loads == [] and none.load_range() == ""
    assert none.rounds_comment("m", {"t": 1}) == "<!-- m: t a [1.0] b [1.0] -->"
