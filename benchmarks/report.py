"""The benchmark report: one JSON file, one markdown table, two PNG plots per (model, trace).

The JSON holds everything (command, model, trace digest, settings, each server's command line,
every request's numbers), so a reader can recompute any figure; the markdown and the plots are
views of it. Fractions are token-weighted over the whole trace (cached tokens / prompt tokens),
not averages of per-request fractions, because the cost of a prefill is per token.
TTFT percentiles use linear interpolation between the ranked requests (numpy's default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from benchmarks.replay import RequestResult

SCHEMA_VERSION = 1


class SystemSummary(msgspec.Struct):
    """The report's row for one system (see docs/benchmarks.md for each column)."""

    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int | None
    cached_fraction: float | None
    ideal_tokens: int
    ideal_fraction: float | None
    cached_of_ideal: float | None
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_mean_ms: float | None
    e2e_s: float | None
    """Wall-clock time of the whole replay (all waves), warm-up excluded."""
    request_time_s: float | None
    """Sum of the requests' own end-to-end times."""
    peak_snapshot_bytes: int | None
    prompt_mismatches: int
    """Requests whose server prompt ids differ from the local rendering (should be 0)."""
    cached_above_ideal: int
    """Requests that report more cached tokens than the ideal allows (should be 0: a cache
    cannot serve tokens the server never saw; non-zero means a leaked cache or a miscount)."""


class SystemRun(msgspec.Struct):
    """One system's part of the report."""

    name: str
    description: str
    base_url: str | None = None
    started_by_runner: bool = False
    argv: list[str] | None = None
    log: str | None = None
    startup_s: float | None = None
    error: str | None = None
    """Why this system produced no measurements (did not start, replay failed)."""
    cache_stats_route: bool = False
    peak_snapshot_bytes_by_tier: dict[str, int] = msgspec.field(default_factory=dict)
    cache_state: str = ""
    """How the cache started: 'fresh server', 'reset' (POST /reset_prefix_cache) or 'not reset'."""
    server_cpu_s: float | None = None
    """CPU seconds the server's processes used during the replay (started servers only): its
    own work, robust to other load on the machine, unlike wall-clock times."""
    load_avg: list[float] = msgspec.field(default_factory=list)
    """1-minute load average before and after the replay (shared machines make TTFT noisy)."""
    load_max: float | None = None
    """Highest 1-minute load average sampled during the replay (once a second)."""
    summary: SystemSummary | None = None
    requests: list[RequestResult] = msgspec.field(default_factory=list)
    overhead: dict[str, Any] | None = None
    """The plugin's own seconds in the engine's steps during the replay, by side and phase,
    with its `share` of the step time (servers with the plugin's stats route only)."""


LOAD_LIMIT = 2.0
"""Above this 1-minute load average (on the 2-core machines these results come from) another
job shared the cores: wall-clock figures (TTFT, end-to-end) and even server CPU seconds are
not comparable across systems, so the run is flagged in its report and in the index."""


def peak_load(run: SystemRun) -> float | None:
    """The highest load average recorded for this system's replay, or None if none was."""
    seen = [*run.load_avg, *([run.load_max] if run.load_max is not None else [])]
    return max(seen) if seen else None


def loaded(run: SystemRun) -> bool:
    """Whether the replay ran on a machine busier than LOAD_LIMIT (see there)."""
    peak = peak_load(run)
    return peak is not None and peak > LOAD_LIMIT


