"""Where restored hits' rows came from under attention K/V in place, by the hit's tier and kind.

With `attention_in_place` (docs/how-it-works.md) a restored hit's attention rows below vLLM's
own prefix-cache hit are served from vLLM's shared blocks and only the rows above are copied
from the link. These counts (tokens served in place, tokens copied, view bytes not copied)
feed /v1/cache/stats and the metrics; the scheduler side counts each restore it plans.
"""

from __future__ import annotations

__all__ = ["InPlaceCounts"]

_ZERO = {"tokens_in_place": 0, "tokens_copied": 0, "bytes_saved": 0}


class InPlaceCounts:
    """Cumulative counts by (tier, kind)."""

    def __init__(self) -> None:
        self._by_route: dict[tuple[str, str], dict[str, int]] = {}

    def count(self, tier: str, kind: str, tokens: int, in_place: int, block_tokens: int,
              block_bytes: int) -> None:
        """A restore of `tokens` whose first `in_place` come from vLLM's shared blocks (of
        `block_tokens` tokens, `block_bytes` of view rows each, that the copy skips)."""
        c = self._by_route.setdefault((str(tier), str(kind)), dict(_ZERO))
        c["tokens_in_place"] += in_place
        c["tokens_copied"] += tokens - in_place
        c["bytes_saved"] += (in_place // block_tokens) * block_bytes

    def totals(self, tier: str | None = None, kind: str | None = None) -> dict[str, int]:
        """Sums over every (tier, kind), or those matching `tier` / `kind`."""
        out = dict(_ZERO)
        for (t, k), c in self._by_route.items():
            if tier in (None, t) and kind in (None, k):
                for key, v in c.items():
                    out[key] += v
        return out

    def payload(self) -> dict[str, dict[str, dict[str, int]]]:
        """{tier: {kind: counts}}."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (t, k), c in self._by_route.items():
            out.setdefault(t, {})[k] = dict(c)
        return out
