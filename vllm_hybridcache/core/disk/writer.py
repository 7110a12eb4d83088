"""LinkWriter: the disk tier's background writer (worker side, one thread, one LinkDirectory).

Why a thread: a link file is tens of MiB and an fsync; the model runner must never wait for
one. The worker hands the writer the typed tensors of a committed RAM link (no copy: the bytes
are already in host memory, captured once out of the KV blocks) and goes on; the writer thread
writes them into a link file. Until the writer is done with a link, its buffers must stay
alive and unchanged: the worker defers the store's drop of every id for which `busy(id)` is
true and drops it once `take_done()` returns it (a pinned store reuses freed slab ranges at
once, so an early drop would let new bytes be written under an old link's checksum).

Bounded: at most `max_queue` writes wait. When the writer falls behind, `submit` refuses the
write and counts it (`dropped`): a later prompt recomputes that link, no request ever waits.
Deletions and clears that the scheduler decided travel through the same ordered queue (never
dropped), so the thread's `LinkDirectory` is the only index that changes files (see
directory.py: one thread owns an instance).

Session spill (docs/disk-tier.md): `drain` is the shutdown path. It puts the spilled end
anchors at the head of the queue (regardless of the bound: they are the last chance of their
conversations), then stops the thread after the queue, within a time limit: a write that would
start past the limit is skipped (`shutdown`), so the limit bounds how long a stop waits. What
was written and what was dropped is returned for the log.

Stats are cumulative (`snapshot()`): files and bytes held, writes and their bytes and seconds,
skips by reason, writes dropped, evictions and expiries, read failures recorded by the worker,
clears (whole and per tenant) carried out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from ..auth import key_from_file
from ..linkformat.job import TREE, WriteJob
from ..linkformat.shard import Shard, relocate
from ..stats import SECONDS_BOUNDS, Histogram
from .directory import LinkDirectory

__all__ = ["QUEUE_MAX", "DiskTarget", "DrainReport", "LinkWriter", "WriteJob"]

logger = logging.getLogger("vllm_hybridcache")

QUEUE_MAX = 32  # writes waiting; at 38 MiB per link about 1.2 GiB of host RAM kept alive


class DiskTarget(msgspec.Struct, frozen=True):
    """Where and under which limits the worker writes (sent by the scheduler side)."""

    root: str
    fingerprint: bytes
    budget_bytes: int
    min_free_bytes: int
    ttl_s: float
    # the disk key's file (core/auth.py): the worker reads the key itself, so the secret never
    # travels in a plan
    key_file: str
    key_id: str = ""  # the key the scheduler side read: the writer refuses another
    spill: bool = False  # session spill: end anchors are written at shutdown and eviction
    drain_s: float = 10.0  # time limit of the shutdown drain
    direct_reads: bool = True  # a disk hit reads with direct I/O (core/linkformat/inplace.py)
    # workers that each hold a shard of every link (TP): each writes its own rank's files
    # (core/linkformat/shard.py); `budget_bytes` is each rank's share
    shards: int = 1


class DrainReport(msgspec.Struct, frozen=True):
    """What a shutdown drain did (logged by the worker)."""

    anchors: int          # end anchors handed to the drain
    anchors_written: int  # of them, on disk when the drain ended (written now or before)
    anchor_bytes: int
    skipped: int          # writes of any kind not started: the time limit passed
    seconds: float
    finished: bool        # the thread ended within the limit (else a write was cut short:
                          # it leaves only a temporary file, swept at a later start)


class LinkWriter:
    """One background thread writing link files; see the module docstring."""

    def __init__(self, target: DiskTarget, max_queue: int = QUEUE_MAX,
                 directory: Callable[[DiskTarget], LinkDirectory] | None = None,
                 rank: int = 0) -> None:
        self.target = target
        self.max_queue = max_queue
        self.shard = Shard(rank, target.shards)  # whose files of each link this one writes
        self._make_dir = directory or (lambda t: _open_directory(t, self.shard))
        self._cv = threading.Condition()
        # ("write", job, parts) | ("forget", [paths]) | ("clear",) | ("clear_tenant", tag,
        # kind) | ("stop",), in order
        self._items: deque[tuple[Any, ...]] = deque()
        self._writes_waiting = 0  # write items in _items (what max_queue bounds)
        self._busy: set[int] = set()  # ids whose buffers the thread may still read
        self._working = False  # the thread is running an item it took off the queue
        self._done: list[int] = []  # ids no longer busy, not yet taken by the worker
        self._stats: dict[str, Any] = {"dropped": 0, "files": 0, "bytes": 0, "writes": 0,
                                       "write_bytes": 0, "skips": {}, "evictions": 0,
                                       "expired": 0, "read_failures": {}, "error": "",
                                       "clears": 0}
        self._hist = Histogram.empty(SECONDS_BOUNDS)
        self._deadline: float | None = None  # monotonic; writes starting later are skipped
        self._version = 0  # bumped on every stats change: the worker reports only news
        self._thread = threading.Thread(target=self._run, name="hybridcache-disk-writer",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    def submit(self, job: WriteJob, parts: Mapping[str, torch.Tensor]) -> bool:
        """Queue one write; False (counted as dropped) when `max_queue` writes already wait.
        The caller must keep the tensors' memory alive and unchanged while `busy(job.link_id)`.
        """
        with self._cv:
            if self._writes_waiting >= self.max_queue:
                self._stats["dropped"] += 1
                self._version += 1
                return False
            self._busy.add(job.link_id)
            self._writes_waiting += 1
            self._items.append(("write", job, dict(parts)))
            self._cv.notify()
        return True

    def forget(self, paths: list[str]) -> None:
        """Delete files (and their longer links) found damaged by another process."""
        self._put(("forget", list(paths)))

    def clear(self) -> None:
        """Delete every file of this fingerprint, after the writes queued before."""
        self._put(("clear",))

    def clear_tenant(self, tag: bytes, kind: str) -> None:
        """Delete the files of `kind` of one tenant (domains ending with `tag`), after the
        writes queued before: a write of that tenant already queued when the scheduler
        cleared it lands first and is deleted here, so nothing cleared comes back."""
        self._put(("clear_tenant", bytes(tag), kind))

    def note_read_failure(self, problem: str) -> None:
        """Count a file the worker refused while reading it (checksum, truncated, ...)."""
        with self._cv:
            fails = self._stats["read_failures"]
            fails[problem] = fails.get(problem, 0) + 1
            self._version += 1

    def _put(self, item: tuple[Any, ...]) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def busy(self, link_id: int) -> bool:
        with self._cv:
            return link_id in self._busy

    def take_done(self) -> list[int]:
        """Ids the thread has finished with since the last call (their drops may proceed)."""
        with self._cv:
            out, self._done = self._done, []
            return out

    def idle(self) -> bool:
        """Whether nothing is queued or running (every write handed over so far is on disk or
        skipped, every deletion done): what a clear that must not race a write waits for."""
        with self._cv:
            return not self._items and not self._working

    @property
    def version(self) -> int:
        with self._cv:
            return self._version

    def snapshot(self) -> dict[str, Any]:
        """Cumulative stats as builtins (plain data for the step report)."""
        with self._cv:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}
            out["write_seconds"] = msgspec.to_builtins(self._hist.copy())
            out["queued"] = self._writes_waiting
            return out

    def close(self, timeout: float = 30.0) -> bool:
        """Finish the queued work (up to `timeout` seconds); True when the thread ended."""
        self._put(("stop",))
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def drain(self, anchors: list[tuple[WriteJob, Mapping[str, torch.Tensor]]],
              timeout: float) -> DrainReport:
        """Shutdown: write `anchors` first (most valuable first, as given), then what was
        queued, and stop; no write starts after `timeout` seconds. The caller keeps the
        tensors alive until this returns."""
        t0 = time.monotonic()
        with self._cv:
            skipped_before = self._stats["skips"].get("shutdown", 0)
            self._deadline = t0 + timeout
            for job, parts in reversed(anchors):
                self._busy.add(job.link_id)
                self._writes_waiting += 1
                self._items.appendleft(("write", job, dict(parts)))
            self._cv.notify()
        finished = self.close(max(0.0, timeout - (time.monotonic() - t0)) + 1.0)
        sizes = [_size(_target_path(self.target, j, self.shard)) for j, _ in anchors]
        with self._cv:
            skipped = self._stats["skips"].get("shutdown", 0) - skipped_before
        return DrainReport(len(anchors), sum(1 for n in sizes if n is not None),
                           sum(n for n in sizes if n is not None), skipped,
                           time.monotonic() - t0, finished)

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        directory: LinkDirectory | None = None
        try:
            directory = self._make_dir(self.target)
        except Exception as e:  # the scheduler side opened it already: this is rare
            logger.warning("hybridcache: disk writer cannot open %s (%s); writes are skipped",
                           self.target.root, e)
            with self._cv:
                self._stats["error"] = f"{type(e).__name__}: {e}"
        self._publish(directory)
        while True:
            with self._cv:
                while not self._items:
                    self._cv.wait()
                item = self._items.popleft()
                self._working = item[0] != "stop"
                if item[0] == "write":
                    self._writes_waiting -= 1
            op = item[0]
            if op == "stop":
                break
            try:
                if op == "write" and self._past_deadline():
                    self._skip("shutdown")
                elif op == "write":
                    self._write(directory, item[1], item[2])
                elif directory is not None and op == "forget":  # named by rank 0's paths
                    directory.delete([relocate(p, self.shard.rank, self.shard.world)
                                      for p in item[1]])
                elif directory is not None and op == "clear":
                    directory.clear(TREE)  # anchor files: deleted one by one (`forget`)
                elif directory is not None and op == "clear_tenant":
                    directory.clear_tenant(item[1], item[2])
                if op in ("clear", "clear_tenant"):  # done (or nothing to clear): reported
                    with self._cv:
                        self._stats["clears"] += 1
            except Exception as e:  # never let one bad write end the thread
                logger.warning("hybridcache: disk writer: %s failed: %s", op, e, exc_info=True)
                if op == "write":
                    self._skip("writer_error")
            finally:
                with self._cv:
                    if op == "write":
                        self._busy.discard(item[1].link_id)
                        self._done.append(item[1].link_id)
                    self._working = False
                self._publish(directory)
        if directory is not None:
            directory.close()

    def _write(self, directory: LinkDirectory | None, job: WriteJob,
               parts: dict[str, torch.Tensor]) -> None:
        if directory is None:
            self._skip("no_directory")
            return
        nbytes = sum(t.numel() * t.element_size() for t in parts.values())
        before = directory.stats.writes
        t0 = time.perf_counter()
        directory.write(domain=job.domain, digest=job.digest, parent_digest=job.parent_digest,
                        start=job.start, end=job.end,
                        tokens=np.frombuffer(job.tokens, dtype=np.int64), rows=job.rows,
                        parts=parts, nbytes=nbytes, kind=job.kind, tag=job.tag)
        if directory.stats.writes > before:
            with self._cv:
                self._hist.observe(time.perf_counter() - t0)

    def _past_deadline(self) -> bool:
        with self._cv:
            return self._deadline is not None and time.monotonic() > self._deadline

    def _skip(self, reason: str) -> None:
        with self._cv:
            skips = self._stats["skips"]
            skips[reason] = skips.get(reason, 0) + 1
            self._version += 1

    def _publish(self, directory: LinkDirectory | None) -> None:
        if directory is None:
            return
        st = directory.stats
        with self._cv:
            s = self._stats
            s["files"], s["bytes"] = st.files, st.bytes
            s["writes"], s["write_bytes"] = st.writes, st.write_bytes
            s["evictions"], s["expired"] = st.evictions, st.expired
            skips = dict(st.writes_skipped)
            for reason, n in s["skips"].items():  # the thread's own reasons stay counted
                if reason not in st.writes_skipped:
                    skips[reason] = n
            s["skips"] = skips
            self._version += 1


def _size(path: Path) -> int | None:
    try:
        return path.lstat().st_size
    except FileNotFoundError:
        return None


def _target_path(target: DiskTarget, job: WriteJob, shard: Shard | None = None) -> Path:
    """Where `job`'s file lands (LinkDirectory's naming, without opening the directory)."""
    d = LinkDirectory(Path(target.root), target.fingerprint, target.budget_bytes,
                      key=key_from_file(target.key_file, "disk", expect_id=target.key_id),
                      shard=shard)
    return d.path_for(job.domain, job.end, job.digest, job.kind)


def _open_directory(target: DiskTarget, shard: Shard | None = None) -> LinkDirectory:
    d = LinkDirectory(Path(target.root), target.fingerprint, target.budget_bytes,
                      target.min_free_bytes, target.ttl_s,
                      key=key_from_file(target.key_file, "disk", expect_id=target.key_id),
                      key_file=Path(target.key_file), shard=shard)
    d.open()
    return d
