"""ClusterTier: cold-exact links committed on another replica (tier `cluster`, kind `tree`).

Scheduler side, metadata and decisions only. Replicas of one model publish their committed RAM
tree links into a cluster-wide *directory* keyed by *locators*: keyed digests (the cluster
secret's `LinkKey.name`, core/auth.py) of (engine fingerprint, domain, digest), so the
directory and anyone who reads it learn nothing about whose prefix an entry holds, and nobody
without the secret can compute where a link would be. Each entry names the owner replica and
an opaque handle to the payload (on Ray: an object in Ray's object store). The payload is a
link file's bytes (core/linkformat/linkfile.py): self-contained, with the fingerprint, domain,
digests, the link's own token ids, a CRC-32 per part and MACs keyed by the cluster secret over
the header and every part, so a payload forged by anyone without the secret (valid CRCs and
all) is refused as `unauthenticated` before it is staged. The transport
(directory + payload movement) is injected (`ClusterTransport`), so this module imports neither
vLLM nor Ray; vllm_hybridcache/cluster/ provides the Ray one.

How a remote hit is served (docs/cluster.md):
- `lookup` never blocks. The first lookup of a prefix starts a `locate` in the directory and
  answers `pending` (the scheduler asks again next step); once located, the chain's payloads
  are fetched (again pending); once fetched, each payload is staged as a link file in a local
  folder, its header checked (MAC, format, fingerprint, CRC, domain, digests, rows) and its
  token ids compared with the prompt's. Only then does the lookup answer a hit, whose plan
  names the staged files as `sources`: the worker reads them into its RAM store with every
  part's CRC and MAC checked (core/linkformat/reader.stage_chain) and restores them like a RAM hit.
- Like the disk tier it is `slow`: served only when strictly deeper than RAM's hit.
- A lost owner, a lost object, a timeout, a foreign fingerprint, a damaged or unauthenticated
  payload, a token mismatch, a full local budget: the lookup answers a miss (the request
  prefills cold) and the failure is counted by its `ClusterMiss` reason; located entries
  that failed are removed from the directory.
- Staged bytes count against `budget_bytes` until the restore ends; a successful restore is
  promoted into the RAM tree (`promote`), whose budget then holds it.

End anchors move too (`ClusterAnchors`, tier `cluster`, kind `anchor`): a replica publishes
the end anchors it captures (a link file of kind `anchor` holding the whole prefix [0, n)), and
another replica whose prompt extends one's tokens fetches and verifies it the same way, then
resumes from it as from a RAM end anchor: session-exact (nothing the resumed request captures
is shared), never across domains, only deeper than what this replica holds.

Publication: the cluster tier's write-behind (core/tiers/cluster_behind.py) asks `capture_job`
for every RAM tree link a step captures, and the worker's cluster handler publishes it right
after the capture, in that step (`publish_job`, at the commit, then finds it published; it
publishes what was not, e.g. a link captured before the tier saw it). The handler turns the
job into a payload with `link_payload` and hands it to the transport.
Transfer costs (fetches, bytes, fetch and locate seconds) are in `ClusterStats`.

Single-threaded: the scheduler thread only.

Why one module over ~500 lines: `ClusterTier` is one state machine per prefix (locate, fetch,
stage, verify, serve, withdraw) whose stages share its bookkeeping; the end anchors' variant
is core/tiers/cluster_anchors.py, the write-behind core/tiers/cluster_behind.py.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import msgspec
import numpy as np

from ..auth import LinkKey
from ..keys import BLOCK, Hasher, PromptKeys, blake2b_128, in_tenant
from ..layout import StateLayout
from ..linkformat.job import WriteJob
from ..linkformat.linkfile import LinkFileError, LinkFileProblem, read_header, write_link_file
from ..linkformat.shard import Shard
from ..stats import SECONDS_BOUNDS, CacheStats, Histogram, MissReason, SkipReason, StatsRecorder
from .base import (
    CacheTier,
    Fits,
    IdSource,
    LinkKind,
    LinkRef,
    LookupResult,
    Reservation,
    RestorePlan,
    Tier,
    Tokens,
)

__all__ = ["ClusterError", "ClusterMiss", "ClusterStats", "ClusterTarget",
           "ClusterTier", "ClusterTransport", "Pending", "RemoteEntry", "anchor_block",
           "block_locator", "link_payload", "locator", "refusal_reason"]

# promote(keys, domain, chain) -> ids the RAM tree adopted (SnapshotTree.adopt)
Promote = Callable[[PromptKeys, bytes, Sequence[LinkRef]], list[int]]
# baseline(keys, domain, limit) -> tokens this engine's RAM serves for the prompt already
Baseline = Callable[[PromptKeys, bytes, int], int]

OPS_MAX = 512      # prefixes with a remote lookup in flight or answered (oldest forgotten)
OFFERED_MAX = 256  # ids handed out by lookups and not yet restored
NONE_TTL_S = 1.0   # how long "nothing in the directory" is believed before asking again
FAILED_TTL_S = 5.0  # how long a failed prefix is not asked again


class ClusterMiss(StrEnum):
    """Why a remote lookup served nothing (each counted; the request prefills cold)."""

    OWNER_LOST = "owner_lost"      # the replica that published the payload is gone
    OBJECT_LOST = "object_lost"    # the payload is gone from the object store
    TIMEOUT = "timeout"            # the directory or the fetch did not answer in time
    FOREIGN = "foreign"            # a payload of another engine fingerprint
    CORRUPT = "corrupt"            # not a link, another format, a bad checksum, cut short
    # a payload whose MAC fails (forged, or another cluster secret), or a directory that
    # refuses this replica's calls (another secret)
    UNAUTHENTICATED = "unauthenticated"
    VERIFY_FAILED = "verify_failed"  # the payload does not hold what the directory said
    BUDGET = "budget"              # staging it would exceed the local budget
    UNREACHABLE = "unreachable"    # the transport failed otherwise (directory down, ...)


class ClusterError(Exception):
    """A transport failure, with the reason it is counted under."""

    def __init__(self, reason: ClusterMiss, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason


_REFUSALS = {LinkFileProblem.FOREIGN: ClusterMiss.FOREIGN,
             LinkFileProblem.UNAUTHENTICATED: ClusterMiss.UNAUTHENTICATED,
             LinkFileProblem.MISMATCH: ClusterMiss.VERIFY_FAILED}


# failures that are the listed entries' own (a bad or lost payload): they leave the directory.
# Local ones (a full budget or staging folder, a slow answer, an unreachable directory) leave
# other replicas' entries alone.
_PAYLOAD_FAULTS = frozenset({ClusterMiss.FOREIGN, ClusterMiss.CORRUPT,
                             ClusterMiss.UNAUTHENTICATED, ClusterMiss.VERIFY_FAILED,
                             ClusterMiss.OWNER_LOST, ClusterMiss.OBJECT_LOST})


def refusal_reason(problem: LinkFileProblem | str) -> ClusterMiss:
    """The miss reason of a payload refused as a link file for `problem` (its header here, a
    part in the worker): a MAC that fails is `unauthenticated`, another engine's `foreign`,
    the rest (not a link, another format, a bad checksum, cut short, a symlink) `corrupt`."""
    try:
        return _REFUSALS.get(LinkFileProblem(problem), ClusterMiss.CORRUPT)
    except ValueError:
        return ClusterMiss.CORRUPT


class RemoteEntry(NamedTuple):
    """One directory entry: a link held by replica `owner`; `handle` fetches its payload.
    `locator`/`parent_locator`: the keyed digests it and its parent are listed under
    (`locator`; b"" for a root)."""

    locator: bytes
    parent_locator: bytes
    start: int
    end: int
    nbytes: int
    owner: str
    handle: Any


class Pending(Protocol):
    """An answer on its way. `result` raises ClusterError; only called once `done`."""

    def done(self) -> bool: ...

    def result(self) -> Any: ...


class ClusterTransport(Protocol):
    """The directory and the payload movement (vllm_hybridcache/cluster/ on Ray)."""

    def locate(self, locators: Sequence[bytes]) -> Pending:
        """Entries for those of `locators` the directory holds (result: list[RemoteEntry])."""

    def fetch(self, entries: Sequence[RemoteEntry]) -> Pending:
        """The payloads of `entries`, in order (result: list[bytes])."""

    def forget(self, locators: Sequence[bytes]) -> None:
        """Remove entries that failed (fire and forget)."""

    def locate_anchors(self, blocks: Sequence[bytes], limit: int) -> Pending:
        """End anchors of at most `limit` tokens listed under one of the block locators
        `blocks` (`block_locator` at `anchor_block`; result: list[RemoteEntry], each a root
        [0, end))."""

    def forget_anchors(self, locators: Sequence[bytes], owner: str | None = None) -> None:
        """Remove end-anchor entries (fire and forget). With `owner`: only that replica's
        entries, and wait for the directory's answer (a clear: what it cleared is no longer
        located once it returns)."""


def anchor_block(end: int) -> int:
    """Where an end anchor is indexed in the directory: the last key block boundary at or
    before its end. A lookup does not know an anchor's length, but the digests at a prompt's
    block boundaries are cheap (the key chain, core/keys.py), so it sends those and gets back
    only anchors on its own prefix up to the last block; the anchor's own digest at its end is
    then checked, and its token ids compared after the fetch. Anchors shorter than one block
    are not published."""
    return end // BLOCK * BLOCK


def locator(key: LinkKey, fingerprint: bytes, domain: bytes, digest: bytes,
            shard: str = "") -> bytes:
    """Where a link of (fingerprint, domain, digest) is listed in the directory: a keyed
    digest, so the directory holds no fingerprint, domain or prompt digest, and only holders
    of the cluster secret can compute (or enumerate by guessing) a prefix's entries. At
    tensor parallel size N each rank's payload of the link is listed on its own, under its
    `shard` tag ("r/N", core/linkformat/shard.py)."""
    fields = (b"locator", fingerprint, domain, digest) + ((shard.encode(),) if shard else ())
    return bytes.fromhex(key.name(*fields))


def block_locator(key: LinkKey, fingerprint: bytes, domain: bytes, block_digest: bytes) -> bytes:
    """Where end anchors whose prefix has `block_digest` at their `anchor_block` are indexed."""
    return bytes.fromhex(key.name(b"anchor-block", fingerprint, domain, block_digest))


class ClusterStats(CacheStats, kw_only=True):
    """The cluster tier's stats: a CacheStats plus what remote payloads cost to bring here, so
    the transfer can be weighed against the prefill it saved (docs/cluster.md). Times are as
    the scheduler sees them: it polls a pending answer once per step, so on a busy replica
    they include up to one step of waiting after the bytes arrived."""

    fetches: int = 0      # chains fetched, staged and verified (payloads ready)
    fetch_bytes: int = 0  # their payload bytes
    # fetch issued -> every payload of the chain on this node, staged and verified
    fetch_seconds: Histogram = msgspec.field(
        default_factory=lambda: Histogram.empty(SECONDS_BOUNDS))
    # locate issued -> the directory's answer (every located prefix, found or not)
    locate_seconds: Histogram = msgspec.field(
        default_factory=lambda: Histogram.empty(SECONDS_BOUNDS))


class ClusterTarget(msgspec.Struct, frozen=True):
    """What a worker needs to publish links (sent with every step plan while the tier is on):
    the Ray address, this engine's fingerprint (every payload carries it), the replica's name
    in the directory, and the cluster secret's file (the worker reads the secret itself: it
    never travels in a plan)."""

    address: str
    fingerprint: bytes
    owner: str
    secret_file: str
    key_id: str = ""  # the secret the scheduler side read: a worker refuses another
    # the engine's tensor parallel size: each rank publishes its own shard of every link
    shards: int = 1


class _Stage(StrEnum):
    LOCATE = "locate"
    FETCH = "fetch"
    READY = "ready"
    NONE = "none"
    FAILED = "failed"


@dataclass
class _Op:
    """The remote lookup of one prefix (domain, deepest cut), advanced by every lookup."""

    stage: _Stage
    started: float
    pending: Pending | None = None
    fetch_started: float = 0.0
    chain: list[RemoteEntry] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    nbytes: int = 0
    reason: ClusterMiss | None = None
    # at tensor parallel size N: for ranks 1..N-1, that rank's entries of the chain's links
    # (aligned with `chain`, which is rank 0's) and its staged files (aligned with `paths`,
    # the files the plan names: rank 0's; each worker reads its rank's of the same name)
    shards: list[list[RemoteEntry]] = field(default_factory=list)
    shard_paths: list[Path] = field(default_factory=list)
    active: int = 0      # restores begun from its files and not ended
    retired: bool = False  # no longer offered; files deleted when `active` drops to 0

    def locators(self) -> list[bytes]:
        """Where every rank's entries of the chain are listed."""
        return [e.locator for rank in (self.chain, *self.shards) for e in rank]


