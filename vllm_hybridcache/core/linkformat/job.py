"""What a tier hands a writer of link files: one committed RAM link to serialize.

The disk tier writes a `WriteJob` into a link file on disk (core/disk/writer.py); the cluster
tier turns the same job into a payload of the same format for the other replicas
(core/tiers/cluster.py `link_payload`). The link's kind names which tree it belongs to.
"""

from __future__ import annotations

import msgspec

from .tags import EncodedTag

TREE = "tree"      # a tree link: the rows since its parent, cold-exact
ANCHOR = "anchor"  # an end anchor: one root file of the whole prefix, session-exact


class WriteJob(msgspec.Struct, frozen=True):
    """One committed RAM link to copy into a link file (the RAM store holds its bytes under
    `link_id`). Invariants: 0 <= start < end, len(tokens) == 8 * (end - start), parent_digest
    is b"" exactly when start == 0."""

    link_id: int
    domain: bytes
    digest: bytes
    parent_digest: bytes
    start: int
    end: int
    tokens: bytes
    rows: int
    kind: str = "tree"  # or "anchor": an end anchor, one root file of the whole prefix
    # "now": write it; "spill": an end anchor the worker keeps in mind and writes only at
    # shutdown (session spill) unless an explicit "now" job for it comes first (evicted)
    when: str = "now"
    # the link's encoded draft tag on a speculative route (tags.py), carried into the header
    tag: EncodedTag | None = None
