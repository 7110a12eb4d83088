"""Cache core: keys, tiers, the cache facade, eviction, payload store, stats. Imports no vLLM.

Scheduler side: SnapshotCache (core/cache.py), a facade over CacheTier objects (core/tiers/:
the RAM SnapshotTree and the EndAnchors today), all metadata and decisions. Worker side:
LinkStore (payload bytes). They talk only through plain data (link addresses, row ranges) that
the adapter ships in vLLM's per-step metadata. See docs/cache-core.md.

API notes beyond the contract (additions only; nothing renamed or removed):
- lookup/reserve accept a PromptKeys (tree.keys(tokens)) instead of raw tokens, to hash a prompt
  once per request; lookup's limit defaults to len(tokens).
- Tiers: every lookup result, reservation and dropped id carries its (tier, kind); the facade
  routes by that pair. Link ids come from one IdSource shared by the tiers (unique, never
  reused); routing never reads their value. lookup takes `fits(p, tag)` and reserve a `tag`
  (the MTP route's draft-row tokens); a refused deeper link marks the result `shortened`.
- begin_restore returns bool: False when the chain changed since lookup (recorded as an
  `evicted` miss; prefill cold). end_restore raises KeyError for a plan that is not active.
- commit returns bool (False: unknown/dropped id); abort returns the number of links dropped.
- Reservation has existing_id (set on a dedup) and nbytes; LookupResult has prompt_tokens,
  limit and verify_collisions; RestorePlan has part_bytes, tokens, link_ids, deepest.
- SkipReason.DISABLED: reserve with budget 0.
- SnapshotTree.invalidate(ids) drops links the worker reported lost; evict(nbytes) and
  set_budget(bytes) shrink the tree on demand.
- LinkStore.restore/restore_views_into take non_blocking and return the bytes moved;
  LinkStore.buffers(id) re-opens an allocated link's tensors. LinkStore(layout, pin_memory,
  slab_bytes): pinned stores carve links out of power-of-two slabs (SlabArena) so torch's
  pinned allocator does not round each link up; bytes_reserved reports the host bytes held.
- StateLayout.view_block_tokens (default 1) and view_rows(start, end): block-granular views
  for paged caches whose in-block layout is backend-packed (added for the adapter); the store
  allocates layout.view_rows(start, end) rows per link and view_sink's start_row is then a
  block index (ref.start // view_block_tokens).
- Introspection for tests and the adapter: SnapshotTree.has, is_committed, parent_of,
  link_info, link_ids; eviction policies expose add/discard/accessed/victim.
- Disk tier: DiskTier (core/tiers/disk.py) over core/disk/ (link files, directory, writer
  thread, staging reader); CacheTier.slow and CacheTier.sources(plan); SnapshotTree.link_record
  (what a link file names) and SnapshotTree.adopt (a disk hit promoted into RAM).
- Hit choice (core/choice.py): SnapshotCache(tiers, cost=CostModel(...)) serves the hit with
  the least expected seconds to first token among every tier's (lookup's `moved(res)` says
  what a hit copies); LookupResult.choice and CacheStats.choices count why (ChoiceReason).
"""

from .cache import SnapshotCache
from .choice import COLD_EXACT_MARGIN, ChoiceReason, CostModel
from .config import GiB, TreeConfig
from .eviction import CostPolicy, EvictionPolicy, LRUPolicy, make_policy
from .keys import (
    BLOCK,
    Hasher,
    PromptKeys,
    blake2b_128,
    make_domain,
    tenant_of,
    tenant_tag,
)
from .layout import SectionSpec, StateLayout, ViewSpec
from .slabs import SlabArena
from .stats import CacheStats, Histogram, MissReason, SkipReason
from .store import LinkBuffers, LinkStore, MissingLinkError
from .tiers import (
    CacheTier,
    DiskTier,
    EndAnchors,
    Fits,
    IdSource,
    LinkAddr,
    LinkKind,
    LinkRecord,
    LinkRef,
    LookupResult,
    Reservation,
    RestorePlan,
    SnapshotTree,
    Tier,
)

__all__ = [
    "BLOCK",
    "COLD_EXACT_MARGIN",
    "CacheStats",
    "CacheTier",
    "ChoiceReason",
    "CostModel",
    "CostPolicy",
    "DiskTier",
    "EndAnchors",
    "EvictionPolicy",
    "Fits",
    "GiB",
    "Hasher",
    "Histogram",
    "IdSource",
    "LRUPolicy",
    "LinkAddr",
    "LinkBuffers",
    "LinkKind",
    "LinkRecord",
    "LinkRef",
    "LinkStore",
    "LookupResult",
    "MissReason",
    "MissingLinkError",
    "PromptKeys",
    "Reservation",
    "RestorePlan",
    "SectionSpec",
    "SkipReason",
    "SlabArena",
    "SnapshotCache",
    "SnapshotTree",
    "StateLayout",
    "Tier",
    "TreeConfig",
    "ViewSpec",
    "blake2b_128",
    "make_domain",
    "make_policy",
    "tenant_of",
    "tenant_tag",
]
