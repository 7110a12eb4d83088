"""The README's headline: ours against vLLM's own prefix caching, per trace family, one run.

    python -m benchmarks.headline [--model qwen3-next-tiny] [--size ci] [--against native]

Reads the trace-replay results `python -m benchmarks.run --trace all --systems native,ours`
wrote (docs/benchmarks/results/replay/<model>-<family>-<size>.json), checks that both systems
come from the same run (the same command and start), and writes one figure side by side per
family (beside them): cached
share of the prompt tokens, TTFT p50, end-to-end time and server CPU seconds, ours next to the
other system; prints the table the README quotes. Nothing is measured here: the figures are
the run's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.results import REPLAY

OUT = REPLAY
FAMILIES = ("coding-agent", "chat-ui", "sub-agents", "interleaved", "concurrent")
METRICS = (("cached_fraction", "cached share of prompt tokens", 100.0, "%"),
           ("ttft_p50_ms", "TTFT p50", 1.0, "ms"),
           ("e2e_s", "end-to-end time", 1.0, "s"),
           ("server_cpu_s", "server CPU", 1.0, "s"))


def load(model: str, size: str, systems: tuple[str, str], folder: Path = OUT
         ) -> tuple[dict[str, dict[str, dict]], set[str]]:
    """{family: {system: summary (server_cpu_s included)}} of the families that have both
    systems, and the commands they came from."""
    rows: dict[str, dict[str, dict]] = {}
    commands: set[str] = set()
    for fam in FAMILIES:
        path = folder / f"{model}-{fam}-{size}.json"
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        got = {s["name"]: {**s["summary"], "server_cpu_s": s.get("server_cpu_s")}
               for s in doc["systems"] if s.get("summary") and not s.get("error")}
        if all(name in got for name in systems):
            rows[fam] = {name: got[name] for name in systems}
            commands.add(f"{doc['command']} ({doc['started_utc'][:10]}, git "
                         f"{doc['git_commit'][:12]})")
    return rows, commands


def table(rows: dict[str, dict[str, dict]], systems: tuple[str, str]) -> str:
    ours, other = systems
    head = (f"| family | cached, {ours} / {other} | TTFT p50 (ms), {ours} / {other} (ratio) | "
            f"end-to-end (s) | server CPU (s) |\n|---|---|---|---|---|")
    lines = [head]
    for fam, r in rows.items():
        a, b = r[ours], r[other]
        lines.append(
            f"| {fam} | {100 * a['cached_fraction']:.1f}% / {100 * b['cached_fraction']:.1f}% | "
            f"{a['ttft_p50_ms']:.0f} / {b['ttft_p50_ms']:.0f} "
            f"({a['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x) | "
            f"{a['e2e_s']:.2f} / {b['e2e_s']:.2f} | "
            f"{a['server_cpu_s']:.2f} / {b['server_cpu_s']:.2f} |")
    return "\n".join(lines)


def plot(rows: dict[str, dict[str, dict]], systems: tuple[str, str], path: Path,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fams = list(rows)
    x = np.arange(len(fams))
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.6))
    for ax, (key, label, scale, unit) in zip(axes, METRICS, strict=True):
        for i, name in enumerate(systems):
            vals = [scale * float(rows[f][name][key] or 0.0) for f in fams]
            ax.bar(x + (i - 0.5) * 0.38, vals, 0.38, label=name)
        ax.set_title(f"{label} ({unit})", fontsize=10)
        ax.set_xticks(x, fams, rotation=30, ha="right", fontsize=8)
    axes[0].legend(fontsize=8, loc="lower left", framealpha=0.9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-next-tiny")
    ap.add_argument("--size", default="ci")
    ap.add_argument("--ours", default="ours")
    ap.add_argument("--against", default="native")
    args = ap.parse_args(argv)
    systems = (args.ours, args.against)
    rows, commands = load(args.model, args.size, systems)
    if not rows:
        print(f"no result of {systems} for {args.model} ({args.size}) in {OUT}", file=sys.stderr)
        return 1
    if len(commands) != 1:
        print(f"the families come from {len(commands)} runs, not one: {sorted(commands)}",
              file=sys.stderr)
        return 1
    path = OUT / f"headline-{args.model}-{args.size}.png"
    plot(rows, systems, path, f"{args.model}, {args.size} traces: {args.ours} vs "
                              f"{args.against}, one run")
    print(next(iter(commands)))
    print(table(rows, systems))
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
