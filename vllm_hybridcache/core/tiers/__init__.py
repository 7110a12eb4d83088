"""Cache tiers: every place that holds links, behind one interface (base.CacheTier).

- base.py: the interface, the Tier/LinkKind enums, the plain data they hand out.
- ram_tree.py: SnapshotTree, cold-exact links at prefill cuts in host RAM (ram/tree).
- anchors.py: EndAnchors, session-exact end-of-request states in host RAM (ram/anchor).
- disk.py: DiskTier, cold-exact links as files on a local disk (disk/tree).

A cluster tier is one more module here implementing CacheTier, registered with the
facade (core/cache.py); nothing in the adapter routes by anything but (tier, kind).
"""

from .anchors import EndAnchors
from .base import (
    CacheTier,
    Fits,
    IdSource,
    LinkAddr,
    LinkKind,
    LinkRef,
    LookupResult,
    Reservation,
    RestorePlan,
    Tier,
)
from .disk import DiskTier
from .ram_tree import LinkRecord, SnapshotTree

__all__ = [
    "CacheTier",
    "DiskTier",
    "EndAnchors",
    "Fits",
    "IdSource",
    "LinkAddr",
    "LinkKind",
    "LinkRecord",
    "LinkRef",
    "LookupResult",
    "Reservation",
    "RestorePlan",
    "SnapshotTree",
    "Tier",
]
