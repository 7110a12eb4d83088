"""The write-behind interface: what a tier below RAM hears about RAM links, and what it sends.

A lower tier (disk, cluster) is two things. Its `CacheTier` objects answer lookups like any
tier (core/tiers/base.py). Its `LowerTier` object hears, through the cache facade
(core/cache.py), what happens to the links of the RAM tiers above it, decides on its own what
to copy down (admission is the tier's policy, never the adapter's), and hands the worker side
its operations once per step under its own name (`take_ops`). One worker-side handler
registered under the same name executes them (core/tiers/handler.py) and reports back
(`absorb`). The adapter never names a tier: it forwards events and ships `{name: ops}`.

Every hook has a no-op default, so a tier implements only the events it needs; `take_ops` is
the one it must write. Hooks run on the scheduler thread, like every tier call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from ..keys import PromptKeys
from .base import LinkAddr, LookupResult

__all__ = ["LowerTier"]


class LowerTier(ABC):
    """One tier below RAM as the facade's write-behind sees it.

    `name` is the key of its operations in each step's plan and of its worker handler; it is
    the tier's `Tier` value (so a load of this tier's hit finds its handler and `origin`).
    `origin`: where this tier's hits' files come from (core/linkformat/reader.py SourceOrigin), sent
    with each load job; None for a tier whose hits need no files.
    """

    name: str
    origin: Any = None

    def tiers(self) -> list[Any]:
        """Its CacheTier objects that sit beside the RAM tree (searched after it)."""
        return []

    def anchor_tiers(self) -> list[Any]:
        """Its CacheTier objects that sit beside the RAM end anchors (searched after them)."""
        return []

    # ------------------------------------------------------------------ events from RAM
    def observe(self, keys: PromptKeys, domain: bytes, res: LookupResult) -> Sequence[int]:
        """A new prompt before its prefill, with the lookup that answered it: the RAM tree
        links (ids) the tier now wants offered again (the facade calls `committed` for each
        that RAM still holds)."""
        return ()

    def committed(self, addr: LinkAddr, record: Any) -> None:  # noqa: B027 (a no-op default)
        """A RAM link was committed (the workers hold its bytes). `record` is the RAM tree's
        LinkRecord for a tree link, None for an end anchor."""

    def capture_planned(self, addr: LinkAddr, keys: PromptKeys,  # noqa: B027 (no-op default)
                        domain: bytes, start: int, end: int, tag: Any) -> None:
        """A RAM tree link [start, end) of `keys` is captured in this step's plan."""

    def anchor_reserved(self, addr: LinkAddr, keys: PromptKeys,  # noqa: B027 (no-op default)
                        domain: bytes, end: int, tag: Any) -> None:
        """An end anchor of keys[:end] was reserved in RAM; its capture is in the next plan."""

    def failed(self, addrs: Sequence[LinkAddr]) -> None:  # noqa: B027 (a no-op default)
        """RAM links whose bytes are missing or suspect (a failed capture or restore, a link
        a worker lost): never copy them down."""

    def dropped(self, addrs: Sequence[LinkAddr]) -> None:  # noqa: B027 (a no-op default)
        """Links of every tier the workers drop with this step's plan (evicted, aborted,
        cleared); called before `take_ops`, so the tier can still copy what it keeps."""

    def cleared(self, tier: str | None, kind: str | None) -> None:  # noqa: B027 (a no-op default)
        """The tiers matching `tier`/`kind` (None: any) were cleared."""

    def cleared_tenant(self, tag: bytes, tier: str | None, kind: str | None) -> None:  # noqa: B027 (a no-op default)
        """One tenant's links (domains ending with `tag`) were cleared in those tiers."""

    def observe_prefill(self, tokens: int, seconds: float) -> None:  # noqa: B027 (a no-op default)
        """A measured prefill step (the tier's own cost checks)."""

    # ------------------------------------------------------------------ worker traffic
    @abstractmethod
    def take_ops(self) -> Any | None:
        """This step's operations for the worker handler of `name` (plain, picklable data),
        or None when there are none. Called once per plan, after the events of the step."""

    def absorb(self, report: Any) -> None:  # noqa: B027 (a no-op default)
        """The handler's latest report (of the worker of tensor-parallel rank 0)."""

    def absorb_shard(self, rank: int, report: Any) -> None:  # noqa: B027 (a no-op default)
        """The latest report of the handler of tensor-parallel rank `rank` > 0."""
