"""Disk tier bandwidth: link files written and read by the tier's code vs `dd` on the same folder.

What it measures, in one run on one folder (so the device and its load are the same):
- **write**: `LinkDirectory.write` of N links of the reference size (one link file each:
  header, parts with a CRC-32 each, fsync, rename, directory fsync), against
  `dd if=/dev/zero of=F bs=1M count=S oflag=direct conv=fsync` over the same bytes;
- **read**: `stage_chain` of those files into a RAM `LinkStore`, the way a disk hit reads them:
  each file's header read and verified first, untimed (the scheduler's lookup does that right
  before the hit, so the staging finds the headers in the page cache), then one request per
  file straight into a reused page-aligned store buffer (core/linkformat/inplace.py, the store's
  PagePool) with direct I/O (`direct`; `buffered`: the same request through the page cache)
  and every part's CRC-32 checked. Side by side in the same rounds (every arm once per round,
  in turn; the files' pages dropped from the page cache before each, `posix_fadvise(DONTNEED)`
  per file, which touches no other process's cache): the direct read with the headers from the
  device too (`headers_cold`), into fresh buffers (a pool with nothing to give yet: the first
  hit of a new process), the reads before the pool (fresh buffers, part by part: `readinto`,
  or bounce buffers), and `dd if=F of=/dev/null iflag=direct` with 1, 4 and 16 MiB requests
  over a file holding the link files' own bytes (random; a file of zeros, also timed, can read
  faster on a virtual disk that stores zeros sparsely). Medians and best passes, the CPU
  seconds per GiB of each read (every thread of the process), and the ratios against the
  fastest `dd` (median against median, best against best) are reported;
- the CPU side alone: the staging from the page cache, and the CRC-32 rate of the tier
  (core/linkformat/crc.py: ISA-L's when installed) and of zlib, which bound the tier's read rate
  whatever the device; and the tier's read with zlib's CRC-32 (what it was before ISA-L's).

Usage: python -m benchmarks.run --micro disk --dir /path/on/the/disk [--links 16] [--mib 38]
[--passes 5]
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
from vllm_hybridcache.core.auth import PREFERRED_MAC, LinkKey, MacAlgorithm, new_secret
from vllm_hybridcache.core.disk import LinkDirectory
from vllm_hybridcache.core.keys import make_domain
from vllm_hybridcache.core.linkformat import crc, direct, inplace, linkfile, reader
from vllm_hybridcache.core.linkformat.reader import stage_chain

FP = b"B" * 32
DOM = make_domain(bench="disk")
KEY = LinkKey(new_secret(), "disk")  # a disk key of this run: its files are read by it only


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
    d = LinkDirectory(work / "tier", FP, budget_bytes=1 << 50, key=KEY)
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


def timed(arms: dict, passes: int) -> dict[str, list[tuple[float, float]]]:
    """`passes` rounds, each running every arm once in turn: {arm: [(wall s, CPU s)]}."""
    out: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
    for _ in range(passes):
        for a, fn in arms.items():
            out[a].append(fn())
    return out


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

        def timed_read(into: LinkStore, cold: bool = True, direct_io: bool = True,
                       lookup: bool = True) -> tuple[float, float]:
            """One staged read of the chain into `into`: (wall seconds, CPU seconds of the
            whole process), from the device (page cache dropped first) or, `cold=False`, from
            a page cache just warmed by a buffered read. `lookup`: each file's header read and
            verified first, untimed, as the scheduler's lookup does right before a disk hit
            (the staging then finds the headers in the page cache). The chain is dropped after
            it (its buffers go back to the store's pool, as after a restore that promotes
            nothing)."""
            if cold:
                drop_cache(files)
                if lookup:
                    for p in files:
                        linkfile.read_header(p, FP, KEY)
            else:
                stage_chain(into, chain, paths, FP, direct=False, key=KEY)
                into.drop([r.link_id for r in chain])
            c0, t0 = time.process_time(), time.perf_counter()
            stage_chain(into, chain, paths, FP, direct=direct_io, key=KEY)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            into.drop([r.link_id for r in chain])
            return wall, cpu

        def timed_reads(into: LinkStore, cold: bool = True, direct_io: bool = True
                        ) -> list[float]:
            return [timed_read(into, cold, direct_io)[0] for _ in range(3)]

        def per_part_read(direct_io: bool) -> tuple[float, float]:
            """The read before this session's change: fresh store buffers every time (a pool
            that keeps nothing), each part read on its own (`readinto`, or bounce buffers)."""
            with mock.patch.object(reader, "fits_in_place", lambda *a: False):
                return timed_read(fresh_store, direct_io=direct_io)

        def crc_only_read() -> tuple[float, float]:
            """The direct read with the parts' MACs not checked (only their CRC-32, what format
            2 checked): against `direct`, what authenticating a disk hit costs."""
            def crc_only(path, entry, data, key, alg, crc=None, mac=None):
                if (linkfile.crc32(data) if crc is None else crc) != entry.crc32:
                    raise linkfile.LinkFileError(linkfile.LinkFileProblem.CHECKSUM, str(path))

            with mock.patch.object(inplace, "check_part", crc_only), \
                    mock.patch.object(direct, "check_part", crc_only):
                return timed_read(store, direct_io=True)

        def dd_read(bs: str, src: Path) -> tuple[float, float]:
            drop_cache([src])
            return dd([f"if={src}", "of=/dev/null", f"bs={bs}", "iflag=direct"]), 0.0

        raw = work / "dd.bin"
        mib_total = file_bytes >> 20
        t_dd_write = dd(["if=/dev/zero", f"of={raw}", "bs=1M", f"count={mib_total}",
                         "oflag=direct", "conv=fsync"])
        # what dd reads: the link files' own bytes (random, like real state) in one file of
        # the same age as they are; a file of zeros (what dd wrote) can read faster than
        # its size on a virtual disk whose host stores zeros sparsely
        same = work / "dd-same-bytes.bin"
        with open(same, "wb") as f:
            for p in files:
                f.write(p.read_bytes())
            f.flush()
            os.fsync(f.fileno())
        # does this folder take direct I/O (else the tier reads buffered, and so does "direct")
        try:
            os.close(os.open(files[0], os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
            direct_io = hasattr(os, "O_DIRECT")
        except OSError:
            direct_io = False
        # a store whose pool keeps no buffer: every staged link in fresh memory (the first
        # disk hit of a new process, before any staged link was dropped)
        fresh_store = LinkStore(lay, pin_memory=False, pool_bytes=0)
        # every arm once per round, in turn, so each sees the same device and load; the
        # tier's arms read into `store`, whose pool the first round fills
        arms = {
            "direct": lambda: timed_read(store, direct_io=True),
            "direct_headers_cold": lambda: timed_read(store, direct_io=True, lookup=False),
            "direct_crc_only": crc_only_read,
            "buffered": lambda: timed_read(store, direct_io=False),
            "fresh": lambda: timed_read(fresh_store, direct_io=True),
            "per_part_buffered": lambda: per_part_read(False),
            "per_part_direct": lambda: per_part_read(True),
            "dd_1m": lambda: dd_read("1M", same),
            "dd_4m": lambda: dd_read("4M", same),
            "dd_16m": lambda: dd_read("16M", same),
            "dd_1m_zeros": lambda: dd_read("1M", raw),
        }
        timed({"direct": arms["direct"]}, 1)  # fills the pool: the arms measure reuse
        pairs = timed(arms, passes)
        # the CPU side alone: the buffered staging from the page cache (copy + CRC)
        cached = timed_reads(store, cold=False, direct_io=False)
        # the same reads verified with zlib's CRC-32 instead of the tier's (same values)
        with mock.patch.object(linkfile, "crc32", zlib.crc32):
            zlib_reads = timed_reads(store)
        big = os.urandom(64 << 20)

        def crc_rate(fn) -> float:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                fn(big)
                best = min(best, time.perf_counter() - t0)
            return 64 / 1024 / best

        gib = 1 << 30
        dd_bytes = same.stat().st_size

        def med(arm: str, nbytes: int = file_bytes) -> float:
            return nbytes / gib / float(np.median([w for w, _ in pairs[arm]]))

        def best(arm: str, nbytes: int = file_bytes) -> float:
            return nbytes / gib / min(w for w, _ in pairs[arm])

        def cpu(arm: str) -> float:
            return float(np.median([c for _, c in pairs[arm]])) / gibs
        gibs = file_bytes / gib
        dds = ("dd_1m", "dd_4m", "dd_16m")
        out = {
            "folder": str(folder), "links": links, "link_bytes": nbytes,
            "direct_io": direct_io,
            "file_bytes": file_bytes,
            "tier_write_gib_s": file_bytes / t_write / gib,
            "dd_write_gib_s": (mib_total << 20) / t_dd_write / gib,
            "read_passes": passes,
            # the tier's read: one direct request per file into reused page-aligned buffers
            "tier_read_gib_s": best("direct"),
            "tier_read_median_gib_s": med("direct"),
            "tier_read_cpu_s_per_gib": cpu("direct"),
            # the same without the parts' MACs (CRC-32 only, as format 2 was read)
            "crc_only_read_median_gib_s": med("direct_crc_only"),
            "crc_only_read_cpu_s_per_gib": cpu("direct_crc_only"),
            # the same with the headers read from the device too (no lookup just before)
            "headers_cold_read_median_gib_s": med("direct_headers_cold"),
            # the same one request per file through the page cache (disk_direct_reads off)
            "buffered_read_gib_s": best("buffered"),
            "buffered_read_median_gib_s": med("buffered"),
            "buffered_read_cpu_s_per_gib": cpu("buffered"),
            # the direct request into fresh buffers (a pool that has none to give yet)
            "fresh_read_median_gib_s": med("fresh"),
            "fresh_read_cpu_s_per_gib": cpu("fresh"),
            # the reads before: fresh buffers, part by part
            "per_part_buffered_median_gib_s": med("per_part_buffered"),
            "per_part_buffered_cpu_s_per_gib": cpu("per_part_buffered"),
            "per_part_direct_median_gib_s": med("per_part_direct"),
            "per_part_direct_cpu_s_per_gib": cpu("per_part_direct"),
            "dd_read_gib_s": best("dd_1m", dd_bytes),
            "dd_read_4m_gib_s": best("dd_4m", dd_bytes),
            "dd_read_16m_gib_s": best("dd_16m", dd_bytes),
            **{f"{a}_median_gib_s": med(a, dd_bytes) for a in dds},
            "dd_1m_zeros_median_gib_s": med("dd_1m_zeros", mib_total << 20),
            "tier_read_page_cache_gib_s": file_bytes / min(cached) / gib,
            "pool_reused": store.pool.reused, "pool_taken": store.pool.taken,
            "crc32_backend": crc.BACKEND,
            "crc32_gib_s": crc_rate(crc.crc32),
            "zlib_crc32_gib_s": crc_rate(zlib.crc32),
            # the parts' MAC (keyed BLAKE2b, core/auth.py): what authenticating a read costs
            "mac_algorithm": PREFERRED_MAC.name,
            "part_mac_gib_s": crc_rate(lambda b: KEY.part_mac().update(b)),
            **{f"part_mac_{a.name.lower()}_gib_s":
               crc_rate(lambda b, a=a: KEY.part_mac(a).update(b)) for a in MacAlgorithm},
            "tier_read_zlib_crc_gib_s": file_bytes / min(zlib_reads) / gib,
        }
        out["read_ratio"] = out["tier_read_gib_s"] / out["dd_read_gib_s"]
        out["mac_cost_ratio_median"] = (out["crc_only_read_median_gib_s"]
                                        / out["tier_read_median_gib_s"])
        # against the fastest dd (the device's best in this run): best passes, and medians
        dd_best = max(out[k] for k in ("dd_read_gib_s", "dd_read_4m_gib_s", "dd_read_16m_gib_s"))
        dd_med = max(out[f"{a}_median_gib_s"] for a in dds)
        out["dd_best_median_gib_s"] = dd_med
        out["read_ratio_best_dd"] = out["tier_read_gib_s"] / dd_best
        out["read_ratio_median"] = out["tier_read_median_gib_s"] / dd_med
        out["buffered_read_ratio"] = out["buffered_read_gib_s"] / out["dd_read_gib_s"]
        out["buffered_read_ratio_best_dd"] = out["buffered_read_gib_s"] / dd_best
        out["buffered_read_ratio_median"] = out["buffered_read_median_gib_s"] / dd_med
        out["headers_cold_ratio_median"] = out["headers_cold_read_median_gib_s"] / dd_med
        out["fresh_read_ratio_median"] = out["fresh_read_median_gib_s"] / dd_med
        out["per_part_buffered_ratio_median"] = out["per_part_buffered_median_gib_s"] / dd_med
        out["per_part_direct_ratio_median"] = out["per_part_direct_median_gib_s"] / dd_med
        out["direct_over_buffered"] = out["tier_read_gib_s"] / out["buffered_read_gib_s"]
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
