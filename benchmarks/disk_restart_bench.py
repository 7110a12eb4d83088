"""Restart scenario: next-turn latency after a server restart, served cold, from RAM, from disk.

One server with the disk tier (`VLLM_HYBRIDCACHE_DISK_DIR`) on a fresh folder, one independent
head per `--head` size (4096,16384,32768: each its own chain, no shared prefix):
1. life 1: for each head, a prompt of the head plus a tail is prefilled (captures every grid
   cut, the writer writes them); a second prompt with the same head and another tail measures
   the **RAM-warm** latency; the server waits until the writer is idle (every admitted link
   on disk) and stops (SIGTERM);
2. the files are dropped from the page cache (`posix_fadvise(DONTNEED)` per file; a restart
   after a reboot reads them from the device; `--keep-page-cache` to skip);
3. life 2 on the same folder: after a short unrelated warm-up request (a new process's first
   forward pays one-time costs) and, unless `--no-warm-head`, a disk hit on one more head of
   the first size written in life 1 (reported as `first_disk_hit_s`: the measured turn is
   then, like life 1's RAM-warm turn, not the process's first over a long context), for each
   head: the head with a third tail measures the **disk** latency (the head is read from
   link files, verified, restored, promoted) and the worker's part of it (`restore_seconds`:
   reading, verifying and restoring the files); the same head with a unique `cache_salt`
   measures **cold** (same engine, nothing to reuse); then the disk turn is measured again
   with new tails (`disk_after_cold_s`, RAM cleared and files dropped first): like life 1's
   RAM-warm turn it now follows a long prefill in its process, so what differs from `disk_s`
   is the new process's state, not the tier's work; last, the head with a fifth tail is
   served from the links that disk hit promoted (`ram_promoted_s`: a RAM hit in the same
   process, the disk read taken out). The scheduler side's part (the folder's scan and the
   chain lookup) is timed in this process on the same files between the lives.

Every RAM-warm and disk turn is measured with the tier's writer idle (no write in flight and no
new file for 3 s: the links of the head's first prefill in life 1, of the previous head's cold
run in life 2, are written first), so that neither side of a ratio shares the cores with it.

Each request asks for one token (`/v1/completions` with prompt token ids, `max_tokens=1`), so
its latency is the time to first token plus one HTTP round trip. Token ids are seeded and
avoid the message-end ids, so cuts fall on the grid only.

Usage: python -m benchmarks.run --micro disk_restart [--restart-model qwen3-next-tiny]
       [--head 4096,16384,32768] [--keep-page-cache] [--repeats N]
With `--repeats N` each head's RAM-warm and disk turns are served N times (new tails; before
each disk turn after the first the RAM tier is cleared and the files dropped from the page
cache, so it is a disk hit again) and their medians reported beside every run; the load
average at the start and at the end of each life is recorded (a shared machine).
Prints one JSON line; docs/benchmarks/disk.md records the results.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from unittest import mock

import numpy as np
import requests

from benchmarks.disk_bench import drop_cache
from benchmarks.servers import SYSTEMS, ServerSettings, running_server


def random_prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    """`n` token ids drawn from the ordinary range of the vocabulary (no special tokens)."""
    return [int(x) for x in rng.integers(1000, min(vocab, 3000), n)]


def complete(base: str, ids: list[int], max_tokens: int = 1, **extra) -> tuple[float, dict]:
    """One greedy completion of `ids` on the served model "m": (seconds, response body)."""
    t0 = time.perf_counter()
    r = requests.post(base + "/v1/completions", json={
        "model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, **extra},
        timeout=1800)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


def wait_writes_done(folder: Path, still_s: float = 3.0, limit_s: float = 300.0) -> float:
    """Wait until the tier's writer is idle, as seen in its folder: no temporary file (a write
    in flight) and the same set of link files for `still_s`; returns the seconds waited.

    Why: a turn measured while the writer writes the links of the previous prefill (or of a
    cold run) shares the 2 cores with it; both sides of a ratio are measured with it idle."""
    t0 = time.monotonic()
    last, since = None, t0
    while time.monotonic() - t0 < limit_s:
        names = {f.name for f in folder.rglob("*") if f.is_file()}
        busy = any(n.startswith(".tmp-") for n in names)
        if busy or names != last:
            last, since = names, time.monotonic()
        elif time.monotonic() - since >= still_s:
            break
        time.sleep(0.25)
    return time.monotonic() - t0


def _disk_stats(base: str) -> dict:
    return requests.get(base + "/v1/cache/stats").json()["tiers"].get("disk", {})


def _restore_sum(base: str, tier: str) -> float:
    """Seconds the workers spent on `tier`'s restores so far (a disk restore: reading and
    verifying the files, then the copy into the KV cache; a RAM restore: the copy only)."""
    st = requests.get(base + "/v1/cache/stats").json()["tiers"].get(tier, {})
    return float(st.get("restore_seconds", {}).get("sum") or 0.0)


def lookup_seconds(root: Path, ids: list[int], grid: int) -> dict:
    """The scheduler side's part of a disk hit, timed in this process on the same files while
    no server runs: opening the folder (the start-up scan: every header read and verified) and
    the chain lookup of `ids` (a name stat per cut, every header of the chain verified, every
    stored token compared). Nothing is deleted: the files are the ones life 1 wrote."""
    import msgspec

    from vllm_hybridcache.core import PromptKeys
    from vllm_hybridcache.core.auth import key_from_file
    from vllm_hybridcache.core.disk import LinkDirectory
    from vllm_hybridcache.core.linkformat import linkfile

    f = next(root.rglob("*.link"))
    with open(f, "rb") as fh:  # the engine's fingerprint and the domain, as the file says
        _, hlen, _, _ = linkfile._PRE.unpack(fh.read(linkfile._PRE.size))
        hdr = msgspec.msgpack.decode(fh.read(hlen), type=linkfile.LinkFileHeader)
    key = key_from_file(root.parent / "disk.key", "disk")  # the servers' (env_keys below)
    d = LinkDirectory(root, hdr.fingerprint, budget_bytes=1 << 50, key=key)
    t0 = time.perf_counter()
    d.open()
    t_open = time.perf_counter() - t0
    keys = PromptKeys(np.asarray(ids, dtype=np.int64))
    cuts = list(range(grid, len(ids), grid))
    t0 = time.perf_counter()
    chain = d.lookup(keys, hdr.domain, cuts, len(ids) - 1)
    t_lookup = time.perf_counter() - t0
    d.close()
    return {"scan_s": t_open, "lookup_s": t_lookup, "lookup_links": len(chain)}


def run(model: str, heads: list[int], tail: int, grid: int, port: int, workdir: Path,
        drop_page_cache: bool = True, warm_head: bool = True, repeats: int = 1) -> dict:
    from vllm_hybridcache.models import ensure_model

    path = ensure_model(model)
    rng = np.random.default_rng(0)
    vocab = int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    # one independent head per size (no shared prefix: each is served by its own chain)
    head_ids = {h: random_prompt(rng, h, vocab) for h in heads}
    tails = [random_prompt(rng, tail, vocab) for _ in range(5)]
    # repeats of the RAM-warm and disk turns, each with its own tail (a tail already served
    # would hit its own deeper links)
    warm_tails = [tails[1]] + [random_prompt(rng, tail, vocab) for _ in range(repeats - 1)]
    disk_tails = [tails[2]] + [random_prompt(rng, tail, vocab) for _ in range(repeats - 1)]
    after_tails = [random_prompt(rng, tail, vocab) for _ in range(repeats)]
    # one more independent head of the first size, served from disk first in life 2, so the
    # measured disk turn is not the new process's first over a long context (life 1's
    # RAM-warm turn came after long prefills): any one-time cost of that shape falls on it
    warm_ids = random_prompt(rng, heads[0], vocab) if warm_head else None
    settings = ServerSettings(model_path=str(path), served_name="m",
                              max_model_len=max(heads) + tail + 64, port=port,
                              kv_cache_space_gib=4)
    env_keys = {"VLLM_HYBRIDCACHE_DISK_DIR": str(workdir / "disk"),
                "VLLM_HYBRIDCACHE_DISK_KEY_FILE": str(workdir / "disk.key"),
                "VLLM_HYBRIDCACHE_GRID": str(grid), "VLLM_HYBRIDCACHE_SESSION_ANCHORS": "0",
                "VLLM_HYBRIDCACHE_MESSAGE_END_IDS": "-1",
                # every committed link written (what the wait below counts on)
                "VLLM_HYBRIDCACHE_DISK_WRITE_FIRST_TOKENS": "0"}
    out: dict = {"model": model, "heads": heads, "tail": tail, "grid": grid,
                 "page_cache_dropped": drop_page_cache, "warm_head": warm_head,
                 "repeats": repeats, "loadavg": {"start": os.getloadavg()}, "by_head": {}}
    by = {h: out["by_head"].setdefault(str(h), {}) for h in heads}
    with mock.patch.dict(os.environ, env_keys):
        with running_server(SYSTEMS["ours"], settings, workdir / "life1.log") as srv:
            if warm_ids is not None:
                complete(srv.base_url, warm_ids + tails[0])
            for h in heads:
                by[h]["first_prefill_s"], _ = complete(srv.base_url, head_ids[h] + tails[0])
                by[h]["ram_writer_wait_s"] = wait_writes_done(workdir / "disk")
                warm, restores = [], []
                for t in warm_tails:
                    before = _restore_sum(srv.base_url, "ram")
                    dt, body = complete(srv.base_url, head_ids[h] + t)
                    warm.append(dt)
                    restores.append(_wait_restore(srv.base_url, before, "ram"))
                by[h]["ram_warm_runs_s"] = warm
                by[h]["ram_warm_s"] = float(np.median(warm))
                by[h]["ram_cached_tokens"] = body["usage"]["prompt_tokens_details"][
                    "cached_tokens"]
                by[h]["ram_restore_seconds"] = float(np.median(restores))
            # the writer idle before the stop (SIGTERM): the write admission need not write
            # every committed link (vllm_hybridcache/core/disk/admission.py), so the count of
            # files is recorded, not waited for; the measured heads' chains are checked by the
            # disk turns' hits below
            out["life1_writer_wait_s"] = wait_writes_done(workdir / "disk", still_s=10.0)
            ram = requests.get(srv.base_url + "/v1/cache/stats").json()["tiers"]["ram"]
            st = _disk_stats(srv.base_url)
            out["ram_captures"] = ram["kinds"]["tree"]["captures"]
            out["loadavg"]["life1_end"] = os.getloadavg()
            out["disk_files"] = st.get("links", 0)
            out["disk_bytes"] = st.get("bytes_held", 0)
        files = list((workdir / "disk").rglob("*.link"))
        for h in heads:
            by[h]["scheduler_side"] = lookup_seconds(workdir / "disk", head_ids[h] + tails[2],
                                                     grid)
        if drop_page_cache:  # a restart after a reboot: the files come from the device
            drop_cache(files)
        with running_server(SYSTEMS["ours"], settings, workdir / "life2.log") as srv:
            out["restart_startup_s"] = srv.startup_s
            # a short unrelated request first: the new process's first forward pays one-time
            # costs that are not the disk tier's (life 1's RAM-warm request came after one)
            complete(srv.base_url, tails[3][:64], cache_salt="warm-up")
            if warm_ids is not None:  # the first disk hit of this process (its own figure)
                before = _restore_sum(srv.base_url, "disk")
                out["first_disk_hit_s"], body = complete(srv.base_url, warm_ids + tails[2])
                out["first_disk_hit_cached_tokens"] = body["usage"]["prompt_tokens_details"][
                    "cached_tokens"]
                out["first_disk_hit_restore_seconds"] = _wait_restore(srv.base_url, before,
                                                                      "disk")
            for h in heads:
                by[h]["disk_writer_wait_s"] = wait_writes_done(workdir / "disk")
                by[h]["disk_cached_tokens"] = _disk_turns(
                    srv.base_url, by[h], "disk", head_ids[h], disk_tails, files,
                    drop_page_cache, first_clears=False)
                # cold: the same head with a unique salt (same engine, nothing to reuse)
                by[h]["cold_s"], body = complete(srv.base_url, head_ids[h] + tails[3],
                                                 cache_salt=f"cold-{uuid.uuid4().hex}")
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] in (0, None)
                # the disk turn again, now after a long prefill in this process, as life 1's
                # RAM-warm turns came right after the head's first prefill: what is left
                # between this and `disk_s` is the new process's state, not the tier's work
                by[h]["disk_after_cold_writer_wait_s"] = wait_writes_done(workdir / "disk")
                _disk_turns(srv.base_url, by[h], "disk_after_cold", head_ids[h], after_tails,
                            files, drop_page_cache, first_clears=True)
                # the promoted links, from RAM in this life: the same turn without the disk
                # read, in the same process (tells the disk tier's part from this process's
                # state)
                before = _restore_sum(srv.base_url, "ram")
                by[h]["ram_promoted_s"], body = complete(srv.base_url, head_ids[h] + tails[4])
                by[h]["ram_promoted_cached_tokens"] = body["usage"]["prompt_tokens_details"][
                    "cached_tokens"]
                by[h]["ram_promoted_restore_seconds"] = _wait_restore(srv.base_url, before,
                                                                      "ram")
            out["loadavg"]["life2_end"] = os.getloadavg()
    for b in by.values():
        b["disk_over_ram"] = b["disk_s"] / b["ram_warm_s"]
        b["disk_over_cold"] = b["disk_s"] / b["cold_s"]
        b["disk_over_ram_promoted"] = b["disk_s"] / b["ram_promoted_s"]
        b["disk_after_cold_over_ram"] = b["disk_after_cold_s"] / b["ram_warm_s"]
    return out


def _disk_turns(base: str, rec: dict, name: str, head: list[int], tails: list[list[int]],
                files: list[Path], drop_page_cache: bool, first_clears: bool) -> int:
    """Serve `head` + each tail as a disk hit and record `<name>_s` (the median), its runs,
    and the worker's read + verify + restore seconds; returns the last turn's cached tokens.
    Before each turn (but the first unless `first_clears`) the RAM tier is cleared (the last
    disk hit was promoted), a short unrelated request lets the worker apply the clear, and the
    files are dropped from the page cache, so every turn reads the chain from the device."""
    runs, restores = [], []
    for r, t in enumerate(tails):
        if r or first_clears:
            requests.post(base + "/v1/cache/clear", params={"tier": "ram"}).raise_for_status()
            # the clear's drops reach the worker with the next step and are applied after
            # that step's loads: a short unrelated request takes that step, so the measured
            # read gets the buffers the clear freed, as reads after RAM evictions do
            complete(base, head[:64], cache_salt=f"apply-clear-{uuid.uuid4().hex}")
            if drop_page_cache:
                drop_cache(files)
        before = _restore_sum(base, "disk")
        dt, body = complete(base, head + t)
        runs.append(dt)
        restores.append(_wait_restore(base, before, "disk"))
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, body
    rec[f"{name}_runs_s"] = runs
    rec[f"{name}_s"] = float(np.median(runs))
    rec[f"{name}_restore_runs_seconds"] = restores
    rec[f"{name}_restore_seconds"] = float(np.median(restores))
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _wait_restore(base: str, before: float, tier: str) -> float:
    """The seconds `tier`'s workers spent on restores since `before` (the sum's value then),
    once the last restore's seconds arrived (they ride on the next step's output), or 10 s."""
    deadline = time.monotonic() + 10
    while True:
        now = _restore_sum(base, tier)
        if now > before or time.monotonic() > deadline:
            return now - before
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # not --model: benchmarks.run keeps that one for its trace replays
    ap.add_argument("--restart-model", default="qwen3-next-tiny")
    ap.add_argument("--head", default="16384", help="head sizes, comma list (4096,16384,32768)")
    ap.add_argument("--keep-page-cache", action="store_true",
                    help="leave the files in the page cache between the lives (default: drop)")
    ap.add_argument("--no-warm-head", action="store_true",
                    help="no disk hit on another head of the first size before the measured "
                         "ones in life 2 (the measured disk turn is then the process's first)")
    ap.add_argument("--tail", type=int, default=128)
    ap.add_argument("--grid", type=int, default=2048)
    ap.add_argument("--port", type=int, default=8420)
    ap.add_argument("--repeats", type=int, default=1,
                    help="RAM-warm and disk turns per head (medians reported; before each "
                         "disk turn after the first, the RAM tier is cleared and the files "
                         "dropped from the page cache)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hc-restart-") as work:
        heads = [int(h) for h in args.head.split(",")]
        print(json.dumps(run(args.restart_model, heads, args.tail, args.grid, args.port,
                             Path(work), drop_page_cache=not args.keep_page_cache,
                             warm_head=not args.no_warm_head, repeats=args.repeats)))
    return 0


if __name__ == "__main__":
    main()