def link_payload(job: WriteJob, fingerprint: bytes, parts: dict[str, Any], tmp_dir: Path,
                 key: LinkKey, shard: str = "") -> bytes:
    """A committed link's payload: exactly a link file's bytes (the disk tier's format),
    authenticated with the cluster secret's `key`, built through a temporary file in `tmp_dir`
    (a RAM-backed folder is best) by the one writer the disk tier uses, so both tiers share one
    format and one set of checks. `shard`: the tensor parallel rank's tag whose shard of the
    link `parts` are (its header carries it, authenticated)."""
    path = Path(tmp_dir) / f"pub-{os.getpid()}-{uuid.uuid4().hex}.link"
    try:
        write_link_file(path, key=key, fingerprint=fingerprint, domain=job.domain,
                        digest=job.digest,
                        parent_digest=job.parent_digest, start=job.start, end=job.end,
                        tokens=np.frombuffer(job.tokens, dtype=np.int64), rows=job.rows,
                        parts=parts, created=time.time(), kind=job.kind, shard=shard)
        return path.read_bytes()
    finally:
        path.unlink(missing_ok=True)


class ClusterTier(CacheTier):
    """Scheduler-side cluster tier (see the module docstring and docs/cluster.md).

    fingerprint: this engine's fingerprint (adapter/fingerprint.py); only links of the same
    fingerprint are located, and a payload of another is refused.
    stage_dir: a local folder (RAM-backed is best) where fetched payloads wait for the worker.
    budget_bytes: staged bytes held at once; a fetch that would exceed it is a `budget` miss.
    timeout_s: a locate or fetch not answered within it is a `timeout` miss.
    key: the cluster secret's LinkKey (payload MACs, locators)
    owner: this replica's name in the directory (its own entries are never fetched).
    baseline: tokens RAM serves for a prompt here; a remote chain no deeper is not fetched.
    shards: the engine's tensor parallel size N. Each rank publishes its own shard of a link
    (`locator` with its shard tag); a link is served only when every rank's payload of it is
    listed, fetched and verified (its header carrying that rank's tag), each staged in the
    rank's folder (`Shard.folder`) under one name, so each worker reads its own rank's file
    (core/linkformat/reader.py `SourceOrigin.for_rank`). A rank's payload missing serves a
    shallower chain or none; one that fails a check fails the whole lookup.
    """

    tier = Tier.CLUSTER
    kind = LinkKind.TREE
    cold_exact = True
    slow = True

    def __init__(self, layout: StateLayout, fingerprint: bytes, transport: ClusterTransport,
                 cuts: Callable[[np.ndarray], list[int]], stage_dir: Path,
                 budget_bytes: int, timeout_s: float,
                 next_id: Callable[[], int] | None = None, hasher: Hasher | None = None,
                 promote: Promote | None = None,
                 clock: Callable[[], float] = time.monotonic, owner: str | None = None,
                 baseline: Baseline | None = None, *, key: LinkKey, shards: int = 1) -> None:
        self.layout = layout
        self.shards = int(shards)
        self.fingerprint = fingerprint
        self.key = key
        self.transport = transport
        self._cuts = cuts
        self.stage_dir = Path(stage_dir)
        self.stage_dir.mkdir(parents=True, exist_ok=True)
        for r in range(self.shards if self.shards > 1 else 0):
            (self.stage_dir / Shard(r, self.shards).folder).mkdir(exist_ok=True)
        self.budget_bytes = int(budget_bytes)
        self.timeout_s = float(timeout_s)
        self._next_id = next_id if next_id is not None else IdSource()
        self._hasher: Hasher = hasher if hasher is not None else blake2b_128
        self._promote = promote
        self.owner = owner
        self._baseline = baseline
        self._clock = clock
        self._ops: OrderedDict[tuple[bytes, int, bytes], _Op] = OrderedDict()
        # id -> (its op, the prompt's keys, domain) for ids a lookup handed out; plan ids ->
        # the same for active restores
        self._offered: OrderedDict[int, tuple[_Op, PromptKeys, bytes]] = OrderedDict()
        self._active: dict[tuple[int, ...], tuple[_Op, PromptKeys, bytes]] = {}
        # plan ids of restores that failed -> their chain's locators, for `invalidate`: the
        # adapter ends a failed restore before it hands over the links the worker refused
        self._failed: OrderedDict[tuple[int, ...], list[bytes]] = OrderedDict()
        self._dropped: list[int] = []
        # (domain, digest) -> id of the link published under it; and back
        self._published: OrderedDict[tuple[bytes, bytes], int] = OrderedDict()
        self._published_ids: dict[int, tuple[bytes, bytes]] = {}
        self._rec = StatsRecorder()
        self.remote_bytes = 0     # payload bytes fetched
        self.remote_seconds = 0.0  # locate + fetch time of fetched chains
        self.published = 0
        self._fetch_seconds = Histogram.empty(SECONDS_BOUNDS)
        self._locate_seconds = Histogram.empty(SECONDS_BOUNDS)
        self._fetches = 0
        self._fetch_bytes = 0
        self._peers: list[ClusterTier] = []  # tiers sharing the staging budget

    # ------------------------------------------------------------------ queries
    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def keys(self, tokens: Sequence[int] | np.ndarray) -> PromptKeys:
        return PromptKeys(tokens, self._hasher)

    def _as_keys(self, tokens: Tokens) -> PromptKeys:
        if isinstance(tokens, PromptKeys) and tokens.hasher is self._hasher:
            return tokens
        raw = tokens.tokens if isinstance(tokens, PromptKeys) else tokens
        return PromptKeys(raw, self._hasher)

    def _result(self, hit: bool, tokens: int, plan: RestorePlan | None, reason: str | None,
                n: int, lim: int, pending: bool = False) -> LookupResult:
        return LookupResult(hit, tokens, plan, reason, n, lim, tier=self.tier.value,
                            kind=self.kind.value, pending=pending)

    def lookup(self, tokens: Tokens, domain: bytes, limit: int | None = None,
               fits: Fits | None = None) -> LookupResult:
        """A hit once the prefix's chain is fetched and verified; `pending` while the locate or
        the fetch is in flight (deepest cut as its depth, so it wins only over shallower
        hits); else a miss. Never waits on the transport; no stats, pins or recency."""
        keys = self._as_keys(tokens)
        n = len(keys)
        lim = n if limit is None else max(0, min(int(limit), n))
        cuts = self._positions(keys, domain, lim) if fits is None and self.enabled else []
        if not cuts:
            return self._result(False, 0, None, MissReason.NO_PREFIX.value, n, lim)
        top = self._depth(cuts, lim)
        key = (domain, top, keys.digest(top))
        now = self._clock()
        self._expire(now)
        op = self._ops.get(key)
        if op is None:
            op = self._start(key, keys, cuts, now, lim)
        else:
            self._ops.move_to_end(key)
        self._advance(key, op, keys, now, lim)
        if op.stage in (_Stage.LOCATE, _Stage.FETCH):
            return self._result(True, top, None, None, n, lim, pending=True)
        if op.stage is not _Stage.READY:
            reason = op.reason.value if op.reason is not None else MissReason.NO_PREFIX.value
            return self._result(False, 0, None, reason, n, lim)
        refs = []
        for e in op.chain:
            lid = self._next_id()
            self._offered[lid] = (op, keys, domain)
            refs.append(LinkRef(lid, e.start, e.end))
        while len(self._offered) > OFFERED_MAX:
            self._offered.popitem(last=False)
        parts = {s.name: s.nbytes for s in self.layout.sections}
        for v in self.layout.views:
            parts[v.name] = v.bytes_per_row * sum(
                self.layout.view_rows(r.start, r.end) for r in refs)
        plan = RestorePlan(tuple(refs), refs[-1].end, parts, sum(parts.values()))
        return self._result(True, plan.tokens, plan, None, n, lim)

    # ------------------------------------------------------------------ the remote lookup
    def _positions(self, keys: PromptKeys, domain: bytes, lim: int) -> list[int]:
        """Where a remote link may end on this prompt (ascending): the cuts up to `lim`."""
        return sorted(c for c in self._cuts(keys.tokens) if 0 < c <= lim)

    def _depth(self, positions: list[int], lim: int) -> int:
        """The depth a pending lookup claims (the deepest a hit could be)."""
        return positions[-1]

    def _locate(self, domain: bytes, keys: PromptKeys, positions: list[int],
                lim: int) -> Pending:
        return self.transport.locate([self._locator(domain, keys.digest(c), r)
                                      for c in positions for r in range(self.shards)])

    def _locator(self, domain: bytes, digest: bytes, rank: int = 0) -> bytes:
        return locator(self.key, self.fingerprint, domain, digest,
                       Shard(rank, self.shards).tag)

    def _forget(self, locators: list[bytes]) -> None:
        self.transport.forget(locators)

    def _start(self, key: tuple[bytes, int, bytes], keys: PromptKeys, cuts: list[int],
               now: float, lim: int) -> _Op:
        domain = key[0]
        try:
            pending = self._locate(domain, keys, cuts, lim)
            op = _Op(_Stage.LOCATE, now, pending)
        except ClusterError as e:
            op = _Op(_Stage.FAILED, now, reason=e.reason)
            self._count_failure(e.reason)
        self._ops[key] = op
        while len(self._ops) > OPS_MAX:
            old_key, old = next(iter(self._ops.items()))
            if old.active:
                break
            del self._ops[old_key]
            self._retire(old)
        return op

    def _advance(self, key: tuple[bytes, int, bytes], op: _Op, keys: PromptKeys,
                 now: float, limit: int) -> None:
        """Move the op on as far as its answers allow (never waits). A located chain is
        fetched only when it is deeper than what RAM serves here already, and never from this
        replica's own entries (links it published are in its RAM, or withdrawn): a slow tier
        that is not deeper is never served, so its bytes would move for nothing."""
        domain = key[0]
        try:
            if op.stage is _Stage.LOCATE:
                if not op.pending.done():
                    self._check_timeout(op, now)
                    return
                self._locate_seconds.observe(max(0.0, now - op.started))
                entries = [e for e in op.pending.result()
                           if self.owner is None or e.owner != self.owner]
                chain, shards = self._every_rank(self._chain(entries, keys, domain), entries,
                                                 keys, domain)
                if chain and self._baseline is not None \
                        and chain[-1].end <= self._baseline(keys, domain, limit):
                    chain = []
                if not chain:
                    op.stage, op.pending, op.started = _Stage.NONE, None, now
                    return
                every = chain + [e for rank in shards for e in rank]
                nbytes = sum(e.nbytes for e in every)
                if self._budget_used() + nbytes > self.budget_bytes:
                    raise ClusterError(ClusterMiss.BUDGET, f"{nbytes} bytes to stage")
                op.chain, op.shards, op.nbytes = chain, shards, nbytes
                op.pending, op.stage = self.transport.fetch(every), _Stage.FETCH
                op.fetch_started = self._clock()
            if op.stage is _Stage.FETCH:
                if not op.pending.done():
                    self._check_timeout(op, now)
                    return
                payloads = op.pending.result()
                op.pending = None
                self._stage(op, payloads, keys, domain)
                op.stage = _Stage.READY
                nbytes = sum(len(p) for p in payloads)
                self.remote_bytes += nbytes
                self.remote_seconds += max(0.0, now - op.started)
                self._fetches += 1
                self._fetch_bytes += nbytes
                self._fetch_seconds.observe(max(0.0, self._clock() - op.fetch_started))
                op.started = now
        except ClusterError as e:
            self._fail(op, e.reason, domain, now)

    def _check_timeout(self, op: _Op, now: float) -> None:
        if now - op.started > self.timeout_s:
            raise ClusterError(ClusterMiss.TIMEOUT, f"no answer in {self.timeout_s} s")

    def _chain(self, entries: Sequence[RemoteEntry], keys: PromptKeys,
               domain: bytes) -> list[RemoteEntry]:
        """The deepest chain root -> deepest whose links all sit on this prompt's cuts (by
        locator: a hint checked against the payload's own tokens before anything is served)."""
        by_locator = {e.locator: e for e in entries}
        for e in sorted(entries, key=lambda e: e.end, reverse=True):
            if e.end > len(keys) or e.locator != self._locator(domain, keys.digest(e.end)):
                continue
            chain = [e]
            while chain[-1].start > 0:
                parent = by_locator.get(chain[-1].parent_locator)
                if parent is None or parent.end != chain[-1].start:
                    break
                chain.append(parent)
            if chain[-1].start == 0:
                return chain[::-1]
        return []

    def _every_rank(self, chain: list[RemoteEntry], entries: Sequence[RemoteEntry],
                    keys: PromptKeys, domain: bytes
                    ) -> tuple[list[RemoteEntry], list[list[RemoteEntry]]]:
        """`chain` (rank 0's entries) cut before its first link that some rank has not
        listed, and each other rank's entries of the links kept (at one rank: `chain`)."""
        if self.shards == 1:
            return chain, []
        by_locator = {e.locator: e for e in entries}
        shards: list[list[RemoteEntry]] = [[] for _ in range(1, self.shards)]
        for i, e in enumerate(chain):
            found = [by_locator.get(self._locator(domain, keys.digest(e.end), r))
                     for r in range(1, self.shards)]
            if any(f is None or (f.start, f.end) != (e.start, e.end) for f in found):
                chain = chain[:i]
                break
            for rank, f in zip(shards, found, strict=True):
                rank.append(f)
        return chain, [rank[:len(chain)] for rank in shards]

    def _stage(self, op: _Op, payloads: Sequence[bytes], keys: PromptKeys,
               domain: bytes) -> None:
        """Write each payload as a link file and verify its header and tokens (parts are
        verified by the worker as it reads them): rank 0's, then each other rank's, every
        rank's file of a link under one name in its rank's folder. ClusterError on the first
        problem."""
        if len(payloads) != len(op.chain) * self.shards:
            raise ClusterError(ClusterMiss.VERIFY_FAILED, "payload count")
        names = [f"{uuid.uuid4().hex}-{e.end}.link" for e in op.chain]
        ranks = [op.chain, *op.shards]
        for rank, entries in enumerate(ranks):
            shard = Shard(rank, self.shards)
            done = len(op.chain) * rank
            for name, e, data in zip(names, entries, payloads[done:done + len(op.chain)],
                                     strict=True):
                path = self.stage_dir / shard.folder / name
                (op.paths if rank == 0 else op.shard_paths).append(path)
                self._stage_one(path, e, data, keys, domain, shard.tag)

    def _stage_one(self, path: Path, e: RemoteEntry, data: bytes, keys: PromptKeys,
                   domain: bytes, shard: str) -> None:
        """One payload as a link file at `path`, its header and tokens verified."""
        toks = keys.tokens
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            try:
                header, _ = read_header(path, self.fingerprint, self.key, self.stage_dir,
                                        shard=shard)
            except LinkFileError as err:
                raise ClusterError(refusal_reason(err.problem), str(err)) from err
            if (header.kind != self.kind.value or header.tag is not None
                    or header.domain != domain
                    or header.digest != keys.digest(e.end)
                    or header.parent_digest != (keys.digest(e.start) if e.start else b"")
                    or (header.start, header.end) != (e.start, e.end)
                    or header.rows != self.layout.view_rows(e.start, e.end)
                    or not np.array_equal(header.token_ids(), toks[e.start:e.end])):
                raise ClusterError(ClusterMiss.VERIFY_FAILED,
                                   f"payload of [{e.start}, {e.end}) from {e.owner}")
        except OSError as err:
            raise ClusterError(ClusterMiss.UNREACHABLE, f"staging: {err}") from err

    def _fail(self, op: _Op, reason: ClusterMiss, domain: bytes, now: float) -> None:
        op.stage, op.reason, op.pending, op.started = _Stage.FAILED, reason, None, now
        self._delete_files(op)
        self._count_failure(reason)
        if op.chain and reason in _PAYLOAD_FAULTS:
            try:
                self._forget(op.locators())
            except ClusterError:
                pass  # the directory is unreachable: it learns at the next failure

    def _count_failure(self, reason: ClusterMiss) -> None:
        misses = self._rec.s.misses
        misses[reason.value] = misses.get(reason.value, 0) + 1

    def note_refused(self, problem: str, n: int = 1) -> None:
        """Count staged files the worker refused as it read their parts (a part's checksum or
        MAC): the restore failed and `invalidate` drops the chain's entries."""
        for _ in range(n):
            self._count_failure(refusal_reason(problem))

    def _expire(self, now: float) -> None:
        """Forget answers that are too old to trust (none found, failed, ready but unused)."""
        for key, op in list(self._ops.items()):
            ttl = {_Stage.NONE: NONE_TTL_S, _Stage.FAILED: FAILED_TTL_S,
                   _Stage.READY: self.timeout_s}.get(op.stage)
            if ttl is not None and now - op.started > ttl and not op.active:
                del self._ops[key]
                self._retire(op)

    def _retire(self, op: _Op) -> None:
        """No longer offered; its files go once no restore reads them."""
        op.retired = True
        if not op.active:
            self._delete_files(op)

    def _delete_files(self, op: _Op) -> None:
        for p in op.paths + op.shard_paths:
            p.unlink(missing_ok=True)
        op.paths, op.shard_paths = [], []

    def _budget_used(self) -> int:
        """Staged bytes of this tier and of the tiers sharing its budget (tree and anchors:
        one budget for what this replica holds of other replicas)."""
        return self._staged_bytes() + sum(p._staged_bytes() for p in self._peers)

    def _staged_bytes(self) -> int:
        ops = {id(op): op for op in self._ops.values()}
        ops.update((id(op), op) for op, _, _ in self._active.values())
        return sum(op.nbytes for op in ops.values() if op.paths)

    # ------------------------------------------------------------------ restores
    def record_lookup(self, res: LookupResult) -> None:
        chain = len(res.plan.chain) if res.hit and res.plan is not None else 0
        self._rec.lookup(prompt_tokens=res.prompt_tokens, hit_tokens=res.tokens,
                         chain_links=chain, miss_reason=res.miss_reason,
                         choice=res.choice if chain else None)

    def begin_restore(self, res: LookupResult) -> bool:
        if not res.hit or res.plan is None:
            self.record_lookup(res)
            return False
        offered = [self._offered.pop(r.link_id, None) for r in res.plan.chain]
        op = offered[0][0] if offered[0] is not None else None
        if (op is None or op.retired or op.stage is not _Stage.READY
                or any(o is None or o[0] is not op for o in offered)
                or not op.paths or not all(p.exists() for p in op.paths + op.shard_paths)):
            self.record_lookup(msgspec.structs.replace(
                res, hit=False, tokens=0, plan=None, miss_reason=MissReason.EVICTED.value))
            return False
        op.active += 1
        first = offered[0]
        self._active[res.plan.link_ids] = (op, first[1], first[2])
        self.record_lookup(res)
        return True

    def sources(self, plan: RestorePlan) -> tuple[str, ...]:
        return tuple(str(p) for p in self._active[plan.link_ids][0].paths)

    def end_restore(self, plan: RestorePlan, ok: bool, seconds: float = 0.0) -> None:
        op, keys, domain = self._active.pop(plan.link_ids)  # KeyError: not active
        s = self._rec.s
        if ok:
            s.restores += 1
            s.tokens_served += plan.tokens
            s.restore_bytes += plan.total_bytes
            s.restore_seconds.observe(seconds)
        else:
            s.restores_failed += 1
            self._failed[plan.link_ids] = op.locators()
            while len(self._failed) > OFFERED_MAX:
                self._failed.popitem(last=False)
        kept = set(self._promote(keys, domain, plan.chain)) if ok and self._promote else set()
        self._dropped.extend(i for i in plan.link_ids if i not in kept)
        op.active -= 1
        # served once: later requests on this prefix find it in RAM (promoted)
        for key, o in list(self._ops.items()):
            if o is op:
                del self._ops[key]
        self._retire(op)

    # ------------------------------------------------------------------ publication
    def reserve(self, tokens: Tokens, p: int, domain: bytes, tag: Any = None,
                cold_rows: int = 0) -> Reservation:
        """Never used by the facade (new links are captured in RAM first); refused."""
        self._rec.skip(SkipReason.DISABLED.value)
        return Reservation(None, None, 0, p, SkipReason.DISABLED.value, tier=self.tier.value,
                           kind=self.kind.value)

    def commit(self, link_id: int, seconds: float = 0.0) -> bool:
        return False

    def abort(self, link_id: int) -> int:
        return 0

    def publish_job(self, record: Any) -> WriteJob | None:
        """The publication of a committed RAM tree link (a LinkRecord), or None: links of the
        MTP route (tagged: a payload does not carry the draft-row tag) and links this engine
        already published (among them every link `capture_job` published at its capture)."""
        if record.tag is not None:
            return None
        return self._job(record.link_id, record.domain, record.digest, record.parent_digest,
                         record.start, record.end, record.tokens)

    def capture_job(self, link_id: int, keys: PromptKeys, domain: bytes, start: int, end: int,
                    tag: Any = None) -> WriteJob | None:
        """The publication of a RAM tree link reserved in this step, for the worker to publish
        right after it captured the link (in the same step), or None (tagged, published
        already, tier off).

        Why at the capture and not at the commit: the scheduler learns of the commit from the
        step's report, after the step, so a job made then rides the *next* step's plan, and
        the links committed by a request's last step were published only after its response
        (or, in an engine that stops stepping when idle, at its next request). The worker
        publishes only links it captured and sealed: that capture is the confirmation the
        commit waits for. At TP > 1 every rank's worker publishes its own shard, and a link
        one rank failed to capture lacks that rank's entry, so no replica serves it (every
        rank's payload is needed). A link the scheduler aborts after all is dropped from the
        workers' stores, which withdraws it. A link starting past 0 has a parent link ending
        at its start (the tree reserves from the deepest link it holds), whose digest is the
        prompt's at `start`."""
        if tag is not None:
            return None
        return self._job(link_id, domain, keys.digest(end),
                         keys.digest(start) if start > 0 else b"", start, end,
                         keys.token_bytes(start, end))

    def _job(self, link_id: int, domain: bytes, digest: bytes, parent_digest: bytes,
             start: int, end: int, tokens: bytes) -> WriteJob | None:
        if not self.enabled:
            return None
        k = (domain, digest)
        if k in self._published:
            return None
        self._published[k] = link_id
        self._published_ids[link_id] = k
        while len(self._published) > 4 * OFFERED_MAX * 16:
            _, old = self._published.popitem(last=False)
            self._published_ids.pop(old, None)
        self.published += 1
        return WriteJob(link_id, domain, digest, parent_digest, start, end, tokens,
                        self.layout.view_rows(start, end))

    def unpublished(self, link_ids: Sequence[int]) -> None:
        """Links that left this engine (evicted, aborted, cleared): the worker withdraws them
        from the directory as it drops them, and a link captured again under the same key is
        published again."""
        for lid in link_ids:
            k = self._published_ids.pop(lid, None)
            if k is not None and self._published.get(k) == lid:
                del self._published[k]

    # ------------------------------------------------------------------ housekeeping
    def invalidate(self, link_ids: Sequence[int]) -> int:
        """The worker refused a staged file: the remote entries of that chain are dropped
        from the directory (a payload refused once is refused every time: left listed, every
        replica would fetch and stage it again for each request on its prefix). The chain is
        found among the active restores, or among the failed ones (the adapter ends the
        restore first)."""
        n = 0
        for lid in link_ids:
            locators = next((op.locators()
                             for ids, (op, _, _) in self._active.items() if lid in ids), None)
            if locators is None:
                ids = next((ids for ids in self._failed if lid in ids), None)
                locators = self._failed.pop(ids) if ids is not None else None
            if locators:
                try:
                    self._forget(locators)
                except ClusterError:
                    pass
                n += len(locators)
        self._rec.s.invalidated += n
        return n

    def evict(self, nbytes: int) -> int:
        freed = 0
        for key, op in list(self._ops.items()):
            if freed >= nbytes:
                break
            if op.paths and not op.active:
                freed += op.nbytes
                del self._ops[key]
                self._retire(op)
        return freed

    def clear(self) -> int:
        n = 0
        for key, op in list(self._ops.items()):
            if not op.active:
                n += len(op.paths)
                del self._ops[key]
                self._retire(op)
        self._offered.clear()
        self._rec.s.cleared += n
        return n

    def clear_tenant(self, tag: bytes) -> int:
        """Drop what this replica staged or is fetching for one tenant (domains ending with
        `tag`): no lookup is served from it again, and its files go now, or when the restore
        reading them ends. Returns the staged links dropped. This replica's own publications
        of the tenant leave the directory as the worker drops their RAM links (tree links:
        with the next step's drops; end anchors also at once, `ClusterAnchors.withdraw_tenant`)."""
        ours = in_tenant(tag)
        n = 0
        for key, op in list(self._ops.items()):
            if ours(key[0]):
                n += len(op.paths)
                del self._ops[key]
                self._retire(op)  # an active op keeps its files until its restore ends
        for lid in [i for i, o in self._offered.items() if ours(o[2])]:
            del self._offered[lid]
        self._rec.s.cleared += n
        return n

    def drain_dropped(self) -> list[int]:
        self._expire(self._clock())
        out, self._dropped = self._dropped, []
        return out

    def close(self) -> None:
        """Delete every staged file (engine shutdown)."""
        for op in self._ops.values():
            self._delete_files(op)
        self._ops.clear()

    # ------------------------------------------------------------------ stats
    def stats(self) -> ClusterStats:
        base = self._rec.snapshot()
        snap = ClusterStats(**{f: getattr(base, f) for f in base.__struct_fields__},
                            fetches=self._fetches, fetch_bytes=self._fetch_bytes,
                            fetch_seconds=self._fetch_seconds.copy(),
                            locate_seconds=self._locate_seconds.copy())
        snap.captures = self.published
        snap.links = len(self)
        snap.links_pinned = sum(len(ids) for ids in self._active)
        snap.bytes_held = self.bytes_held
        snap.budget_bytes = self.budget_bytes
        return snap

    def sanity_check(self) -> None:
        active = [i for ids in self._active for i in ids]
        assert len(active) == len(set(active)), "an id in two active restores"
        assert not set(active) & set(self._offered), "an active id still offered"
        counts: dict[int, int] = {}
        for op, _, _ in self._active.values():
            counts[id(op)] = counts.get(id(op), 0) + 1
        for op, _, _ in self._active.values():
            assert op.active == counts[id(op)], "an op's active count is off"
        for op in self._ops.values():
            assert op.stage is _Stage.READY or not (op.paths or op.shard_paths), (
                "files kept by an op not ready")
            assert not op.paths or len(op.shard_paths) == len(op.paths) * (self.shards - 1), (
                "a link staged for some ranks only")

    def link_ids(self) -> list[int]:
        return [i for ids in self._active for i in ids]

    def __len__(self) -> int:
        """Links staged locally (fetched, waiting for or in a restore)."""
        return sum(len(op.paths) for op in self._ops.values())

    @property
    def bytes_held(self) -> int:
        return self._staged_bytes()