class Report(msgspec.Struct):
    schema: int
    command: str
    started_utc: str
    finished_utc: str
    git_commit: str | None
    vllm_version: str | None
    host: dict[str, Any]
    model: dict[str, str]
    trace: dict[str, Any]
    settings: dict[str, Any]
    systems: list[SystemRun]


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[RequestResult], wall_s: float | None,
              peak_bytes: int | None) -> SystemSummary:
    """Totals and percentiles over the requests that succeeded."""
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.local_prompt_tokens
                 for r in ok)
    cached_known = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    cached = sum(cached_known) if ok and len(cached_known) == len(ok) else None
    ideal = sum(r.ideal_tokens for r in ok)
    ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    times = [r.e2e_s for r in ok if r.e2e_s is not None]
    return SystemSummary(
        requests=len(results),
        errors=len(results) - len(ok),
        prompt_tokens=prompt,
        cached_tokens=cached,
        cached_fraction=(cached / prompt) if cached is not None and prompt else None,
        ideal_tokens=ideal,
        ideal_fraction=(ideal / prompt) if prompt else None,
        cached_of_ideal=(cached / ideal) if cached is not None and ideal else None,
        ttft_p50_ms=_pct(ttfts, 50),
        ttft_p95_ms=_pct(ttfts, 95),
        ttft_mean_ms=float(np.mean(ttfts)) if ttfts else None,
        e2e_s=wall_s,
        request_time_s=float(sum(times)) if times else None,
        peak_snapshot_bytes=peak_bytes,
        prompt_mismatches=sum(1 for r in ok if r.prompt_ids_match is False),
        cached_above_ideal=sum(1 for r in ok
                               if r.cached_tokens is not None and r.cached_tokens > r.ideal_tokens),
    )


def _fmt(value: float | int | None, kind: str = "") -> str:
    if value is None:
        return "n/a"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "ms":
        return f"{value:.1f}"
    if kind == "s":
        return f"{value:.2f}"
    if kind == "bytes":
        v = float(value)
        for unit in ("B", "KiB", "MiB", "GiB"):
            if v < 1024 or unit == "GiB":
                return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
            v /= 1024
    return f"{value:,}" if isinstance(value, int) else str(value)


def stem(report: Report) -> str:
    """File name stem: model-family-size (plus history mode and seed when not the defaults)."""
    parts = [report.model["name"], report.trace["family"], report.trace["size"]]
    if report.settings.get("history") != "scripted":
        parts.append(str(report.settings.get("history")))
    if report.trace.get("seed"):
        parts.append(f"seed{report.trace['seed']}")
    return "-".join(p.replace("/", "_") for p in parts)


