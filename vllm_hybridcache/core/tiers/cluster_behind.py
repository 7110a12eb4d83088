"""The cluster tier's write-behind: which RAM links this replica publishes to the others.

Beside the cluster tier's lookups (core/tiers/cluster.py: ClusterTier, ClusterAnchors), this
decides what the worker's publisher puts into the shared object store: committed RAM tree
links (published by the worker right after their capture, or when committed later) and end
anchors; what leaves RAM is withdrawn. Each plan carries one `ClusterOps` for the worker's
ClusterHandler (vllm_hybridcache/cluster/handler.py). docs/cluster.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from ..keys import PromptKeys
from ..linkformat.job import WriteJob
from ..linkformat.reader import SourceOrigin
from .base import LinkAddr, LinkKind, Tier
from .cluster import ClusterTarget, ClusterTier
from .cluster_anchors import ClusterAnchors
from .lower import LowerTier

__all__ = ["ClusterBehind", "ClusterOps"]

_RAM_TREE = (Tier.RAM.value, LinkKind.TREE.value)


class ClusterOps(msgspec.Struct):
    """One step's operations for the worker's publisher: where it publishes (every plan while
    the tier is on, so a worker starts its publisher on the first) and the committed RAM links
    to publish (their bytes are in the worker's store)."""

    target: ClusterTarget
    publish: list[WriteJob] = msgspec.field(default_factory=list)


class ClusterBehind(LowerTier):
    """Cluster write-behind: RAM tree links and end anchors published, withdrawn when dropped.

    Invariant: `publish` holds only jobs not yet sent. End anchors move only when `anchors`
    is set (not on the MTP route: a payload does not carry an anchor's draft tag).
    """

    name = Tier.CLUSTER.value

    def __init__(self, tier: ClusterTier, target: ClusterTarget, origin: SourceOrigin,
                 anchors: ClusterAnchors | None = None) -> None:
        self.tier = tier
        self.anchors = anchors
        self.target = target
        self.origin = origin
        self.publish: list[WriteJob] = []

    def tiers(self) -> list[Any]:
        return [self.tier]

    def anchor_tiers(self) -> list[Any]:
        return [self.anchors] if self.anchors is not None else []

    # ------------------------------------------------------------------ events from RAM
    def committed(self, addr: LinkAddr, record: Any) -> None:
        if (addr.tier, addr.kind) == _RAM_TREE and record is not None:
            job = self.tier.publish_job(record)
            if job is not None:
                self.publish.append(job)

    def capture_planned(self, addr: LinkAddr, keys: PromptKeys, domain: bytes, start: int,
                        end: int, tag: Any) -> None:
        """Published by the worker right after its capture (the plan carrying both)."""
        if (addr.tier, addr.kind) == _RAM_TREE:
            job = self.tier.capture_job(addr.link_id, keys, domain, start, end, tag)
            if job is not None:
                self.publish.append(job)

    def anchor_reserved(self, addr: LinkAddr, keys: PromptKeys, domain: bytes, end: int,
                        tag: Any) -> None:
        """Published by the worker right after the anchor's capture (the plan carrying it)."""
        if self.anchors is not None and addr.tier == Tier.RAM:
            job = self.anchors.anchor_job(addr.link_id, keys, domain, end, tag)
            if job is not None:
                self.publish.append(job)

    def dropped(self, addrs: Sequence[LinkAddr]) -> None:
        ids = [a.link_id for a in addrs]
        self.tier.unpublished(ids)
        if self.anchors is not None:
            self.anchors.unpublished(ids)

    def cleared(self, tier: str | None, kind: str | None) -> None:
        if self.anchors is not None and tier in (None, Tier.RAM) and kind in (
                None, LinkKind.ANCHOR):
            # cleared anchors leave the directory before the clear returns (their drops reach
            # the worker, which withdraws them too, only with the next step)
            self.anchors.withdraw_all()

    def cleared_tenant(self, tag: bytes, tier: str | None, kind: str | None) -> None:
        if self.anchors is not None and tier in (None, Tier.RAM) and kind in (
                None, LinkKind.ANCHOR):
            # the tenant's published anchors leave the directory before the clear returns
            self.anchors.withdraw_tenant(tag)

    # ------------------------------------------------------------------ worker traffic
    def take_ops(self) -> ClusterOps:
        ops = ClusterOps(self.target, self.publish)
        self.publish = []
        return ops
