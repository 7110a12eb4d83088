"""Disk tier bandwidth: link files written and read by the tier's code vs `dd` on the same folder.

What it measures, in one run on one folder (so the device and its load are the same):
- **write**: `LinkDirectory.write` of N links of the reference size (one link file each:
  header, parts with a CRC-32 each, fsync, rename, directory fsync), against
  `dd if=/dev/zero of=F bs=1M count=S oflag=direct conv=fsync` over the same bytes;
- **read**: `stage_chain` of those files into a RAM `LinkStore` (header, every part read into
  store buffers and its CRC-32 checked) with direct I/O (core/disk/direct.py: the tier's read)
  and, in alternating passes, with the buffered read it had before (`direct=False`:
  linkfile.read_parts), each against `dd if=F of=/dev/null iflag=direct` with 1 MiB and with
  4 MiB requests (the direct read's request size). Both read rates and the CPU seconds each
  spends per GiB (every thread of the process) are reported.
  The same reads with the reader's huge-page hint off (core/disk/hugepages.py), and into a
  store that carves links out of reused slabs (the worker's pinned store
  on a GPU host) show what fresh pages cost: an unpinned store (this CPU build) allocates each
  link anew. Before every read pass the files' pages are dropped from the page cache
  (`posix_fadvise(DONTNEED)` per file, which touches no other process's cache), so both read
  the device;
- the CPU side alone: the buffered staging from the page cache, and the CRC-32 rate of the tier
  (core/disk/crc.py: ISA-L's when installed) and of zlib, which bound the tier's read rate
  whatever the device; and the tier's read with zlib's CRC-32 (what it was before ISA-L's).

Usage: python -m benchmarks.run --micro disk --dir /path/on/the/disk [--links 16] [--mib 38]
(or python -m benchmarks.disk_bench ...)
Prints one JSON line; docs/benchmarks/disk.md records the results and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
import zlib
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from vllm_hybridcache.core import (
    LinkRef,
    LinkStore,
    PromptKeys,
    SectionSpec,
    StateLayout,
    ViewSpec,
)
from vllm_hybridcache.core.disk import LinkDirectory, crc, direct, linkfile, reader
from vllm_hybridcache.core.disk.reader import stage_chain
from vllm_hybridcache.core.keys import make_domain
from vllm_hybridcache.core.store import DEFAULT_SLAB_BYTES

FP = b"B" * 32
DOM = make_domain(bench="disk")


def layout_for(mib: int) -> tuple[StateLayout, int]:
    """A layout whose 512-row link is about `mib` MiB: 1/4 sections, 3/4 rows (like the
    reference hybrid layout: GDN state plus attention K/V)."""
    total = mib << 20
    sec = total // 4 // 4  # float32 elements
    row = (total - sec * 4) // 512 // 2  # bfloat16 elements per row
    lay = StateLayout(sections=(SectionSpec("gdn", (sec,), "float32"),),
                      views=(ViewSpec("kv", (row,), "bfloat16"),))
    return lay, 512


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t0


def open_bench_dir(work: Path, links: int, rows: int
                   ) -> tuple[LinkDirectory, np.ndarray, PromptKeys]:
    """An opened link folder under `work` and the prompt (token ids, keys) of a chain of
    `links` links of `rows` rows each."""
    d = LinkDirectory(work / "tier", FP, budget_bytes=1 << 50)
    d.open()
    toks = np.arange(rows * links, dtype=np.int64) + 1000
    return d, toks, PromptKeys(toks)


def random_parts(store: LinkStore, rows: int) -> tuple[dict[str, torch.Tensor], int]:
    """One link's parts (sections and views) filled with random bytes (incompressible, like
    real state), and their size; every link of a benchmark chain writes this one buffer."""
    src = store.allocate(0, rows)
    gen = np.random.default_rng(0)
    for t in (*src.sections.values(), *src.views.values()):
        flat = t.reshape(-1).view(torch.uint8).numpy()
        flat[:] = gen.integers(0, 256, flat.shape, dtype=np.uint8)
    parts = {**src.sections, **src.views}
    return parts, sum(p.numel() * p.element_size() for p in parts.values())


def write_chain(d: LinkDirectory, keys: PromptKeys, links: int, rows: int,
                parts: dict[str, torch.Tensor], nbytes: int) -> list[Path]:
    """Write a chain of `links` links of `rows` rows each on the prompt of `keys`; their files."""
    for i in range(links):
        s, e = i * rows, (i + 1) * rows
        assert d.write(domain=DOM, digest=keys.digest(e),
                       parent_digest=keys.digest(s) if s else b"", start=s, end=e,
                       tokens=keys.tokens[s:e], rows=rows, parts=parts, nbytes=nbytes)
    return [d.path_for(DOM, (i + 1) * rows, keys.digest((i + 1) * rows)) for i in range(links)]


def run(folder: Path, links: int, mib: int, passes: int = 5) -> dict:
    lay, rows = layout_for(mib)
    store = LinkStore(lay, pin_memory=False)
    load_start = os.getloadavg()  # a shared machine: the load the figures were taken under
    work = Path(tempfile.mkdtemp(prefix="hc-disk-bench-", dir=folder))
    try:
        d, _toks, keys = open_bench_dir(work, links, rows)
        parts, nbytes = random_parts(store, rows)

        t0 = time.perf_counter()
        files = write_chain(d, keys, links, rows, parts, nbytes)
        t_write = time.perf_counter() - t0
        file_bytes = sum(p.stat().st_size for p in files)

        chain = [LinkRef(100 + i, i * rows, (i + 1) * rows) for i in range(links)]
        paths = [str(p) for p in files]

        def timed_read(into: LinkStore, cold: bool = True, direct_io: bool = True
                       ) -> tuple[float, float]:
            """One staged read of the chain into `into`: (wall seconds, CPU seconds of the
            whole process), from the device (page cache dropped first) or, `cold=False`, from
            a page cache just warmed by a buffered read."""
            if cold:
                drop_cache(files)
            else:
                stage_chain(into, chain, paths, FP, direct=False)
                into.drop([r.link_id for r in chain])
            c0, t0 = time.process_time(), time.perf_counter()
            stage_chain(into, chain, paths, FP, direct=direct_io)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            into.drop([r.link_id for r in chain])
            return wall, cpu

        def timed_reads(into: LinkStore, cold: bool = True, direct_io: bool = True
                        ) -> list[float]:
            return [timed_read(into, cold, direct_io)[0] for _ in range(3)]

        # does this folder take direct I/O (else the tier reads buffered, and so does "direct")
        h0, b0 = linkfile.read_header(files[0], FP)
        probe = store.allocate(99, rows)
        try:
            direct.read_parts_direct(files[0], h0, b0, {**probe.sections, **probe.views})
            direct_io = True
        except direct.DirectIOUnsupported:
            direct_io = False
        store.drop([99])
        # the tier's read (direct I/O) and the buffered read, alternating pass by pass
        pairs = {"direct": [], "buffered": []}
        for _ in range(passes):
            for name in pairs:
                pairs[name].append(timed_read(store, direct_io=name == "direct"))
        reads = [w for w, _ in pairs["direct"]]
        buffered = [w for w, _ in pairs["buffered"]]
        # the same reads without the reader's huge-page hint (core/disk/hugepages.py)
        with mock.patch.object(reader, "advise_huge_pages", lambda parts: False):
            no_hint = timed_reads(store)
        # the same reads into a store carving links out of reused slabs (how the worker's
        # pinned store works on a GPU host): no fresh pages to fault in per read
        slab_reads = timed_reads(LinkStore(lay, pin_memory=False, slab_bytes=DEFAULT_SLAB_BYTES))
        # the CPU side alone: the buffered staging from the page cache (copy + CRC + buffers)
        cached = timed_reads(store, cold=False, direct_io=False)
        # the same reads verified with zlib's CRC-32 instead of the tier's (same values)
        with mock.patch.object(linkfile, "crc32", zlib.crc32), \
                mock.patch.object(direct, "crc32", zlib.crc32):
            zlib_reads = timed_reads(store)
        big = os.urandom(64 << 20)

        def crc_rate(fn) -> float:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                fn(big)
                best = min(best, time.perf_counter() - t0)
            return 64 / 1024 / best

        raw = work / "dd.bin"
        mib_total = file_bytes >> 20
        t_dd_write = dd(["if=/dev/zero", f"of={raw}", "bs=1M", f"count={mib_total}",
                         "oflag=direct", "conv=fsync"])
        dd_reads, dd_reads_4m = [], []
        for _ in range(3):
            for bs, out_list in (("1M", dd_reads), ("4M", dd_reads_4m)):
                drop_cache([raw])
                out_list.append(dd([f"if={raw}", "of=/dev/null", f"bs={bs}", "iflag=direct"]))
        gib = 1 << 30
        gibs = file_bytes / gib
        out = {
            "folder": str(folder), "links": links, "link_bytes": nbytes,
            "direct_io": direct_io,
            "file_bytes": file_bytes,
            "tier_write_gib_s": file_bytes / t_write / gib,
            "dd_write_gib_s": (mib_total << 20) / t_dd_write / gib,
            "tier_read_gib_s": file_bytes / min(reads) / gib,
            "dd_read_gib_s": (mib_total << 20) / min(dd_reads) / gib,
            "dd_read_4m_gib_s": (mib_total << 20) / min(dd_reads_4m) / gib,
            "read_passes": passes,
            "tier_read_median_gib_s": gibs / float(np.median(reads)),
            "tier_read_cpu_s_per_gib": float(np.median([c for _, c in pairs["direct"]])) / gibs,
            "buffered_read_gib_s": gibs / min(buffered),
            "buffered_read_median_gib_s": gibs / float(np.median(buffered)),
            "buffered_read_cpu_s_per_gib": float(
                np.median([c for _, c in pairs["buffered"]])) / gibs,
            "tier_read_no_hint_gib_s": file_bytes / min(no_hint) / gib,
            "tier_read_slab_gib_s": file_bytes / min(slab_reads) / gib,
            "tier_read_page_cache_gib_s": file_bytes / min(cached) / gib,
            "crc32_backend": crc.BACKEND,
            "crc32_gib_s": crc_rate(crc.crc32),
            "zlib_crc32_gib_s": crc_rate(zlib.crc32),
            "tier_read_zlib_crc_gib_s": file_bytes / min(zlib_reads) / gib,
        }
        out["read_ratio"] = out["tier_read_gib_s"] / out["dd_read_gib_s"]
        # against the faster of the two dd runs: the device's best in this run
        dd_best = max(out["dd_read_gib_s"], out["dd_read_4m_gib_s"])
        out["read_ratio_best_dd"] = out["tier_read_gib_s"] / dd_best
        out["buffered_read_ratio"] = out["buffered_read_gib_s"] / out["dd_read_gib_s"]
        out["buffered_read_ratio_best_dd"] = out["buffered_read_gib_s"] / dd_best
        out["direct_over_buffered"] = out["tier_read_gib_s"] / out["buffered_read_gib_s"]
        out["read_slab_ratio"] = out["tier_read_slab_gib_s"] / out["dd_read_gib_s"]
        out["read_zlib_crc_ratio"] = out["tier_read_zlib_crc_gib_s"] / out["dd_read_gib_s"]
        out["write_ratio"] = out["tier_write_gib_s"] / out["dd_write_gib_s"]
        out["loadavg_start"], out["loadavg_end"] = load_start, os.getloadavg()
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                    help="a folder on the disk to measure (default: the temp folder)")
    ap.add_argument("--links", type=int, default=16)
    ap.add_argument("--mib", type=int, default=38, help="MiB per link (38: reference layout)")
    ap.add_argument("--passes", type=int, default=5,
                    help="read passes of each of the direct and the buffered read (alternating)")
    args = ap.parse_args(argv)
    print(json.dumps(run(args.dir, args.links, args.mib, args.passes)))
    return 0


if __name__ == "__main__":
    main()
