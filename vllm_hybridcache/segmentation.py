"""Where a prefill is cut into forward steps: a pure function of the prompt's tokens.

Cold and resumed prefills of the same prompt cut at the same positions, so a link captured at a
cut and restored later leaves the resumed request to run exactly the forward steps a cold
prefill runs: this is what makes restores exact (docs/architecture.md, "Vocabulary").

Cuts are every multiple of the grid G, plus (optionally) the position right after a
message-end token (`<|im_end|>`) when at least M tokens follow the previous cut. Whether a
position is a cut depends only on the tokens before it, so the cuts of a prefix are the cuts
of the whole prompt that fall inside the prefix.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import msgspec


def first_cut_after(cuts: Sequence[int], start: int, default: int) -> int:
    """The first of the ascending `cuts` strictly after `start`, else `default`."""
    i = bisect.bisect_right(cuts, start)
    return cuts[i] if i < len(cuts) else default


class Segmentation(msgspec.Struct, frozen=True):
    """Grid and message-end cut rule.

    grid: every multiple of `grid` is a cut (a multiple of 64: the GDN chunk size, so a cut never
        splits one of the kernels' 64-token chunks).
    message_end_ids: token ids after which a cut may fall (empty = grid only).
    message_end_min: a message-end cut needs at least this many tokens since the previous cut.
    """

    grid: int
    message_end_ids: tuple[int, ...] = ()
    message_end_min: int = 512

    def cuts(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """All cut positions p with 0 < p <= limit (default len(tokens)), ascending."""
        end = len(tokens) if limit is None else min(limit, len(tokens))
        if not self.message_end_ids:
            return list(range(self.grid, end + 1, self.grid))
        ends = frozenset(self.message_end_ids)
        out: list[int] = []
        prev = 0
        for i in range(end):
            p = i + 1
            if p % self.grid == 0 or (tokens[i] in ends and p - prev >= self.message_end_min):
                out.append(p)
                prev = p
        return out

    def next_cut(self, tokens: Sequence[int], start: int) -> int:
        """The first cut strictly after `start`, or len(tokens) if there is none."""
        return first_cut_after(self.cuts(tokens), start, len(tokens))