def markdown(report: Report, plots: dict[str, str]) -> str:
    t, s = report.trace, report.settings
    lines = [
        f"# {t['family']} ({t['size']}) on {report.model['name']}",
        "",
        f"- Command: `{report.command}`",
        f"- Run: {report.started_utc} to {report.finished_utc}, git {report.git_commit or 'n/a'},"
        f" vLLM {report.vllm_version or 'n/a'}, host {report.host.get('summary', 'n/a')}",
        f"- Model: `{report.model['name']}` ({report.model['path']})",
        f"- Trace: {t['family']} — {t['description']}; size {t['size']}, seed {t['seed']}, "
        f"digest `{t['digest']}`; {t['requests']} requests in {t['waves']} waves over "
        f"{t['sessions']} sessions; {t['prompt_tokens']:,} prompt tokens, longest prompt "
        f"{t['max_prompt_tokens']:,}",
        f"- Settings: history `{s['history']}`, max_tokens {s['max_tokens']} (greedy, "
        f"ignore_eos), tool_choice `{s['tool_choice']}`, max_model_len {s['max_model_len']}"
        + (f", extra server args `{' '.join(s['extra_server_args'])}`"
           if s.get("extra_server_args") else ""),
        "",
        "| system | requests | errors | prompt tokens | cached tokens | cached | ideal "
        "| cached / ideal | TTFT p50 (ms) | TTFT p95 (ms) | end-to-end (s) | server CPU (s) "
        "| peak snapshot | plugin share of step time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report.systems:
        m = run.summary
        if m is None:
            lines.append(f"| {run.name} | | | | | | | | | | | | no result: "
                         f"{(run.error or 'unknown').splitlines()[0][:120]} | |")
            continue
        lines.append(
            f"| {run.name} | {m.requests} | {m.errors} | {_fmt(m.prompt_tokens)} | "
            f"{_fmt(m.cached_tokens)} | {_fmt(m.cached_fraction, 'pct')} | "
            f"{_fmt(m.ideal_fraction, 'pct')} | {_fmt(m.cached_of_ideal, 'pct')} | "
            f"{_fmt(m.ttft_p50_ms, 'ms')} | {_fmt(m.ttft_p95_ms, 'ms')} | "
            f"{_fmt(m.e2e_s, 's')} | {_fmt(run.server_cpu_s, 's')} | "
            f"{_fmt(m.peak_snapshot_bytes, 'bytes')} | {_fmt(overhead_share(run), 'pct')} |")
    lines.append("")
    for title, name in plots.items():
        lines += [f"![{title}]({name})", ""]
    lines.append("Systems:")
    lines.append("")
    for run in report.systems:
        how = f"`{' '.join(run.argv)}`" if run.argv else f"remote server {run.base_url}"
        lines.append(f"- **{run.name}**: {run.description}. {how}")
        notes = []
        if run.cache_state:
            notes.append(f"cache at start: {run.cache_state}")
        if run.startup_s is not None:
            notes.append(f"server start-up {run.startup_s:.0f} s")
        if run.load_avg:
            note = f"load average {run.load_avg[0]} before, {run.load_avg[-1]} after"
            if run.load_max is not None:
                note += f", at most {run.load_max} during"
            if loaded(run):
                note += f" (above {LOAD_LIMIT}: timings not comparable)"
            notes.append(note)
        if overhead_note(run):
            notes.append(overhead_note(run))
        if run.peak_snapshot_bytes_by_tier:
            notes.append("peak snapshot bytes by tier: " + ", ".join(
                f"{k} {_fmt(v, 'bytes')}" for k, v in run.peak_snapshot_bytes_by_tier.items()))
        if notes:
            lines.append("  - " + "; ".join(notes))
        m = run.summary
        if m and m.prompt_mismatches:
            lines.append(f"  - {m.prompt_mismatches} prompts rendered differently by the server "
                         "than locally; the ideal uses the server's token ids.")
        if m and m.cached_above_ideal:
            lines.append(f"  - {m.cached_above_ideal} requests report more cached tokens than "
                         "the ideal: check the cache reset and the counter.")
        if run.error:
            lines.append(f"  - error: {run.error.splitlines()[0][:300]}")
    lines.append("")
    lines.append("How to read this: docs/benchmarks.md.")
    return "\n".join(lines) + "\n"


COLORS = {"native": "tab:blue", "nocache": "tab:orange", "ours": "tab:green",
          "ours-grid": "tab:olive", "ours-msgend": "tab:cyan"}


def _session_starts(ax: Any, results: list[RequestResult]) -> None:
    """Thin vertical lines where a session sends its first request (a new conversation)."""
    seen: set[str] = set()
    for r in results:
        if r.session not in seen:
            seen.add(r.session)
            if r.index:
                ax.axvline(r.index - 0.5, color="grey", linewidth=0.6, alpha=0.5)


def plot(report: Report, out_dir: Path, name_stem: str) -> dict[str, str]:
    """cached fraction per request (with the ideal) and TTFT per request, one line per system.

    Colours are fixed per system so figures of different runs read the same way; grey vertical
    lines mark the first request of each session."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = [r for r in report.systems if r.requests]
    title = (f"{report.model['name']} · {report.trace['family']} ({report.trace['size']}) · "
             f"history {report.settings['history']}")
    files: dict[str, str] = {}
    if not runs:
        return files

    fig, ax = plt.subplots(figsize=(10, 4.2))
    for run in runs:
        xs = [r.index for r in run.requests if r.error is None and r.cached_tokens is not None]
        ys = [r.cached_tokens / r.prompt_tokens for r in run.requests
              if r.error is None and r.cached_tokens is not None and r.prompt_tokens]
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label=run.name,
                color=COLORS.get(run.name))
    base = runs[0].requests
    _session_starts(ax, base)
    ax.plot([r.index for r in base],
            [r.ideal_tokens / max(1, r.local_prompt_tokens) for r in base],
            color="black", linestyle="--", linewidth=1, label="ideal")
    ax.set_ylim(-0.02, 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("request (trace order)")
    ax.set_ylabel("prompt tokens served from cache")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    name = f"{name_stem}-cached.png"
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    files["cached fraction per request"] = name

    fig, ax = plt.subplots(figsize=(10, 4.2))
    for run in runs:
        pts = [(r.index, r.ttft_s * 1000) for r in run.requests
               if r.error is None and r.ttft_s is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, linewidth=1.2,
                    label=run.name, color=COLORS.get(run.name))
    _session_starts(ax, runs[0].requests)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("request (trace order)")
    ax.set_ylabel("time to first token (ms, log)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", fontsize=8)
    name = f"{name_stem}-ttft.png"
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    files["TTFT per request"] = name
    return files


def write(report: Report, out_dir: Path) -> dict[str, Path]:
    """Write JSON, markdown and PNGs; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = stem(report)
    plots = plot(report, out_dir, name)
    json_path = out_dir / f"{name}.json"
    json_path.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n")
    md_path = out_dir / f"{name}.md"
    md_path.write_text(markdown(report, plots), encoding="utf-8")
    paths = {"json": json_path, "markdown": md_path}
    paths.update({k: out_dir / v for k, v in plots.items()})
    return paths


def overhead_share(run: SystemRun) -> float | None:
    """The plugin's share of the engine's step time during the run (None without the
    plugin's stats route)."""
    return None if run.overhead is None else run.overhead.get("share")


def overhead_note(run: SystemRun) -> str | None:
    """Where the plugin's own seconds went during the run, largest first."""
    o = run.overhead
    if not o:
        return None
    parts = sorted(((v, f"{side.removesuffix('_s')} {k}") for side in ("scheduler_s", "worker_s")
                    for k, v in o.get(side, {}).items() if v > 0), reverse=True)
    if not parts:
        return None
    return (f"plugin seconds in {o.get('steps', 0)} steps ({o.get('busy_s', 0.0):.2f} s busy): "
            + ", ".join(f"{name} {v:.3f} s" for v, name in parts))


def load(path: Path) -> Report:
    """Read a report back (the slow test and docs tooling use it)."""
    return msgspec.json.decode(path.read_bytes(), type=Report)


def write_index(out_dir: Path) -> Path:
    """The replays' index (docs/benchmarks/results/replay/README.md): one line per (report,
    system), rebuilt from the JSON files.

    Rebuilt from what is on disk rather than appended to, so a rerun replaces its own lines and
    the index never lists a result whose files are gone.
    """
    rows = []
    for path in sorted(out_dir.glob("*.json")):
        try:
            r = load(path)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        for run in r.systems:
            m = run.summary
            cells = [r.model["name"], r.trace["family"], r.trace["size"], r.settings["history"],
                     run.name]
            if m is None:
                cells += ["", "", "", "", "", "", "", "", "", "no result"]
            else:
                cells += [str(m.requests), str(m.errors), _fmt(m.cached_fraction, "pct"),
                          _fmt(m.ideal_fraction, "pct"), _fmt(m.ttft_p50_ms, "ms"),
                          _fmt(m.ttft_p95_ms, "ms"), _fmt(m.e2e_s, "s"),
                          _fmt(run.server_cpu_s, "s"), _fmt(m.peak_snapshot_bytes, "bytes"),
                          _fmt(overhead_share(run), "pct")]
            peak = peak_load(run)
            cells += [(r.git_commit or "?")[:8], r.started_utc[:10],
                      "" if peak is None else f"{peak:.1f}" + (" (loaded)" if loaded(run) else "")]
            cells.append(f"[{path.stem}]({path.stem}.md)")
            rows.append("| " + " | ".join(cells) + " |")
    text = "\n".join([
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.run` from the JSON files in this folder; how to read "
        "them: [../../../benchmarks.md](../../../benchmarks.md). `commit` and `date` say which "
        "code a row "
        "measured; `plugin share` the plugin's own seconds as a share of the engine's step time "
        "(servers with the plugin's stats route); `load` is the highest 1-minute load average "
        "recorded during that system's "
        f"replay, and `(loaded)` marks one above {LOAD_LIMIT}, whose timings are not comparable "
        "with the other systems'.",
        "",
        "| model | trace | size | history | system | requests | errors | cached | ideal "
        "| TTFT p50 (ms) | TTFT p95 (ms) | end-to-end (s) | server CPU (s) | peak snapshot "
        "| plugin share | commit | date | load | report |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|",
        *rows,
        "",
    ])
    index = out_dir / "README.md"
    index.write_text(text, encoding="utf-8")
    return index


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.report FILE.json ...`: redraw the markdown and PNGs of saved runs
    (after a change to the plots, or on another machine) without replaying anything."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=main.__doc__)
    p.add_argument("reports", nargs="+", type=Path)
    args = p.parse_args(argv)
    for path in args.reports:
        write(load(path), path.parent)
    for folder in {path.parent for path in args.reports}:
        write_index(folder)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
