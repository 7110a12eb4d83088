"""Snapshot copy on the CPU: csrc's CPU twin against today's per-block torch copies.

Why: the CPU twin replaces one ``copy_`` per KV block (a dispatcher call each) with one C++
call per layer or per link; it becomes the CPU default only if it is faster here, side by side
on the same buffers. For each shape (attention layers x KV heads x head dim x block tokens,
bf16, vLLM's CPU layout [blocks, heads, block, C]) and a link of ``--tokens`` tokens, it times
the link's gather (cache -> contiguous link buffer) and scatter (back) three ways:

* ``torch``: ``PagedBlocks`` with the torch backend (one ``copy_`` per block, today's path);
* ``twin/layer``: ``PagedBlocks`` with the csrc backend (one twin call per layer);
* ``twin/link``: every layer's table concatenated, one twin call per link (what a worker that
  batches a link's layers gets).

Medians over ``--reps`` interleaved runs after a warm-up, and the ratio torch / twin (> 1: twin
faster). Every run's result is checked bit for bit against the torch path's.

    python -m benchmarks.copy_bench                 # all shapes, markdown table on stdout
    python -m benchmarks.copy_bench --reps 5 --shapes tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

# name: (attention layers, kv heads, head dim, block tokens)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (4, 2, 64, 16),            # the embedded test models' scale, GPU-sized blocks
    "qwen3-next-b128": (12, 2, 256, 128),   # Qwen3-Next-80B attention, vLLM CPU block size
    "qwen3-next-b16": (12, 2, 256, 16),     # the same with GPU-sized blocks: many small copies
}


def _medians_ms(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median wall time of each function; runs are interleaved (one of each per round) so a
    change in machine load hits every variant alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for k, fn in fns.items():
        fn()  # warm-up: first-touch page faults, table code paths
        del k
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def run_shape(name: str, tokens: int, reps: int) -> dict[str, float | int | str]:
    from vllm_hybridcache.ops import copy_select, segments
    from vllm_hybridcache.ops.paged_blocks import PagedBlocks

    layers, heads, dim, bt = SHAPES[name]
    n = -(-tokens // bt)
    num_blocks = 4 * n
    block_bytes = 2 * heads * bt * dim * 2
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(num_blocks, heads, bt, 2 * dim, generator=g).to(torch.bfloat16)
              for _ in range(layers)]
    ids = torch.randperm(num_blocks, generator=g)[:n].tolist()
    bufs = {k: [torch.zeros(n, block_bytes, dtype=torch.uint8) for _ in range(layers)]
            for k in ("torch", "layer", "link")}

    def accessors(backend: str) -> list[PagedBlocks]:
        os.environ[copy_select.ENV_VAR] = backend
        copy_select._select.cache_clear()
        accs = [PagedBlocks(c, num_blocks, block_bytes) for c in caches]
        assert all(a.backend == backend for a in accs)
        return accs

    t_acc, c_acc = accessors("torch"), accessors("csrc")
    twin = c_acc[0]._run

    def per_layer(accs: list[PagedBlocks], out: list[torch.Tensor], gather: bool):
        def fn() -> None:
            for a, o in zip(accs, out, strict=True):
                (a.gather if gather else a.scatter)(ids, 0, o)
        return fn

    def per_link(out: list[torch.Tensor], gather: bool):
        def fn() -> None:
            tables = [a.table(ids, 0, o, gather) for a, o in zip(c_acc, out, strict=True)]
            twin(segments.concat(tables, copy_select.CPU_TILE_BYTES))
        return fn

    row: dict[str, float | int | str] = {"shape": name, "copies": n * layers,
                                         "MiB": round(n * layers * block_bytes / 2**20, 1)}
    for op, gather in (("gather", True), ("scatter", False)):
        med = _medians_ms({"torch": per_layer(t_acc, bufs["torch"], gather),
                           "twin/layer": per_layer(c_acc, bufs["layer"], gather),
                           "twin/link": per_link(bufs["link"], gather)}, reps)
        for k, v in med.items():
            row[f"{op} {k}"] = v
        for k in ("layer", "link"):
            assert all(torch.equal(a, b) for a, b in zip(bufs["torch"], bufs[k], strict=True))
    os.environ.pop(copy_select.ENV_VAR, None)
    copy_select._select.cache_clear()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of one link (grid 2048)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch/ATen threads for both paths (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from vllm_hybridcache.ops.csrc_build import load_cpu_twin

    load_cpu_twin()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, link of "
          f"{args.tokens} tokens, medians of {args.reps} runs (ms)\n")
    print("| shape | copies | MiB | op | torch | twin/layer | twin/link | torch/layer | "
          "torch/link |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        r = run_shape(name, args.tokens, args.reps)
        for op in ("gather", "scatter"):
            t, lay, link = (float(r[f"{op} {k}"]) for k in ("torch", "twin/layer", "twin/link"))
            print(f"| {name} | {r['copies']} | {r['MiB']} | {op} | {t:.3f} | {lay:.3f} | "
                  f"{link:.3f} | {t / lay:.2f}x | {t / link:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
