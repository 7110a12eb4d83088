"""Check and time every copy backend on this machine's device, against torch index ops.

Why: CI proves the CPU twin and the Triton kernel (interpreter) bit-exact and the HIP code
objects well-formed, but only a real GPU runs the HIP/CUDA build. The smoke script runs this in
the image on the box (``python -m vllm_hybridcache.ops.selfcheck``); it gathers a link's KV
blocks from a paged cache on the device into pinned host rows and scatters them back, with each
backend that loads, and prints per backend: bit-exact or not, median milliseconds, GB/s.
Exit status 1 if a backend that loads gives different bytes.

Default shape: Qwen3-Next / Flash-Next attention (2 KV heads of 256, bf16), the GPU layout
[2, blocks, block, heads, D] with 16-token blocks, a 2048-token link over 12 layers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(device: torch.device, layers: int, heads: int, dim: int, block: int, tokens: int,
        reps: int) -> list[dict[str, object]]:
    from vllm_hybridcache.ops import copy_select
    from vllm_hybridcache.ops.paged_blocks import PagedBlocks

    n = -(-tokens // block)
    num_blocks = 4 * n
    g = torch.Generator().manual_seed(0)
    shape = (2, num_blocks, block, heads, dim) if device.type == "cuda" else (
        num_blocks, heads, block, 2 * dim)
    caches = [torch.randn(shape, generator=g).to(torch.bfloat16).to(device)
              for _ in range(layers)]
    block_bytes = caches[0].numel() * 2 // num_blocks
    ids = torch.randperm(num_blocks, generator=g)[:n].tolist()
    pin = device.type == "cuda"
    bdim = 1 if device.type == "cuda" else 0
    expect = [c.index_select(bdim, torch.tensor(ids, device=device)).movedim(bdim, 0)
              .contiguous().view(torch.uint8).reshape(n, -1).cpu() for c in caches]
    results: list[dict[str, object]] = []
    saved = os.environ.get(copy_select.ENV_VAR)
    try:
        for backend in copy_select.BACKENDS:
            os.environ[copy_select.ENV_VAR] = backend
            copy_select._select.cache_clear()
            try:
                accs = [PagedBlocks(c, num_blocks, block_bytes) for c in caches]
            except Exception as e:
                results.append({"backend": backend, "loaded": False, "error": str(e)[:200]})
                continue
            rows = [torch.zeros(n, block_bytes, dtype=torch.uint8, pin_memory=pin)
                    for _ in caches]

            def gather(accs=accs, rows=rows) -> None:
                for a, r in zip(accs, rows, strict=True):
                    a.gather(ids, 0, r)
                _sync(device)

            def scatter(accs=accs, rows=rows) -> None:
                for a, r in zip(accs, rows, strict=True):
                    a.scatter(ids, 0, r)
                _sync(device)

            gather()
            exact = all(torch.equal(r, e) for r, e in zip(rows, expect, strict=True))
            before = [c.clone() for c in caches]
            scatter()  # writes the same bytes back: the cache must be unchanged
            exact = exact and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                  for a, b in zip(caches, before, strict=True))
            times = {}
            for name, fn in (("gather", gather), ("scatter", scatter)):
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                times[name] = statistics.median(ts) * 1e3
            nbytes = n * block_bytes * layers
            results.append({"backend": backend, "loaded": True, "exact": exact,
                            "gather_ms": times["gather"], "scatter_ms": times["scatter"],
                            "gather_GBps": nbytes / times["gather"] / 1e6,
                            "copies": n * layers * (2 if device.type == "cuda" else 1)})
    finally:
        if saved is None:
            os.environ.pop(copy_select.ENV_VAR, None)
        else:
            os.environ[copy_select.ENV_VAR] = saved
        copy_select._select.cache_clear()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    from vllm_hybridcache.ops import copy_select

    print(f"device {device} ({copy_select.platform_of(device)}), default backend "
          f"{copy_select.select(device)[0]}, torch {torch.__version__}")
    bad = 0
    for r in run(device, args.layers, args.heads, args.dim, args.block, args.tokens, args.reps):
        if not r["loaded"]:
            print(f"copy {r['backend']:7s} not available: {r['error']}")
            continue
        bad += not r["exact"]
        print(f"copy {r['backend']:7s} {'bit-exact' if r['exact'] else 'MISMATCH '} "
              f"gather {r['gather_ms']:8.3f} ms ({r['gather_GBps']:.1f} GB/s)  "
              f"scatter {r['scatter_ms']:8.3f} ms  ({r['copies']} block pieces)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
