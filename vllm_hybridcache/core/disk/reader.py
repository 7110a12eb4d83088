"""Staging a disk hit: link files read into the worker's RAM store, verified, then restored.

Why through the store: a restore from RAM is the path every exactness test covers, so a disk
hit is made into one. The worker reads each file of the chain into freshly allocated store
buffers under the ids the disk tier handed out (core/tiers/disk.py), checks every part's CRC-32
as it reads, seals them, and restores with `LinkStore.restore` as for a RAM hit. Nothing is
restored unless every file of the chain passed. By default each part is read with one
`readinto` straight into its store buffer and a CRC pass (linkfile.read_parts); with the
`disk_direct_reads` setting, with direct I/O through page-aligned bounce buffers, each chunk
copied into its store buffer and checksummed there while it is still in the CPU's cache
(direct.py: no page-cache copy), falling back to the buffered read where the file system
refuses direct I/O. Both check the same things; the buffered read measured faster on the
benchmark host (docs/benchmarks/disk.md). The buffers get a huge-page hint first
(hugepages.py: fresh pages fault in 512 times fewer).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..store import LinkStore, MissingLinkError
from ..tiers.base import LinkRef
from .direct import DirectIOUnsupported, read_parts_direct
from .hugepages import advise_huge_pages
from .linkfile import LinkFileError, LinkFileHeader, LinkFileProblem, read_header, read_parts

__all__ = ["DiskReadError", "read_verified", "stage_chain"]


class DiskReadError(MissingLinkError):
    """A file of the chain was refused; `link_id` names its link, `problem` says why (a
    LinkFileProblem value, `gone` for a file deleted meanwhile, `io_error`)."""

    def __init__(self, link_id: int, problem: str, detail: str) -> None:
        super().__init__(link_id, f"disk link {link_id} refused ({problem}): {detail}")
        self.problem = problem


def read_verified(path: Path, header: LinkFileHeader, base: int,
                  parts: dict[str, torch.Tensor], direct: bool = False) -> int:
    """Every part of the file into `parts`, each CRC-32 checked: with direct I/O when `direct`
    and the file system takes it, else buffered. Returns the bytes read; LinkFileError (the
    destinations then hold partial bytes) or OSError otherwise."""
    if direct:
        try:
            return read_parts_direct(path, header, base, parts)
        except DirectIOUnsupported:
            pass  # nothing was verified: the buffered read starts over
    return read_parts(path, header, base, parts)


def stage_chain(store: LinkStore, chain: Sequence[LinkRef], sources: Sequence[str],
                fingerprint: bytes, direct: bool = False) -> int:
    """Read `sources[i]` into the store as link `chain[i].link_id`, verified; returns the bytes
    read. On any problem every link staged by this call is dropped and DiskReadError raised.
    `direct`: with direct I/O where the file system takes it (setting `disk_direct_reads`)."""
    if len(chain) != len(sources):
        raise ValueError(f"{len(chain)} links but {len(sources)} files")
    layout = store.layout
    staged: list[int] = []
    n = 0
    for ref, src in zip(chain, sources, strict=True):
        path = Path(src)
        try:
            header, base = read_header(path, fingerprint)
            if (header.start, header.end) != (ref.start, ref.end):
                raise LinkFileError(LinkFileProblem.MISMATCH,
                                    f"{path}: holds [{header.start}, {header.end}), the plan "
                                    f"wants [{ref.start}, {ref.end})")
            bufs = store.allocate(ref.link_id, layout.view_rows(ref.start, ref.end))
            staged.append(ref.link_id)
            parts = {**bufs.sections, **bufs.views}
            advise_huge_pages(parts.values())  # fresh buffers: fewer page faults (a hint)
            n += read_verified(path, header, base, parts, direct)
            store.seal(ref.link_id)
        except (LinkFileError, OSError) as e:
            store.drop(staged)
            problem = (e.problem.value if isinstance(e, LinkFileError)
                       else "gone" if isinstance(e, FileNotFoundError) else "io_error")
            raise DiskReadError(ref.link_id, problem, str(e)) from e
        except BaseException:
            store.drop(staged)  # nothing half staged stays behind, whatever went wrong
            raise
    return n
