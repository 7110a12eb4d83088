"""The composition root: settings -> the cache facade with every tier it is asked for.

Builds the RAM tree and end anchors, opens each registered lower tier (adapter/
tier_registry.py) with one `OpenContext`, and orders the tiers for the facade: the RAM tree,
each lower tier's tree-side tiers, the RAM end anchors, each lower tier's anchor-side tiers.
What every opener needs and must agree on is computed here once: the engine's fingerprint
(lazily: only a tier that outlives the process asks for it) and the TP/PP guard.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_hybridcache.adapter.fingerprint import engine_fingerprint, kernel_backend
from vllm_hybridcache.adapter.tier_registry import registered, resolve
from vllm_hybridcache.config import CacheSettings
from vllm_hybridcache.core import (
    CacheTier,
    CostModel,
    EndAnchors,
    IdSource,
    PromptKeys,
    SnapshotCache,
    SnapshotTree,
    Tier,
)
from vllm_hybridcache.core.layout import StateLayout
from vllm_hybridcache.segmentation import STEP, Segmentation

__all__ = ["OpenContext", "build_cache"]


@dataclass
class OpenContext:
    """What a lower tier's opener gets: the engine, its layout and segmentation, the shared id
    source, the RAM tiers, and `tiers_off` to say why a tier asked for stays off."""

    vllm_config: Any
    settings: CacheSettings
    layout: StateLayout
    segmentation: Segmentation
    ids: IdSource
    tree: SnapshotTree
    ram_anchors: EndAnchors
    anchors_on: bool           # end anchors kept at all (session_anchors > 0)
    speculative: bool          # a draft model or MTP head proposes tokens
    tiers_off: dict[str, str]
    mode: str = STEP           # the engine's segmentation mode (adapter/segmentation_mode.py)
    cache: SnapshotCache | None = None  # set once built (for ram_depth)
    _fingerprint: Any = field(default=None, repr=False)

    def refuse_parallel(self, what: str, unset: str, tensor_parallel: bool = False) -> None:
        """A start-up error for a tier that holds whole links while each worker holds a
        shard of every one (TP or PP above 1); `tensor_parallel`: the tier keeps one part per
        tensor-parallel rank, so only PP above 1 is refused."""
        pc = self.vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1 or (pc.tensor_parallel_size > 1
                                             and not tensor_parallel):
            one = "one pipeline stage" if tensor_parallel else "one worker"
            raise RuntimeError(
                f"hybridcache: {what} works with {one} only for now "
                f"(tensor_parallel_size={pc.tensor_parallel_size}, pipeline_parallel_size="
                f"{pc.pipeline_parallel_size}): each worker holds a shard of every link. Unset "
                f"{unset} to run without it.")

    def fingerprint(self, memo_file=None, memo_key=None):
        """The engine's fingerprint (adapter/fingerprint.py), computed once for every tier;
        FingerprintUnavailable (raised again to each caller) when it cannot be."""
        if self._fingerprint is None:
            try:
                self._fingerprint = engine_fingerprint(
                    self.vllm_config,
                    hashlib.sha256(msgspec.json.encode(self.layout)).hexdigest(),
                    msgspec.json.encode(self.segmentation).decode(),
                    kernel_backend(self.vllm_config), memo_file=memo_file, memo_key=memo_key)
            except Exception as e:
                self._fingerprint = e
        if isinstance(self._fingerprint, Exception):
            raise self._fingerprint
        return self._fingerprint

    def ram_depth(self, keys: PromptKeys, domain: bytes, limit: int, fits=None) -> int:
        """Tokens the RAM tiers serve for a prompt (what a slower hit's cost check saves
        beyond), with the lookup's draft-row predicate (MTP)."""
        cache = self.cache
        assert cache is not None
        return max((cache.tier(t, k).lookup(keys, domain, limit, fits).tokens
                    for t, k in cache.routes() if t == Tier.RAM), default=0)


def build_cache(vllm_config, settings: CacheSettings, layout: StateLayout,
                segmentation: Segmentation, anchors: int, speculative: bool,
                lower_tiers: bool, tiers_off: dict[str, str], mode: str = STEP
                ) -> SnapshotCache:
    """The facade over every tier; `lower_tiers`: whether tiers below RAM may open at all
    (not while the cache is inactive); `mode`: the engine's segmentation mode, decided once
    by the scheduler side (where a remote link may end depends on it)."""
    ids = IdSource()  # one worker store holds every tier's payloads: ids unique
    # each tensor parallel rank's worker holds its own shard of every link and anchor: the
    # budgets bound the host bytes of all of them (as the disk tier's does)
    shards = int(vllm_config.parallel_config.tensor_parallel_size)
    tree = SnapshotTree(layout, settings.tree_config(shards), next_id=ids)
    ram_anchors = EndAnchors(layout, anchors, settings.session_budget_bytes, next_id=ids,
                             shards=shards)
    ctx = OpenContext(vllm_config, settings, layout, segmentation, ids, tree, ram_anchors,
                      bool(anchors), speculative, tiers_off, mode)
    lower = []
    if lower_tiers:
        for entry in registered():
            opened = resolve(entry.open)(ctx)
            if opened is not None:
                if opened.name != entry.name:
                    raise RuntimeError(f"the opener of tier {entry.name!r} returned a tier "
                                       f"named {opened.name!r}")
                lower.append(opened)
    tiers: list[CacheTier] = [tree]
    for lt in lower:
        tiers += lt.tiers()
    tiers.append(ram_anchors)
    for lt in lower:
        tiers += lt.anchor_tiers()
    # which hit serves a request: the least expected seconds to first token (bytes moved at
    # measured rates + prefill left; core/choice.py), rates fed by the scheduler side
    ctx.cache = SnapshotCache(tiers, cost=CostModel(), lower=lower)
    return ctx.cache
