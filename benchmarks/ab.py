"""Alternating A/B rounds: the one harness for "what does switch X cost on a cold prefill".

Why: on a shared 2-core machine the load moves between minutes, so two arms measured one
after the other differ by the load as much as by the switch. Each round runs every arm once
on the same input, back to back, and the order flips every round (a warm cache or a turbo
state favours neither arm); the per-round ratio of two arms then cancels the load that moves
between rounds, and its median is the figure to quote (`paired`), beside the ratio of the
medians. The 1-minute load is read at each round's end and sampled once a second in between
(`LoadSampler`), so a table can say the range it ran under.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from benchmarks.machine_load import LoadSampler

__all__ = ["ABRun", "alternate", "round_order"]


def round_order(arms: Sequence[str], r: int) -> list[str]:
    """The arms in round `r`: as listed on even rounds, reversed on odd ones."""
    return list(arms) if r % 2 == 0 else list(arms)[::-1]


@dataclass
class ABRun:
    """Every arm's samples of every metric, round by round, and the load seen."""

    arms: tuple[str, ...]
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """metric -> arm -> one value per round (in round order)."""
    loads: list[float] = field(default_factory=list)

    def values(self, metric: str, arm: str) -> list[float]:
        return self.samples[metric][arm]

    def median(self, metric: str, arm: str) -> float:
        return statistics.median(self.values(metric, arm))

    def ratio(self, metric: str, num: str, den: str) -> float:
        """The ratio of the two arms' medians."""
        return self.median(metric, num) / self.median(metric, den)

    def paired(self, metric: str, num: str, den: str) -> float:
        """The median of the rounds' own ratios (each round's arms ran back to back)."""
        return statistics.median(n / d for n, d in zip(self.values(metric, num),
                                                       self.values(metric, den), strict=True))

    def load_range(self) -> str:
        """"low-high" of the loads seen (one decimal), "" when none were read."""
        seen = [x for x in self.loads if x is not None]
        return f"{min(seen):.1f}-{max(seen):.1f}" if seen else ""

    def rounds_comment(self, label: str, metrics: Mapping[str, int]) -> str:
        """An HTML comment with every round's values (`metrics`: name -> decimals), so a
        table's medians can be re-derived from the page."""
        parts = []
        for metric, digits in metrics.items():
            parts.append(f"{metric} " + " ".join(
                f"{arm} {[round(v, digits) for v in self.values(metric, arm)]}"
                for arm in self.arms))
        return f"<!-- {label}: {'; '.join(parts)} -->"


def alternate(arms: Sequence[str], repeat: int,
              one: Callable[[str, int], Mapping[str, float]],
              read_load: Callable[[], float] | None = lambda: os.getloadavg()[0],
              sampler: Callable[[], LoadSampler] = LoadSampler) -> ABRun:
    """Run `repeat` rounds; in round r each arm runs once (`one(arm, r)` -> its metrics), in
    `round_order`. `read_load=None`: no load is read (a pure-compute bench in one process)."""
    run = ABRun(tuple(arms))
    if read_load is not None:
        run.loads.append(float(read_load()))
    with sampler() as load:
        for r in range(repeat):
            for arm in round_order(arms, r):
                for metric, value in one(arm, r).items():
                    run.samples.setdefault(metric, {a: [] for a in arms})[arm].append(
                        float(value))
            if read_load is not None:
                run.loads.append(float(read_load()))
    if read_load is not None and load.peak is not None:
        run.loads.append(load.peak)
    return run
