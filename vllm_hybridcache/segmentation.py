"""Where a prefill is cut into forward steps: a pure function of the prompt's tokens.

Cold and resumed prefills of the same prompt cut at the same positions, so a link captured at a
cut and restored later leaves the resumed request to run exactly the forward steps a cold
prefill runs: this is what makes restores exact (docs/architecture.md, "Vocabulary").

Cuts are every multiple of the grid G, plus (optionally) the position right after a
message-end token (`<|im_end|>`) when at least M tokens follow the previous cut. Whether a
position is a cut depends only on the tokens before it, so the cuts of a prefix are the cuts
of the whole prompt that fall inside the prefix.

Fine mode (engines whose forward is split-invariant at 64-aligned positions; the mode is per
engine, docs/split-invariance.md) keeps these steps and adds links inside them:
`inner_positions` says where a step captures, `RecentPrompts` finds junctions.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import msgspec
import numpy as np


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


# ---------------------------------------------------------------- inner captures (fine mode)

STEP = "step"  # links only where a forward step ends (every backend)
FINE = "fine"  # also at 64-aligned positions inside steps (split-invariant backends only)
FINE_ALIGN = 64


def floor_aligned(p: int, align: int = FINE_ALIGN) -> int:
    return p - p % align


def inner_positions(start: int, end: int, wanted: Sequence[int], cuts: frozenset[int],
                    align: int = FINE_ALIGN) -> list[int]:
    """Positions q with start < q < end at which a step [start, end) captures a link from
    inside the step: the `wanted` positions that are multiples of `align` and not cuts (a cut
    inside a step cannot occur; one at `end` is captured as the step's own link). Empty when
    the step does not start on a multiple of `align`: a step starting elsewhere (after a
    message-end cut) anchors its GDN chunks and row tiles there, so no position inside it is
    split-invariant."""
    if start % align:
        return []
    return sorted({q for q in wanted if start < q < end and q % align == 0 and q not in cuts})


class RecentPrompts:
    """The key ids of recent prompts per domain, to find where a new prompt diverges from one.

    A prompt that shares a prefix with an earlier prompt and then parts from it (a document
    with another question, a resent prefix with another suffix) wants a link at the last
    64-aligned position before the divergence (a junction), so the next prompt on that prefix
    resumes there. Which earlier prompt it parts from is tree-dependent, not a function of the
    prompt; that is harmless only because every 64-aligned position is exact in fine mode.
    Bounded by a total token count (oldest prompts forgotten first).
    """

    def __init__(self, max_tokens: int = 1 << 21) -> None:
        import collections

        self.max_tokens = max_tokens
        self._prompts: collections.OrderedDict[int, tuple[bytes, np.ndarray]] = (
            collections.OrderedDict())
        self._tokens = 0
        self._next = 0

    def junction(self, domain: bytes, tokens: np.ndarray) -> int:
        """The longest prefix `tokens` shares with a remembered prompt of `domain` and leaves
        (it is not the whole of `tokens`); 0 when none."""
        best = 0
        n = tokens.shape[0]
        for dom, other in self._prompts.values():
            m = min(n, other.shape[0])
            if dom != domain or m <= best or other[0] != tokens[0]:
                continue
            diff = np.flatnonzero(other[:m] != tokens[:m])
            common = int(diff[0]) if diff.size else m
            if common < n:
                best = max(best, common)
        return best

    def remember(self, domain: bytes, tokens: np.ndarray) -> None:
        if tokens.shape[0] == 0 or tokens.shape[0] > self.max_tokens:
            return
        self._prompts[self._next] = (domain, tokens)
        self._next += 1
        self._tokens += tokens.shape[0]
        while self._tokens > self.max_tokens:
            _, (_, old) = self._prompts.popitem(last=False)
            self._tokens -= old.shape[0]
