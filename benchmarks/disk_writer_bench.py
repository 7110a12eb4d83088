"""The disk writer's cost on serving: TTFT of a trace replay with the disk tier writing vs off.

Two servers of the same model and settings run side by side, one with the disk tier on
(`VLLM_HYBRIDCACHE_DISK_DIR` on a fresh folder, `disk_write_first_tokens = 0`: every committed
tree link is written, the most the writer ever does) and one without it. They replay the same
trace in turns (off, on, on, off, off, on, ...: the order alternates so a drift of the shared
machine's load falls on both), each replay from an empty cache (`POST /reset_prefix_cache`,
which also clears the tier's files, so every replay writes its links again). The idle server
waits while the other replays.

Figures: TTFT p50 of every replay, the median of those per side, and the ratio on / off (the
issue's goal: within 5%); the files and bytes the writer wrote, and writes dropped (the writer
falling behind), so a ratio near 1 is not a writer that did nothing.

Usage: python -m benchmarks.disk_writer_bench [--writer-model qwen3-next-tiny]
       [--trace coding-agent] [--size ci] [--reps 4]
Prints one JSON line; docs/benchmarks/disk.md records the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import msgspec
import requests

from benchmarks import report as rep
from benchmarks.ideal import PromptTokenizer
from benchmarks.replay import ReplayConfig, replay
from benchmarks.servers import SYSTEMS, ServerSettings, reset_cache, running_servers
from benchmarks.traces import SIZES, generate


def _disk(base: str) -> dict:
    return requests.get(base + "/v1/cache/stats", timeout=30).json()["tiers"].get("disk", {})


def run(model: str, family: str, size: str, reps: int, port: int, workdir: Path) -> dict:
    from vllm_hybridcache.models import ensure_model

    path = str(ensure_model(model))
    trace = generate(family, size, 0)
    tokenizer = PromptTokenizer(path)
    settings = ServerSettings(model_path=path, served_name=model,
                              max_model_len=SIZES[size].max_model_len, port=port)
    on_env = {"VLLM_HYBRIDCACHE_DISK_DIR": str(workdir / "disk"),
              "VLLM_HYBRIDCACHE_DISK_WRITE_FIRST_TOKENS": "0"}
    off_env: dict[str, str] = {}
    out: dict = {"model": model, "trace": family, "size": size, "reps": reps,
                 "ttft_p50_ms": {"off": [], "on": []}, "replay_s": {"off": [], "on": []},
                 "disk_writes": [], "disk_write_bytes": [], "disk_writes_dropped": []}
    base = SYSTEMS["ours"]

    def ours(env: dict[str, str]):
        return msgspec.structs.replace(base, env={**base.env, **env})

    with running_servers((ours(off_env), settings, workdir / "off.log"),
                         (ours(on_env), msgspec.structs.replace(settings, port=port + 10),
                          workdir / "on.log")) as (off, on):
        order = []
        for i in range(reps):
            order += [("off", off), ("on", on)] if i % 2 == 0 else [("on", on), ("off", off)]
        for name, srv in order:
            if not reset_cache(srv.base_url):
                raise RuntimeError(f"{name}: POST /reset_prefix_cache refused")
            before = _disk(srv.base_url)
            result = replay(trace, ReplayConfig(base_url=srv.base_url, model=model), tokenizer)
            summary = rep.summarize(result.requests, result.wall_s, None)
            if summary.errors:
                raise RuntimeError(f"{name}: {summary.errors} requests failed")
            out["ttft_p50_ms"][name].append(summary.ttft_p50_ms)
            out["replay_s"][name].append(result.wall_s)
            if name == "on":
                after = _disk(srv.base_url)
                out["disk_writes"].append(after.get("captures", 0) - before.get("captures", 0))
                out["disk_write_bytes"].append(
                    after.get("capture_bytes", 0) - before.get("capture_bytes", 0))
                dropped = after.get("skips", {}).get("queue_full", 0)
                out["disk_writes_dropped"].append(
                    dropped - before.get("skips", {}).get("queue_full", 0))
    med = {k: statistics.median(v) for k, v in out["ttft_p50_ms"].items()}
    out["median_ttft_p50_ms"] = med
    out["on_over_off"] = med["on"] / med["off"]
    out["load_avg_end"] = os.getloadavg()[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--writer-model", default="qwen3-next-tiny")
    ap.add_argument("--trace", default="coding-agent")
    ap.add_argument("--size", default="ci")
    ap.add_argument("--reps", type=int, default=4, help="replays per side")
    ap.add_argument("--port", type=int, default=8440)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hc-writer-") as work:
        print(json.dumps(run(args.writer_model, args.trace, args.size, args.reps, args.port,
                             Path(work))))
    return 0


if __name__ == "__main__":
    main()
