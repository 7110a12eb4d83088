"""Plots of the disk tier benchmarks, from the JSON lines they printed (kept in docs/benchmarks/).

- restart (`disk_restart_bench`): next-turn latency per head size, cold / RAM-warm / disk after
  a restart, one group of bars per head, log scale (cold is 10-100x the others);
- spill (`disk_spill_bench`): a live conversation's next turn after a restart, one bar per way
  it can be served (end anchor from disk, tree links only, RAM anchor, cold), median of the runs
  with every run's value as a dot;
- writer (`disk_writer_bench`): TTFT p50 of each replay with the tier writing vs off.

Usage: python -m benchmarks.disk_plots --restart FILE.json [...] --spill FILE.jsonl
       --writer FILE.jsonl --out docs/benchmarks
Each FILE holds one JSON object per line (one benchmark run each).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _runs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_restart(run: dict, out: Path) -> None:
    plt = _plt()
    from matplotlib.ticker import ScalarFormatter

    heads = [str(h) for h in run["heads"]]
    series = [("cold", "cold_s"), ("RAM-warm", "ram_warm_s"), ("disk after restart", "disk_s")]
    if all("ram_promoted_s" in run["by_head"][h] for h in heads):  # runs since 2026-12-01
        series.append(("promoted RAM\n(after the disk hit)", "ram_promoted_s"))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(heads))]
        ys = [run["by_head"][h][key] for h in heads]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7)
    ax.set_xticks(range(len(heads)), [f"{int(h):,} tokens" for h in heads])
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set_ylabel("next-turn latency (s, log scale)")
    ax.set_title(f"restart: next turn on {run['model']} (head + {run['tail']} tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_spill(runs: list[dict], out: Path) -> None:
    plt = _plt()
    series = (("end anchor\nfrom disk", "spill_s"), ("tree links\nonly", "tree_only_s"),
              ("RAM anchor\n(no restart)", "ram_anchor_s"), ("cold", "cold_s"))
    fig, ax = plt.subplots(figsize=(7, 4))
    meds = [statistics.median(r[k] for r in runs) for _, k in series]
    bars = ax.bar(range(len(series)), meds, 0.6)
    ax.bar_label(bars, labels=[f"{m:.3f}" for m in meds], fontsize=8)
    for i, (_, k) in enumerate(series):
        ax.scatter([i] * len(runs), [r[k] for r in runs], color="black", s=10, zorder=3)
    ax.set_xticks(range(len(series)), [s for s, _ in series])
    ax.set_ylabel("next-turn latency (s)")
    r0 = runs[0]
    ax.set_title(f"session spill: next turn after a restart\n{r0['model']}, "
                 f"{r0['head'] + r0['tail']:,}-token conversation, median of {len(runs)} "
                 "runs (dots: each run)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_writer(runs: list[dict], out: Path) -> None:
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("off", "tab:blue"), ("on", "tab:orange")):
        ys = [y for r in runs for y in r["ttft_p50_ms"][name]]
        ax.scatter(range(len(ys)), ys, label=f"tier {name} (median {statistics.median(ys):.1f})",
                   color=color)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("replay (each side, in the order run)")
    ax.set_ylabel("TTFT p50 of the replay (ms)")
    r0 = runs[0]
    ax.set_title(f"writer cost: {r0['trace']} ({r0['size']}) on {r0['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--restart", type=Path, action="append", default=[])
    ap.add_argument("--spill", type=Path)
    ap.add_argument("--writer", type=Path)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args(argv)
    for path in args.restart:
        for run in _runs(path):
            plot_restart(run, args.out / f"disk-restart-{run['model']}.png")
    if args.spill:
        plot_spill(_runs(args.spill), args.out / "disk-spill.png")
    if args.writer:
        plot_writer(_runs(args.writer), args.out / "disk-writer.png")
    return 0


if __name__ == "__main__":
    main()
