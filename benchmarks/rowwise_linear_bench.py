"""The row-invariant CPU linear against torch's GEMM and against the 64-row tiles it replaced.

Why: Flash-Next's split-invariant forward runs every GEMM on our kernel
(csrc/rowwise_linear_cpu.cpp) instead of torch's (`F.linear`: MKL / oneDNN, the default
forward's) or padded 64-row tiles of torch's (its former form). The whole-prefill benchmark
(`split_invariance_bench`) says what the forward costs; this says where the GEMMs stand, at
Flash-Next's projection shapes, for a prefill step (`--rows`, default 1024) and for a
decode-sized call (4 rows). Medians over `--reps` interleaved runs (one of each per round)
after a warm-up, at each thread count of `--threads`; ratios are to torch's `F.linear` (< 1:
faster). Every arm is checked against float64 (max abs error printed).

    python -m benchmarks run rowwise-linear
    python -m benchmarks run rowwise-linear --shapes flash-next-2048 --threads 1 2
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.copy_bench import _medians_ms  # interleaved medians, after a warm-up

# name: [(in features, out features, what)] of one layer's projections
SHAPES: dict[str, list[tuple[int, int, str]]] = {
    "flash-next-tiny": [(256, 1024, "mixed qkv-sized"), (256, 512, "expert w13"),
                        (256, 256, "expert w2 / o_proj"), (256, 4, "router")],
    "flash-next-small": [(1024, 2048, "attention q"), (1024, 1024, "expert w13"),
                         (512, 1024, "expert w2"), (1024, 8, "router")],
    "flash-next-2048": [(2048, 4096, "attention q (16 x 256)"), (2048, 1024, "expert w13"),
                        (512, 2048, "expert w2")],
}

TILE = 64


def _tiled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from vllm_hybridcache.flash_next.ops.split_invariant import row_tiles

    return row_tiles(lambda rows: torch.nn.functional.linear(rows, w), x, tile=TILE)


def measure(shapes: list[str], rows: list[int], threads: list[int], dtypes: list[str],
            reps: int) -> list[str]:
    from vllm_hybridcache.ops.rowwise_linear import rowwise_linear

    lines = ["| shape | rows | dtype | threads | torch ms | tiles ms | ours ms | ours/torch | "
             "tiles/torch | max err ours / torch |", "|---|---|---|---|---|---|---|---|---|---|"]
    before = torch.get_num_threads()
    try:
        for name in shapes:
            for k, n, what in SHAPES[name]:
                for m in rows:
                    for dt in dtypes:
                        dtype = getattr(torch, dt)
                        g = torch.Generator().manual_seed(0)
                        x = torch.randn(m, k, generator=g).to(dtype)
                        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
                        ref = torch.nn.functional.linear(x.double(), w.double())
                        err_ours = (rowwise_linear(x, w).double() - ref).abs().max().item()
                        err_torch = (torch.nn.functional.linear(x, w).double()
                                     - ref).abs().max().item()
                        for th in threads:
                            torch.set_num_threads(th)
                            t = _medians_ms({
                                "torch": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                                "tiles": lambda x=x, w=w: _tiled(x, w),
                                "ours": lambda x=x, w=w: rowwise_linear(x, w),
                            }, reps)
                            lines.append(
                                f"| {name} {k}x{n} ({what}) | {m} | {dt} | {th} | "
                                f"{t['torch']:.3f} | {t['tiles']:.3f} | {t['ours']:.3f} | "
                                f"{t['ours'] / t['torch']:.2f} | "
                                f"{t['tiles'] / t['torch']:.2f} | "
                                f"{err_ours:.2e} / {err_torch:.2e} |")
    finally:
        torch.set_num_threads(before)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["flash-next-tiny", "flash-next-small"],
                    choices=sorted(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=[1024, 4])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"load average before: {load:.2f}; {os.cpu_count()} CPUs")
    for line in measure(args.shapes, args.rows, args.threads, args.dtypes, args.reps):
        print(line, flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
