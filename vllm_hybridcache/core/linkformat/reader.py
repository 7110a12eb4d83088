"""Staging a disk hit: link files read into the worker's RAM store, verified, then restored.

Why through the store: a restore from RAM is the path every exactness test covers, so a disk
hit is made into one. The worker reads each file of the chain into store buffers under the ids
the disk tier handed out (core/tiers/disk.py), checks every part's CRC-32 and MAC (keyed by
the tier's secret: the disk key, or the cluster secret for staged payloads), seals them, and
restores with `LinkStore.restore` as for a RAM hit. Nothing is restored unless every file of
the chain passed.

Each link is allocated page-aligned (`LinkStore.allocate(page_aligned=True)`: laid out as its
file lays out its payload, in a reused buffer from the store's pool), and the file is read with
one request straight into it (inplace.py), with direct I/O when the `disk_direct_reads` setting
asks for it and the file system takes it, then every part's CRC-32 and MAC checked there (on
helper threads, two files at a time). No copy follows: the restore reads those buffers, and
promotion keeps them as the RAM links. A file whose parts lie elsewhere than the store's layout
(another order) is read part by part instead: `readinto` per part (linkfile.read_parts) or,
with direct reads, through bounce buffers (direct.py). All paths check the same things. The
buffers get a huge-page hint first (hugepages.py: pages still to fault in take 2 MiB at a
time). A disk hit reads only the views of every link but the deepest (`defer_sections`): their
sections, the recurrent states the restore does not need, are read from the same file when a
promoted link is first needed whole (`LinkStore.defer`). A starting worker warms the pool for
the files found at start-up (`warm_read_buffers`), so a restart's first hits do not read into
fresh pages.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import NamedTuple

import msgspec
import torch

from ..auth import LinkKey, key_from_file
from ..store import LinkStore, MissingLinkError
from ..tiers.base import LinkRef
from .direct import DirectIOUnsupported, helper, read_parts_direct
from .hugepages import advise_huge_pages
from .inplace import fits_in_place, read_in_place, split_point
from .linkfile import LinkFileError, LinkFileHeader, LinkFileProblem, read_header, read_parts
from .shard import Shard, relocate

__all__ = ["LOCAL_PROBLEMS", "DiskReadError", "SourceKey", "SourceOrigin", "read_verified",
           "stage_chain", "warm_read_buffers"]


class SourceKey(NamedTuple):
    """What a staged file must hold: the link's kind, domain and digest (its end's)."""

    kind: str
    domain: bytes
    digest: bytes


class SourceOrigin(msgspec.Struct, frozen=True):
    """Where a load's files come from and how the worker verifies them (sent with the load):
    the fingerprint their headers must carry, the key file of the secret that authenticates
    them (read by the worker itself: the secret never travels in a plan) and its purpose
    ("disk" or "cluster", core/auth.py), and the folder they lie below (no symlink below it
    is followed)."""

    fingerprint: bytes
    key_file: str
    purpose: str
    root: str
    key_id: str = ""  # the key the scheduler side read (core/auth.py `key_from_file`)
    # workers that each hold a shard of every link (TP, core/linkformat/shard.py): the sources
    # name rank 0's files, each worker reads its own rank's, whose headers carry its rank's
    # shard tag
    shards: int = 1

    def key(self) -> LinkKey:
        return key_from_file(self.key_file, self.purpose, expect_id=self.key_id)

    def for_rank(self, rank: int, sources: Sequence[str]) -> tuple[list[str], str]:
        """(the files of `sources`' links rank `rank` reads, the shard tag their headers
        carry)."""
        if self.shards <= 1:
            return list(sources), ""
        return ([str(relocate(p, rank, self.shards)) for p in sources],
                Shard(rank, self.shards).tag)


# problems of a read that are this machine's own (the file deleted meanwhile, an I/O error),
# not the file's content: for a staged copy of a remote payload they say nothing about it
LOCAL_PROBLEMS = frozenset({"gone", "io_error"})


class DiskReadError(MissingLinkError):
    """A file of the chain was refused; `link_id` names its link, `problem` says why (a
    LinkFileProblem value, `gone` for a file deleted meanwhile, `io_error`)."""

    def __init__(self, link_id: int, problem: str, detail: str) -> None:
        super().__init__(link_id, f"disk link {link_id} refused ({problem}): {detail}")
        self.problem = problem


def read_verified(path: Path, header: LinkFileHeader, base: int,
                  parts: dict[str, torch.Tensor], direct: bool = False, *, key: LinkKey,
                  root: Path | None = None) -> int:
    """Every part of the file into `parts`, each CRC-32 and MAC checked: with direct I/O when
    `direct` and the file system takes it, else buffered. Returns the bytes read; LinkFileError
    (the destinations then hold partial bytes) or OSError otherwise."""
    if direct:
        try:
            return read_parts_direct(path, header, base, parts, key, root)
        except DirectIOUnsupported:
            pass  # nothing was verified: the buffered read starts over
    return read_parts(path, header, base, parts, key, root)


def stage_chain(store: LinkStore, chain: Sequence[LinkRef], sources: Sequence[str],
                fingerprint: bytes, direct: bool = False, defer_sections: bool = False, *,
                key: LinkKey, root: Path | None = None,
                expect: Sequence[SourceKey] | None = None, shard: str = "") -> int:
    """Read `sources[i]` into the store as link `chain[i].link_id`, verified (header and parts
    authenticated with `key`, the header of this rank's `shard`: shard.py); returns the bytes
    read. On any problem every link staged by this
    call is dropped and DiskReadError raised, charged to the first file of the chain found at
    fault. `root`: the folder the files lie below (the disk tier's, the cluster staging
    folder); no symlink below it is followed. `expect[i]`: the (kind, domain, digest) the
    scheduler's lookup found in `sources[i]`; a file holding another link now (renamed or
    swapped in since: names are not authenticated) is refused as `mismatch`.
    `direct`: with direct I/O where the file system takes it (setting `disk_direct_reads`).
    `defer_sections`: of every link but the deepest, read and check only the views now, and
    leave the sections (its recurrent state, which a restore of this chain does not read) to
    `LinkStore.defer`: read and checked from the same file when something first needs them.
    Only where the file is read in place and lays out its sections before its views.

    Files read in place are read and checked on the helper threads, two at a time, while this
    thread prepares the next (header, buffers): the device gets the next file's request while
    the CPU checks the last one's CRCs. A link is sealed only once its checks passed, and no
    buffer is dropped while a helper still writes or reads it."""
    if len(chain) != len(sources) or (expect is not None and len(expect) != len(sources)):
        raise ValueError(f"{len(chain)} links but {len(sources)} files")
    if chain and (chain[0].start != 0
                  or any(b.start != a.end for a, b in itertools.pairwise(chain))):
        raise ValueError(f"the chain {[(r.start, r.end) for r in chain]} is not contiguous "
                         "from 0")
    layout = store.layout
    staged: list[int] = []
    reads: list[tuple[LinkRef, Future[int]]] = []  # in-place reads in flight, in chain order
    n = 0
    at = chain[0] if chain else None  # the link a failure is charged to
    try:
        for ref, src in zip(chain, sources, strict=True):
            at, path = ref, Path(src)
            header, base = read_header(path, fingerprint, key, root, shard)
            want = expect[len(staged)] if expect is not None else None
            if want is not None and (header.kind, header.domain, header.digest) != want:
                raise LinkFileError(LinkFileProblem.MISMATCH,
                                    f"{path}: holds another link than the lookup found")
            if (header.start, header.end) != (ref.start, ref.end):
                raise LinkFileError(LinkFileProblem.MISMATCH,
                                    f"{path}: holds [{header.start}, {header.end}), the plan "
                                    f"wants [{ref.start}, {ref.end})")
            bufs = store.allocate(ref.link_id, layout.view_rows(ref.start, ref.end),
                                  page_aligned=True)
            staged.append(ref.link_id)
            parts = {**bufs.sections, **bufs.views}
            advise_huge_pages(parts.values())  # fresh buffers: fewer page faults (a hint)
            whole = store.payload(ref.link_id)
            later = None  # the parts deferred (the sections), when they are
            if (defer_sections and ref is not chain[-1] and bufs.views
                    and split_point(header, bufs.sections) is not None):
                later = tuple(bufs.sections)
            if fits_in_place(header, whole, parts):  # one read, no copy
                now = tuple(bufs.views) if later else None
                reads.append((ref, helper().submit(read_in_place, path, header, base, whole,
                                                   direct, now, key=key, root=root)))
                if later:
                    store.defer(ref.link_id, partial(read_in_place, path, header, base, whole,
                                                     direct, later, key=key, root=root))
            else:
                n += read_verified(path, header, base, parts, direct, key=key, root=root)
                store.seal(ref.link_id)
        for ref, read in reads:
            at = ref
            n += read.result()
            store.seal(ref.link_id)
    except (LinkFileError, OSError) as e:
        err: LinkFileError | OSError = e
        first = _settle(reads, at)
        if first is not None:  # an earlier file of the chain failed too: charge that one
            at, err = first
        store.drop(staged)
        problem = (err.problem.value if isinstance(err, LinkFileError)
                   else "gone" if isinstance(err, FileNotFoundError) else "io_error")
        assert at is not None
        raise DiskReadError(at.link_id, problem, str(err)) from err
    except BaseException:
        _settle(reads, at)
        store.drop(staged)  # nothing half staged stays behind, whatever went wrong
        raise
    return n


def warm_read_buffers(store: LinkStore, spans: Iterable[tuple[int, int]],
                      stop: threading.Event | None = None) -> int:
    """Warm the store's read buffers (its PagePool) for links staged from files holding the
    token spans `spans` ((start, end), the likeliest read first); returns the bytes warmed.
    Why, and the bound: `PagePool.prewarm`. For a thread of its own at a worker's start."""
    layout = store.layout
    return store.pool.prewarm(
        (store.staged_bytes(layout.view_rows(start, end)) for start, end in spans), stop)


def _settle(reads: list[tuple[LinkRef, Future[int]]], at: LinkRef | None
            ) -> tuple[LinkRef, LinkFileError | OSError] | None:
    """Wait until no helper writes or reads a staged buffer any more: only then may the
    buffers go back to the pool. Reads of files after `at` are cancelled where not started;
    those before it run to their end, so that the first file at fault is known: returns the
    first of them that failed with a file problem (and its error), if any."""
    first = None
    for ref, f in reads:
        if at is None or ref.start > at.start:
            f.cancel()
        try:
            f.result()
        except (LinkFileError, OSError) as e:
            if first is None and at is not None and ref.start < at.start:
                first = (ref, e)
        except BaseException:  # the chain fails either way
            pass
    return first
