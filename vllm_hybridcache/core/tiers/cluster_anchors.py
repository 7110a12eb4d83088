"""End anchors committed on another replica (tier `cluster`, kind `anchor`).

Shares the cluster tier's transport, staging and verification (core/tiers/cluster.py) and
serves what another replica published as a RAM end anchor would be served: session-exact,
never across domains, only deeper than what this replica holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from ..keys import BLOCK, PromptKeys, in_tenant
from ..linkformat.job import WriteJob
from .base import (
    LinkKind,
)
from .cluster import ClusterError, ClusterTier, Pending, RemoteEntry, block_locator

# local(keys, domain, limit) -> depth of this replica's own end anchor for the prompt (0: none)
LocalAnchor = Callable[[PromptKeys, bytes, int], int]

__all__ = ["ClusterAnchors"]


class ClusterAnchors(ClusterTier):
    """End anchors committed on another replica (tier `cluster`, kind `anchor`).

    An end anchor is the state where a conversation's last turn stopped (core/tiers/anchors.py):
    one root link [0, n) of the prompt plus all but the last sampled token, session-exact. A
    replica publishes the anchors it captures (`anchor_job`, the worker publishes right after
    the capture, as for tree links); when a turn of that conversation lands on another replica,
    this tier finds the anchor, fetches it, verifies it like any remote payload (header, kind
    `anchor`, fingerprint, domain, digest, rows, every token id; every part's CRC and MAC in
    the worker) and serves it like the RAM anchor tier would have on the owner:

    - session-exact (`cold_exact` False): the resumed request publishes nothing shared, exactly
      as after a local anchor; the greedy gate is what holds it to a cold run;
    - never across domains (the domain includes `cache_salt`) or fingerprints (the directory is
      keyed by both, and the payload's header is checked against both);
    - `slow`: served only when deeper than RAM's hit; a replica that holds an end anchor of the
      prompt itself does not ask the directory (its own conversation: it never waits on the
      cluster for it), and its own entries are never fetched;
    - not promoted: after the restore the staged ids are dropped (the request's own end anchor
      replaces it in RAM, as with a spilled anchor read from disk);
    - never on a speculative route (a payload does not carry the anchor's draft tag): a lookup
      with a `fits` predicate is a miss and a tagged anchor is never published.

    A lookup sends the directory the prompt's digests at its key block boundaries and gets the
    anchors indexed under one of them (`anchor_block`); an anchor whose digest at its end is
    not the prompt's is ignored, and the fetched payload's token ids are compared with the
    prompt's before anything is served. Staged bytes share one budget with the tree tier
    given (`budget_bytes` of the cluster tier). An anchor dropped on its owner (superseded,
    evicted, failed, cleared) leaves the directory as its owner's worker drops it; a clear of
    the RAM anchors also removes every anchor this replica published from the directory before
    it returns (`withdraw_all`), so nothing cleared is located afterwards.
    """

    kind = LinkKind.ANCHOR
    cold_exact = False

    def __init__(self, tree: ClusterTier, local: LocalAnchor | None = None) -> None:
        if tree.shards > 1:  # an anchor's payload is one rank's; no rank sets for anchors yet
            raise ValueError("cluster end anchors work with one tensor parallel rank only")
        super().__init__(tree.layout, tree.fingerprint, tree.transport, tree._cuts,
                         tree.stage_dir, tree.budget_bytes, tree.timeout_s,
                         next_id=tree._next_id, hasher=tree._hasher, promote=None,
                         clock=tree._clock, owner=tree.owner, baseline=tree._baseline,
                         key=tree.key)
        self._local = local
        self._peers.append(tree)
        tree._peers.append(self)

    # ------------------------------------------------------------------ the remote lookup
    def _positions(self, keys: PromptKeys, domain: bytes, lim: int) -> list[int]:
        """The prompt's key block boundaries up to `lim` (where anchors are indexed); none when
        this replica holds an end anchor of the prompt itself."""
        if lim < BLOCK or (self._local is not None and self._local(keys, domain, lim) > 0):
            return []
        return list(range(BLOCK, lim + 1, BLOCK))

    def _depth(self, positions: list[int], lim: int) -> int:
        return lim  # an anchor may end anywhere up to the lookup's limit

    def _locate(self, domain: bytes, keys: PromptKeys, positions: list[int],
                lim: int) -> Pending:
        return self.transport.locate_anchors(
            [block_locator(self.key, self.fingerprint, domain, keys.digest(c))
             for c in positions], lim)

    def _forget(self, locators: list[bytes]) -> None:
        self.transport.forget_anchors(locators)

    def _chain(self, entries: Sequence[RemoteEntry], keys: PromptKeys,
               domain: bytes) -> list[RemoteEntry]:
        """The deepest anchor whose locator at its end is the prompt's (a chain of one)."""
        for e in sorted(entries, key=lambda e: e.end, reverse=True):
            if (e.start == 0 and not e.parent_locator and BLOCK <= e.end <= len(keys)
                    and e.locator == self._locator(domain, keys.digest(e.end))):
                return [e]
        return []

    # ------------------------------------------------------------------ publication
    def publish_job(self, record: Any) -> WriteJob | None:
        """Anchors are published at their capture only (`anchor_job`)."""
        return None

    def capture_job(self, link_id: int, keys: PromptKeys, domain: bytes, start: int, end: int,
                    tag: Any = None) -> WriteJob | None:
        return self.anchor_job(link_id, keys, domain, end, tag)

    def anchor_job(self, link_id: int, keys: PromptKeys, domain: bytes, end: int,
                   tag: Any = None) -> WriteJob | None:
        """The publication of an end anchor of tokens[:end] reserved in RAM, for the worker to
        publish right after its capture, or None: tagged (a speculative route), shorter than a
        key block, published already, tier off. `keys` may be longer than the anchor."""
        if tag is not None or end < BLOCK or end > len(keys):
            return None
        job = self._job(link_id, domain, keys.digest(end), b"", 0, end,
                        keys.token_bytes(0, end))
        if job is None:
            return None
        return msgspec.structs.replace(job, kind=self.kind.value)

    def withdraw_all(self) -> int:
        """Remove from the directory every anchor this replica published and still holds
        (the RAM end anchors were cleared: the cluster write-behind calls this), waiting for
        the directory's answer, so that nothing cleared is located once the clear returns (the
        drops reach the worker, which withdraws them too, only with the next step). Returns
        how many."""
        n = self._withdraw(list(self._published))
        self._published.clear()
        self._published_ids.clear()
        return n

    def withdraw_tenant(self, tag: bytes) -> int:
        """`withdraw_all` for one tenant's anchors (domains ending with `tag`): the RAM end
        anchors of that tenant were cleared; the other tenants' stay published. Waits for the
        directory's answer like withdraw_all. Returns how many."""
        ours = in_tenant(tag)
        mine = [k for k in self._published if ours(k[0])]
        for k in mine:
            self._published_ids.pop(self._published.pop(k), None)
        return self._withdraw(mine)

    def _withdraw(self, published: list[tuple[bytes, bytes]]) -> int:
        """Remove these (domain, digest) anchors from the directory, waiting for its answer;
        how many (0 when the directory is unreachable: nothing can be located there either)."""
        locators = [self._locator(domain, digest) for domain, digest in published]
        if not locators:
            return 0
        try:
            self.transport.forget_anchors(locators, owner=self.owner or "")
        except ClusterError:
            return 0
        return len(locators)
