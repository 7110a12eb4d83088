"""Opening the cluster tier inside one engine (scheduler side) and publishing from its worker.

Kept here, beside the Ray transport: the adapter reaches `open_cluster` only through the tier
registry (adapter/tier_registry.py), so Ray is imported only when `cluster_address` is set.
This package sits below the adapter (it imports the core and the settings only): what it needs
to know about the engine, its fingerprint and its segmentation mode, comes in the opener's
context, computed once by the composition root (adapter/composition.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from vllm_hybridcache.config import setting_env
from vllm_hybridcache.core.auth import KeyFileError, key_from_file
from vllm_hybridcache.core.identity import FingerprintUnavailable
from vllm_hybridcache.core.keys import PromptKeys
from vllm_hybridcache.core.linkformat.job import ANCHOR, WriteJob
from vllm_hybridcache.core.linkformat.reader import SourceOrigin
from vllm_hybridcache.core.linkformat.shard import Shard
from vllm_hybridcache.core.tiers.cluster import (
    ClusterTarget,
    ClusterTier,
    anchor_block,
    block_locator,
    link_payload,
    locator,
)
from vllm_hybridcache.core.tiers.cluster_anchors import ClusterAnchors
from vllm_hybridcache.core.tiers.cluster_behind import ClusterBehind
from vllm_hybridcache.segmentation import FINE, FINE_ALIGN, STEP

from .directory import SKEW_S, DirectoryRefused
from .transport import RayTransport

logger = logging.getLogger("vllm_hybridcache")

SHM = Path("/dev/shm")


def _scratch(prefix: str) -> Path:
    """A private folder on a RAM-backed file system when there is one (staged payloads are
    read once, right away), removed at exit."""
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    atexit.register(shutil.rmtree, path, True)
    return path


def open_cluster_tier(vllm_config, layout, segmentation, settings, ids, tree, fingerprint,
                      tiers_off: dict[str, str] | None = None, mode: str = STEP
                      ) -> tuple[ClusterTier, ClusterTarget, SourceOrigin] | None:
    """The scheduler's cluster tier, the target its workers publish to and where its hits'
    files come from, or a start-up error naming why the cluster cannot be used (a tier asked
    for is never silently off): no cluster secret, a secret file that must not be used, an
    unreachable cluster, a directory that refuses the secret.

    None, with one warning logged, when this engine has no fingerprint (its checkpoint cannot
    be named by content, `FingerprintUnavailable`): other replicas' links are only safe between
    engines known to compute the same bytes, so the replica serves on without the cluster
    (the reason is also put in `tiers_off["cluster"]` when given). `fingerprint()`: the
    engine's, computed once for every tier (adapter/composition.py `OpenContext.fingerprint`),
    raising FingerprintUnavailable when there is none; `mode`: the engine's segmentation mode
    (where a remote link may end, `remote_cuts`)."""
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise RuntimeError(
            "hybridcache: the cluster tier (cluster_address) works with one pipeline stage "
            f"only for now (pipeline_parallel_size={pc.pipeline_parallel_size}). Unset "
            "VLLM_HYBRIDCACHE_CLUSTER_ADDRESS to run without it.")
    shards = int(pc.tensor_parallel_size)  # each rank publishes its own shard of a link
    if not settings.cluster_secret_file:
        raise RuntimeError(
            "hybridcache: the cluster tier (cluster_address) needs the cluster secret every "
            "replica shares: set VLLM_HYBRIDCACHE_CLUSTER_SECRET_FILE / cluster_secret_file to "
            "a file holding it (e.g. `openssl rand -hex 32 > secret; chmod 600 secret`; the "
            "local launcher makes one). Payloads are authenticated with it (docs/security.md)")
    secret_file = str(Path(settings.cluster_secret_file).expanduser())
    try:
        key = key_from_file(secret_file, "cluster")
    except (OSError, KeyFileError) as e:
        raise RuntimeError(f"hybridcache: cluster_secret_file {secret_file!r} is not usable "
                           f"({type(e).__name__}: {e})") from e
    try:
        fp = fingerprint()
    except FingerprintUnavailable as e:
        logger.warning("hybridcache: cluster tier off: this engine has no fingerprint (%s); "
                       "links are only shared between replicas known to compute the same "
                       "bytes. Serving without the cluster.", e.reason)
        if tiers_off is not None:
            tiers_off["cluster"] = e.reason
        return None
    transport = RayTransport(settings.cluster_address, key)
    try:
        transport.connect()
    except DirectoryRefused as e:
        raise RuntimeError(
            f"hybridcache: the cluster directory at {settings.cluster_address!r} refuses this "
            f"replica's calls ({e}): its secret ({secret_file}) is not the one the directory "
            "was created with (give every replica the same cluster_secret_file), or this "
            f"node's clock is more than {SKEW_S:.0f} s off the directory's (run NTP)") from e
    except Exception as e:
        raise RuntimeError(
            f"hybridcache: the Ray cluster at cluster_address {settings.cluster_address!r} is not "
            f"reachable ({type(e).__name__}: {e}); start one (`ray start --head`) or unset "
            f"{setting_env('cluster_address')}") from e
    owner = settings.cluster_replica or f"{socket.gethostname()}:{os.getpid()}"
    stage = _scratch("hybridcache-cluster-")
    tier = ClusterTier(layout, fp.digest, transport, remote_cuts(mode, segmentation),
                       stage, settings.cluster_budget_bytes,
                       float(settings.cluster_timeout_s), next_id=ids, promote=tree.adopt,
                       owner=owner,
                       baseline=lambda keys, domain, limit: tree.lookup(keys, domain,
                                                                        limit).tokens,
                       key=key, shards=shards)
    logger.info("hybridcache: cluster tier on %s as replica %s (fingerprint %s, secret %s)",
                settings.cluster_address, owner, fp.hex[:16], key.key_id)
    return (tier, ClusterTarget(settings.cluster_address, fp.digest, owner, secret_file,
                                key.key_id, shards),
            SourceOrigin(fp.digest, secret_file, "cluster", str(stage), key.key_id,
                         shards=shards))


def open_cluster_anchors(tier: ClusterTier, anchors) -> ClusterAnchors:
    """The cluster's end anchors beside `tier` (same transport, fingerprint, staging folder,
    budget and RAM tree baseline); a prompt with an end anchor of its own in RAM (`anchors`,
    the RAM anchor tier) does not ask the directory."""
    return ClusterAnchors(tier, local=lambda keys, domain, limit:
                          anchors.lookup(keys, domain, limit).tokens)


def open_cluster(ctx) -> ClusterBehind | None:
    """The cluster tier's opener (adapter/tier_registry.py): None without cluster_address;
    with its end anchors unless anchors are off, a draft proposes tokens (a payload does
    not carry an anchor's draft tag) or the engine is tensor parallel (an anchor is published
    as one payload; tree links move per rank)."""
    settings = ctx.settings
    if not settings.cluster_address:
        return None
    opened = open_cluster_tier(ctx.vllm_config, ctx.layout, ctx.segmentation, settings,
                               ctx.ids, ctx.tree, ctx.fingerprint, tiers_off=ctx.tiers_off,
                               mode=ctx.mode)
    if opened is None:
        return None
    tier, target, origin = opened
    if ctx.anchors_on and not ctx.speculative and tier.shards > 1:
        logger.info("hybridcache: cluster end anchors off at tensor parallel size %d (tree "
                    "links move between replicas, one payload per rank)", tier.shards)
    anchors = (open_cluster_anchors(tier, ctx.ram_anchors)
               if ctx.anchors_on and not ctx.speculative and tier.shards == 1 else None)
    return ClusterBehind(tier, target, origin, anchors=anchors)


def remote_cuts(mode: str, segmentation):
    """Where a remote link may end on a prompt (the positions a lookup asks the directory
    about): the segmentation's cuts, and in fine mode (`mode`, the engine's segmentation mode)
    every 64-aligned position too, since links are captured there inside a step (the prompt's
    last one, junctions) and are exact (docs/split-invariance.md)."""
    if mode != FINE:
        return lambda toks: segmentation.cuts(toks.tolist())

    def cuts(toks) -> list[int]:
        return sorted(set(segmentation.cuts(toks.tolist()))
                      .union(range(FINE_ALIGN, len(toks) + 1, FINE_ALIGN)))

    return cuts


class Publisher:
    """The worker's half: committed links into the object store, withdrawn when dropped.

    Runs on the model runner's thread; a payload is one link (tens of KiB to a few MiB), put
    synchronously into the local object store (Ray moves it only when another node fetches).
    A failed publication is logged and counted, never raised: serving goes on.
    """

    def __init__(self, target: ClusterTarget, rank: int = 0) -> None:
        """rank: this worker's tensor parallel rank, whose shard of every link it publishes
        (under its own locator, its payloads' headers carrying its shard tag)."""
        self.target = target
        self.shard = Shard(rank, target.shards).tag
        self.key = key_from_file(target.secret_file, "cluster", expect_id=target.key_id)
        self.transport = RayTransport(target.address, self.key, owner=target.owner)
        self._tmp = _scratch("hybridcache-publish-")
        # link id -> (kind, locator)
        self._published: dict[int, tuple[str, bytes]] = {}
        self.published = 0
        self.failed = 0

    def publish(self, job: WriteJob, parts: dict[str, Any]) -> None:
        try:
            fp = self.target.fingerprint
            payload = link_payload(job, fp, parts, self._tmp, self.key, shard=self.shard)
            loc = locator(self.key, fp, job.domain, job.digest, self.shard)
            if job.kind == ANCHOR:
                keys = PromptKeys(np.frombuffer(job.tokens, dtype=np.int64))
                block = block_locator(self.key, fp, job.domain,
                                      keys.digest(anchor_block(job.end)))
                self.transport.publish_anchor(loc, block, job.end, payload)
            else:
                parent = (locator(self.key, fp, job.domain, job.parent_digest, self.shard)
                          if job.start else b"")
                self.transport.publish(loc, parent, job.start, job.end, payload)
            self._published[job.link_id] = (job.kind, loc)
            self.published += 1
        except Exception as e:
            self.failed += 1
            logger.warning("hybridcache: link %d not published to the cluster: %s: %s",
                           job.link_id, type(e).__name__, e)

    def dropped(self, link_ids) -> None:
        """Links that left the worker's store: no longer offered to other replicas."""
        for lid in link_ids:
            k = self._published.pop(lid, None)
            if k is not None:
                kind, loc = k
                withdraw = (self.transport.withdraw_anchor if kind == ANCHOR
                            else self.transport.withdraw)
                try:
                    withdraw(loc)
                except Exception as e:
                    logger.warning("hybridcache: cluster withdraw failed: %s", e)

    def close(self) -> None:
        self.transport.close()
