"""Opening the disk tier on the scheduler side: folder, key, fingerprint, directory, policy.

Registered as the disk tier's opener (adapter/tier_registry.py). A disk tier that was asked
for and cannot work stops the start-up rather than serving on without it: a restart would
then silently lose every link (docs/disk-tier.md). An engine whose checkpoint cannot be named
by content (`FingerprintUnavailable`) is the exception: its folder is fine, but no file in it
may be read or written by an engine that does not know what it computes, so it serves on with
RAM only and says so (`tiers_off["disk"]`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from vllm_hybridcache.adapter.draft_tags import DraftStep, NextToken, RebuiltAnchor
from vllm_hybridcache.core import DiskTier
from vllm_hybridcache.core.auth import KeyFileError, key_from_file
from vllm_hybridcache.core.disk import LinkDirectory
from vllm_hybridcache.core.disk.admission import WriteAdmission
from vllm_hybridcache.core.disk.cost import ReadCost
from vllm_hybridcache.core.disk.folder import own_folder
from vllm_hybridcache.core.disk.sharded import ShardedDirectory
from vllm_hybridcache.core.disk.writer import DiskTarget
from vllm_hybridcache.core.identity import FingerprintUnavailable
from vllm_hybridcache.core.linkformat.reader import SourceOrigin
from vllm_hybridcache.core.linkformat.shard import Shard
from vllm_hybridcache.core.linkformat.tags import TagCodec
from vllm_hybridcache.core.store import DEFAULT_POOL_BYTES as POOL_BYTES
from vllm_hybridcache.core.tiers.disk_anchors import DiskAnchors
from vllm_hybridcache.core.tiers.disk_behind import DiskBehind

__all__ = ["WEIGHTS_MEMO", "open_disk"]

logger = logging.getLogger("vllm_hybridcache")

WEIGHTS_MEMO = ".weights-digests.json"  # under disk_dir: weight digests by file stamp


def open_disk(ctx) -> DiskBehind | None:
    """The disk tier on `disk_dir` (None when unset, or without a fingerprint), with its end
    anchors when session spill is on; a start-up error says why a folder cannot be used."""
    settings = ctx.settings
    if not settings.disk_dir:
        return None
    ctx.refuse_parallel("the disk tier (disk_dir)", "VLLM_HYBRIDCACHE_DISK_DIR / disk_dir",
                        tensor_parallel=True)
    # TP > 1: each rank writes and reads its own shard of every link (core/disk/sharded.py),
    # under each rank's share of the budget
    world = int(ctx.vllm_config.parallel_config.tensor_parallel_size)
    budget = settings.disk_budget_bytes // world
    # session spill: end anchors on disk (on the MTP route too: an anchor file carries its
    # draft tag, and the disk anchor tier applies the RAM one's `fits`)
    spill = bool(settings.session_spill and ctx.anchors_on)
    root = Path(settings.disk_dir).expanduser()
    key_file = settings.disk_key_path()
    try:
        root = own_folder(root, key_file)  # 0700 when created; refused when others write it
        key = key_from_file(key_file, "disk", create=True)
        try:  # the weights memo lives in the folder: authenticated with the disk key
            fp = ctx.fingerprint(memo_file=root / WEIGHTS_MEMO, memo_key=key)
        except FingerprintUnavailable as e:
            logger.warning("hybridcache: disk tier off: this engine has no fingerprint "
                           "(%s); links on disk are only shared by engines known to compute "
                           "the same bytes. Serving with the RAM tiers only.", e.reason)
            ctx.tiers_off["disk"] = e.reason
            return None
        shards = [LinkDirectory(root, fp.digest, budget, settings.disk_min_free_bytes,
                                float(settings.disk_ttl_s), key=key, key_file=key_file,
                                shard=Shard(rank, world)) for rank in range(world)]
        directory = shards[0] if world == 1 else ShardedDirectory(shards)
        directory.open()
        directory.probe_writable()
    except (OSError, KeyFileError) as e:
        raise RuntimeError(
            f"hybridcache: disk_dir {str(root)!r} is not usable ({type(e).__name__}: {e}); "
            "give a folder of your own (or unset VLLM_HYBRIDCACHE_DISK_DIR / disk_dir)"
        ) from e
    target = DiskTarget(str(root), fp.digest, budget,
                        settings.disk_min_free_bytes, float(settings.disk_ttl_s),
                        key_file=str(key_file), key_id=key.key_id, spill=spill,
                        drain_s=float(settings.spill_timeout_s),
                        direct_reads=settings.disk_direct_reads, shards=world)
    origin = SourceOrigin(fp.digest, str(key_file), "disk", str(root), key.key_id,
                          shards=world)
    if spill:
        _warn_short_shutdown(ctx.vllm_config, settings.spill_timeout_s)
    st = directory.stats
    logger.info("hybridcache: disk tier on %s (fingerprint %s%s): %d files, %d bytes; swept "
                "%d foreign folders (%d kept: in use), %d temporaries, %d damaged files",
                directory.dir, fp.hex[:16],
                f", {world} tensor-parallel ranks: one file per rank" if world > 1 else "",
                st.files, st.bytes, st.swept_dirs,
                st.kept_foreign_dirs, st.swept_temporaries, sum(st.refused.values()))
    seg = ctx.segmentation
    disk = DiskTier(ctx.layout, directory, lambda toks: seg.cuts(toks.tolist()), next_id=ctx.ids,
                    promote=ctx.tree.adopt,
                    admission=WriteAdmission(settings.disk_write_first_tokens),
                    cost=ReadCost(), baseline=ctx.ram_depth,
                    tags=TagCodec({"DraftStep": DraftStep}))  # MTP: tags in files
    anchors = None
    if spill:
        anchors = DiskAnchors(disk, tags=TagCodec(
            {"NextToken": NextToken, "RebuiltAnchor": RebuiltAnchor}))  # MTP: in files
    return DiskBehind(disk, target, origin, anchors=anchors,
                      warm=directory.warm_spans(POOL_BYTES))


def _warn_short_shutdown(vllm_config, limit: int) -> None:
    """Session spill drains in vLLM's worker shutdown (the connector's shutdown hook): vLLM
    kills the engine `--shutdown-timeout` seconds after SIGTERM (at once with its default 0)
    and a worker `VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS` after asking it to exit. Say so at
    start when either leaves the drain less than its limit."""
    import vllm.envs as envs

    grace = int(getattr(vllm_config, "shutdown_timeout", 0) or 0)
    worker = int(envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS)
    if grace <= limit or worker <= limit:
        logger.warning("hybridcache: session spill needs vLLM's graceful shutdown: start with "
                       "--shutdown-timeout (now %d s) and VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS "
                       "(now %d s) above spill_timeout_s (%d s), or the end anchors of live "
                       "conversations may be lost at a stop", grace, worker, limit)
