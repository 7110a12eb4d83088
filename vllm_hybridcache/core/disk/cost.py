"""ReadCost: a disk hit is taken only when reading it costs less than the prefill it saves.

A disk hit is staged file by file from the chain's root, so its cost is the bytes of the whole
chain over the tier's read bandwidth (page cache copy + CRC on the way, as measured), while
what it saves is the prefill of the tokens beyond what RAM serves, over the engine's prefill
rate. On a fast model with a slow disk (or a chain barely deeper than RAM's hit) the prefill
wins, and the tier answers a miss, counted as `slower_than_prefill`.

Both rates are measured at run time and injected (`observe_read` from finished disk restores,
`observe_prefill` from the engine's prefill steps), as exponentially weighted averages; until
the first measurements the priors hold. The priors are deliberately on the side of reading:
1 GB/s (well under a local NVMe's sequential read) and 2,000 tokens/s (a large model's prefill
on one GPU is of that order at long contexts; a tiny CPU model is faster, which its first
measured steps show within a few requests).

Pure: no clock, no I/O.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ReadCost", "ReadRefusal"]


class ReadRefusal(StrEnum):
    """Why the disk tier answered a miss although it holds the chain."""

    SLOWER_THAN_PREFILL = "slower_than_prefill"


class ReadCost:
    """Read bandwidth and prefill rate, measured (EWMA with weight `alpha`) over priors."""

    def __init__(self, read_bytes_per_s: float = 1e9, prefill_tokens_per_s: float = 2000.0,
                 alpha: float = 0.2) -> None:
        if read_bytes_per_s <= 0 or prefill_tokens_per_s <= 0 or not 0 < alpha <= 1:
            raise ValueError("rates must be > 0 and 0 < alpha <= 1")
        self.read_bytes_per_s = float(read_bytes_per_s)
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.alpha = alpha
        self.reads_seen = 0
        self.prefills_seen = 0

    def observe_read(self, nbytes: int, seconds: float) -> None:
        """A disk hit of `nbytes` was staged and restored in `seconds` (ignored when empty)."""
        if nbytes <= 0 or seconds <= 0:
            return
        self.read_bytes_per_s = self._mix(self.read_bytes_per_s, nbytes / seconds,
                                          self.reads_seen)
        self.reads_seen += 1

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill step forwarded `tokens` of one prompt in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        self.prefill_tokens_per_s = self._mix(self.prefill_tokens_per_s, tokens / seconds,
                                              self.prefills_seen)
        self.prefills_seen += 1

    def _mix(self, old: float, new: float, seen: int) -> float:
        # the first measurement replaces the prior outright: a prior is a guess, not a sample
        return new if seen == 0 else (1 - self.alpha) * old + self.alpha * new

    def read_seconds(self, nbytes: int) -> float:
        return nbytes / self.read_bytes_per_s

    def prefill_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def worth(self, read_bytes: int, tokens_saved: int) -> bool:
        """Whether reading `read_bytes` costs less than prefilling `tokens_saved` tokens."""
        return tokens_saved > 0 and self.read_seconds(read_bytes) < self.prefill_seconds(
            tokens_saved)
