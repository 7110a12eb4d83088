"""Where a disk hit's read spends its time: the phases of `stage_chain`, and what is left to save.

A chain of link files of one size is written once (`LinkDirectory.write`, random bytes), then
read back over several alternating passes, every pass from the device (the files' pages
dropped from the page cache first) unless said otherwise:
- **phases** of the per-part buffered read (the tier's read before its reads went in place, and
  still its read of a file whose parts lie elsewhere than the store's layout), timed with
  `time.perf_counter` around each step (read and verify the header, compare the stored token
  ids with the prompt's as the lookup does, allocate fresh store buffers, the huge-page hint,
  the `readinto` of each part, the CRC-32 of each part over the bytes in the store, seal), and
  the same pass through `stage_chain` forced onto that path into a store whose pool keeps
  nothing (the phases must add up to it); from the device and from the page cache (no device:
  the CPU's part alone);
- **paths side by side**, wall and CPU seconds (every thread of the process) per GiB: the
  tier's read (`stage_chain`: one request per file into reused page-aligned store buffers, the
  CRCs checked on a helper thread while the next file is read) with direct I/O
  (`disk_direct_reads`) and through the page cache; and, as bounds, direct I/O straight into
  page-aligned buffers followed by the same CRC-32 pass on the calling thread, into fresh
  buffers and into reused ones; `dd` with direct I/O, 1 and 4 MiB requests, in the same run
  (over a file of zeros: `disk_bench` also reads the links' own bytes);
- a `cProfile` of one cold per-part `stage_chain` pass (the functions that hold the time).

Usage: python -m benchmarks.disk_read_profile [--dir /tmp] [--links 8] [--mib 8] [--passes 5]
(8 links of 8 MiB: about the chain of a 16K head of `qwen3-next-small`, 8.5 MB per link file).
Prints one JSON line; docs/benchmarks/disk.md records the results.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import mmap
import os
import pstats
import shutil
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from benchmarks.disk_bench import (
    FP,
    KEY,
    dd,
    drop_cache,
    layout_for,
    open_bench_dir,
    random_parts,
    write_chain,
)
from vllm_hybridcache.core import LinkRef, LinkStore
from vllm_hybridcache.core.linkformat import linkfile, reader
from vllm_hybridcache.core.linkformat.crc import crc32
from vllm_hybridcache.core.linkformat.hugepages import advise_huge_pages
from vllm_hybridcache.core.linkformat.reader import stage_chain

PHASES = ("header", "tokens", "allocate", "hint", "read", "crc", "mac", "seal")


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def phased_read(store: LinkStore, chain: list[LinkRef], paths: list[Path], toks: np.ndarray
                ) -> dict[str, float]:
    """One per-part buffered staging of the chain into fresh buffers, step by step as
    stage_chain and read_parts take it on that path (every check kept), with the seconds of
    each step summed over the files."""
    t = dict.fromkeys(PHASES, 0.0)
    for ref, path in zip(chain, paths, strict=True):
        c = time.perf_counter()
        header, base = linkfile.read_header(path, FP, KEY)
        t["header"] += time.perf_counter() - c
        c = time.perf_counter()
        assert np.array_equal(header.token_ids(), toks[ref.start:ref.end])
        t["tokens"] += time.perf_counter() - c
        c = time.perf_counter()
        bufs = store.allocate(ref.link_id, store.layout.view_rows(ref.start, ref.end))
        parts = {**bufs.sections, **bufs.views}
        t["allocate"] += time.perf_counter() - c
        c = time.perf_counter()
        advise_huge_pages(parts.values())
        t["hint"] += time.perf_counter() - c
        entries = {e.name: e for e in header.parts}
        with open(path, "rb", buffering=0) as f:
            for name, part in parts.items():
                e, out = entries[name], _bytes(part)
                c = time.perf_counter()
                f.seek(base + e.offset)
                assert f.readinto(out) == e.nbytes
                t["read"] += time.perf_counter() - c
                c = time.perf_counter()
                assert crc32(out) == e.crc32
                t["crc"] += time.perf_counter() - c
                c = time.perf_counter()
                mac = KEY.part_mac(header.mac_alg)
                mac.update(out)
                assert mac.digest() == e.mac
                t["mac"] += time.perf_counter() - c
        c = time.perf_counter()
        store.seal(ref.link_id)
        t["seal"] += time.perf_counter() - c
    return t


def aligned_direct_read(paths: list[Path], bufs: list[mmap.mmap] | None) -> int:
    """Every part of every file read with O_DIRECT straight into a page-aligned buffer (fresh
    anonymous memory, or `bufs` reused), then its CRC-32 checked there: the read without a copy
    that page-aligned store buffers would allow. Returns the bytes read."""
    n = 0
    for i, path in enumerate(paths):
        header, base = linkfile.read_header(path, FP, KEY)
        size = linkfile._round_up(max(e.offset + e.nbytes for e in header.parts))
        buf = bufs[i] if bufs is not None else mmap.mmap(-1, size)
        if bufs is None:
            advise_huge_pages([torch.frombuffer(buf, dtype=torch.uint8)])
        mv = memoryview(buf)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = os.preadv(fd, [mv[:size]], base)  # one request list: the whole payload
        finally:
            os.close(fd)
        assert got >= max(e.offset + e.nbytes for e in header.parts)
        for e in header.parts:
            assert crc32(mv[e.offset:e.offset + e.nbytes]) == e.crc32
            n += e.nbytes
        mv.release()
        if bufs is None:
            buf.close()
    return n


def run(folder: Path, links: int, mib: int, passes: int) -> dict:
    lay, rows = layout_for(mib)
    store = LinkStore(lay, pin_memory=False)
    work = Path(tempfile.mkdtemp(prefix="hc-disk-profile-", dir=folder))
    out: dict = {"folder": str(folder), "links": links, "mib": mib, "passes": passes,
                 "loadavg_start": os.getloadavg()}
    try:
        d, toks, keys = open_bench_dir(work, links, rows)
        parts, nbytes = random_parts(store, rows)
        files = write_chain(d, keys, links, rows, parts, nbytes)
        store.drop([0])
        gib = sum(p.stat().st_size for p in files) / (1 << 30)
        out["file_bytes"] = int(gib * (1 << 30))
        chain = [LinkRef(100 + i, i * rows, (i + 1) * rows) for i in range(links)]
        ids = [r.link_id for r in chain]
        paths = [str(p) for p in files]

        def timed(fn, cold: bool = True) -> tuple[float, float]:
            if cold:
                drop_cache(files)
            else:
                for p in files:
                    p.read_bytes()
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if store.has(ids[0]):
                store.drop(ids)
            return wall, cpu

        reused = [mmap.mmap(-1, linkfile._round_up(f.stat().st_size)) for f in files]
        # the per-part path into fresh buffers, through stage_chain (what the phases time)
        poolless = LinkStore(lay, pin_memory=False, pool_bytes=0)

        def per_part() -> None:
            with mock.patch.object(reader, "fits_in_place", lambda *a: False):
                stage_chain(poolless, chain, paths, FP, direct=False, key=KEY)
            poolless.drop(ids)

        paths_fns = {
            "tier_direct": lambda: stage_chain(store, chain, paths, FP, direct=True, key=KEY),
            "tier_buffered": lambda: stage_chain(store, chain, paths, FP, direct=False,
                                                 key=KEY),
            "per_part_buffered": per_part,
            "direct_aligned_fresh": lambda: aligned_direct_read(files, None),
            "direct_aligned_reused": lambda: aligned_direct_read(files, reused),
        }
        try:  # the bounds need direct I/O (tmpfs and some file systems refuse it)
            os.close(os.open(files[0], os.O_RDONLY | os.O_DIRECT))
        except OSError:
            del paths_fns["direct_aligned_fresh"], paths_fns["direct_aligned_reused"]
        res: dict[str, list[tuple[float, float]]] = {k: [] for k in paths_fns}
        phases: dict[str, list[dict[str, float]]] = {"device": [], "page_cache": []}
        stage_walls: dict[str, list[float]] = {"device": [], "page_cache": []}
        for _ in range(passes):
            for k, fn in paths_fns.items():
                res[k].append(timed(fn))
            for where, cold in (("device", True), ("page_cache", False)):
                box: dict[str, dict[str, float]] = {}
                wall, _ = timed(lambda b=box: b.setdefault(
                    "t", phased_read(store, chain, files, toks)), cold)
                box["t"]["total"] = wall
                phases[where].append(box["t"])
                stage_walls[where].append(timed(per_part, cold)[0])
        dd1, dd4 = [], []
        raw = work / "dd.bin"
        subprocess_mib = max(1, int(gib * 1024))
        dd(["if=/dev/zero", f"of={raw}", "bs=1M", f"count={subprocess_mib}", "oflag=direct",
            "conv=fsync"])
        for _ in range(passes):
            for bs, lst in (("1M", dd1), ("4M", dd4)):
                drop_cache([raw])
                lst.append(dd([f"if={raw}", "of=/dev/null", f"bs={bs}", "iflag=direct"]))
        raw_gib = subprocess_mib / 1024
        out["dd_1m_gib_s"] = {"best": raw_gib / min(dd1), "median": raw_gib / np.median(dd1)}
        out["dd_4m_gib_s"] = {"best": raw_gib / min(dd4), "median": raw_gib / np.median(dd4)}
        out["paths"] = {k: {"best_gib_s": gib / min(w for w, _ in v),
                            "median_gib_s": gib / float(np.median([w for w, _ in v])),
                            "cpu_s_per_gib": float(np.median([c for _, c in v])) / gib}
                        for k, v in res.items()}
        dd_med = max(out["dd_1m_gib_s"]["median"], out["dd_4m_gib_s"]["median"])
        for v in out["paths"].values():
            v["median_over_faster_dd_median"] = v["median_gib_s"] / dd_med
        out["phases_ms"] = {
            where: {k: 1000 * float(np.median([p[k] for p in v])) for k in (*PHASES, "total")}
            for where, v in phases.items()}
        out["stage_chain_ms"] = {w: 1000 * float(np.median(v)) for w, v in stage_walls.items()}
        prof = cProfile.Profile()
        drop_cache(files)
        prof.enable()
        per_part()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(8)
        out["cprofile_top"] = [ln.strip() for ln in s.getvalue().splitlines()
                               if ln.strip() and ln.strip()[0].isdigit()][:8]
        out["loadavg_end"] = os.getloadavg()
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--links", type=int, default=8)
    ap.add_argument("--mib", type=int, default=8, help="MiB per link")
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args(argv)
    print(json.dumps(run(args.dir, args.links, args.mib, args.passes)))
    return 0


if __name__ == "__main__":
    main()
