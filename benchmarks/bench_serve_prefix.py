"""vLLM's own benchmark client against the compared servers: shared prefixes that are not
message-delimited (issue 17).

For each system a server is started (`benchmarks/servers.py`: the same model and flags but
the cache's), then `vllm bench serve` runs, one request at a time:

- `prefix`: `--dataset-name prefix_repetition` (a few random prefixes, each followed by
  random suffixes), as a user evaluating a prefix cache would run it;
- `resend`: the same dataset with suffix length 0, i.e. identical prompts sent again.

Each run starts from an empty cache (`POST /reset_prefix_cache`, which empties the plugin's
cache too).

The fraction of prompt tokens served from a cache comes from the server's own counters
(`vllm:prompt_tokens_cached_total` over `vllm:prompt_tokens_total`, read before and after each
run); TTFT medians come from `vllm bench serve`'s result file. Systems: `native` (vLLM's prefix
caching, where vLLM can run it), `nocache`, `ours` (`--plugin hybridcache` with its defaults:
for a bf16 Flash-Next on a CPU host without a bf16 GEMM of its own, the split-invariant
forward and fine segmentation), `ours-step` (Flash-Next's split-invariant forward off: step
segmentation), `ours-fine` (that forward forced on) and `ours-pinned` (vLLM's CPU attention
pinned: fine segmentation for Qwen3-Next).

    python -m benchmarks.bench_serve_prefix --model flash-next-tiny --systems ours ours-step \\
        nocache --out docs/benchmarks/bench-serve-prefix.md
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import requests

from benchmarks.servers import (
    SYSTEMS,
    ServerSettings,
    SystemSpec,
    reset_cache,
    running_server,
    vllm_command,
)


def system(name: str) -> SystemSpec:
    return SYSTEMS[name]


def counters(base_url: str) -> tuple[float, float]:
    """(prompt tokens, prompt tokens served from a cache) so far, from /metrics."""
    text = requests.get(base_url + "/metrics", timeout=10).text

    def total(name: str) -> float:
        pat = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
        return sum(float(v) for v in pat.findall(text))

    return total("vllm:prompt_tokens_total"), total("vllm:prompt_tokens_cached_total")


def restores(base_url: str) -> tuple[float, float] | None:
    """(restores, their seconds) so far from the plugin's /v1/cache/stats; None without the
    plugin."""
    try:
        r = requests.get(base_url + "/v1/cache/stats", timeout=10)
    except requests.RequestException:
        return None
    if r.status_code != 200:
        return None
    count = total = 0.0
    for tier in r.json().get("tiers", {}).values():   # a tier's totals over its kinds
        seconds = tier.get("restore_seconds") or {}
        count += float(seconds.get("count", 0))
        total += float(seconds.get("sum", 0.0))
    return count, total


def bench(settings: ServerSettings, base_url: str, args, suffix: int, tmp: Path,
          tag: str) -> dict:
    """One `vllm bench serve` run; its figures and the cache counters' difference: the share
    of prompt tokens served from a cache, the tokens each request still prefilled (what the
    hit's depth leaves), and with the plugin the mean time of a restore's copies."""
    argv = [vllm_command(settings), "bench", "serve", "--backend", "vllm",
            "--base-url", base_url, "--model", settings.served_name,
            "--tokenizer", settings.model_path, "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(suffix),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", "1",
            "--seed", "0", "--save-result", "--result-dir", str(tmp),
            "--result-filename", f"{tag}.json"]
    before, restored = counters(base_url), restores(base_url)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    after, restored_after = counters(base_url), restores(base_url)
    result = json.loads((tmp / f"{tag}.json").read_text())
    prompt, cached = after[0] - before[0], after[1] - before[1]
    done = result["completed"]
    restore_ms = None
    if restored is not None and restored_after is not None:
        n = restored_after[0] - restored[0]
        restore_ms = 1000 * (restored_after[1] - restored[1]) / n if n else None
    return {"cmd": " ".join(shlex.quote(a) for a in argv),
            "cached_frac": cached / prompt if prompt else 0.0,
            "prefilled_per_request": (prompt - cached) / done if done else 0.0,
            "restore_ms": restore_ms,
            "ttft_median_ms": result["median_ttft_ms"],
            "completed": done}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flash-next-tiny", help="embedded model name")
    ap.add_argument("--systems", nargs="+", default=["ours", "ours-step", "nocache"])
    ap.add_argument("--prefix-len", type=int, default=3000)
    ap.add_argument("--suffix-len", type=int, default=200)
    ap.add_argument("--num-prefixes", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--out", default=None, help="append the markdown report here")
    args = ap.parse_args(argv)

    from vllm_hybridcache.models import ensure_model

    path = str(ensure_model(args.model))
    settings = ServerSettings(model_path=path, served_name=args.model,
                              max_model_len=max(4096, 2 * (args.prefix_len + args.suffix_len)))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name in args.systems:
            spec = system(name)
            with running_server(spec, settings, tmp / f"{name}.log") as srv:
                for kind, suffix in (("prefix", args.suffix_len), ("resend", 0)):
                    reset_cache(srv.base_url)  # each run from an empty cache
                    r = bench(settings, srv.base_url, args, suffix, tmp, f"{name}-{kind}")
                    rows.append((name, kind, r))
                    print(f"{args.model} {name:10s} {kind:7s} cached {r['cached_frac']:.3f} "
                          f"prefilled {r['prefilled_per_request']:.0f} a request "
                          f"TTFT median {r['ttft_median_ms']:.0f} ms "
                          f"({r['completed']} requests)", flush=True)
    lines = [f"### {args.model}: prefix_repetition (prefix {args.prefix_len}, suffix "
             f"{args.suffix_len}, {args.num_prefixes} prefixes, {args.num_prompts} prompts, "
             f"output {args.output_len}, concurrency 1) and resend (suffix 0)", "",
             "| system | run | prompt tokens cached | tokens prefilled a request (mean) | "
             "restore ms (mean) | TTFT median ms |",
             "|---|---|---|---|---|---|"]
    for name, kind, r in rows:
        restore = "" if r["restore_ms"] is None else f"{r['restore_ms']:.2f}"
        lines.append(f"| {name} | {kind} | {r['cached_frac']:.3f} | "
                     f"{r['prefilled_per_request']:.0f} | {restore} | "
                     f"{r['ttft_median_ms']:.0f} |")
    lines += ["", "```", "python -m benchmarks.bench_serve_prefix " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])), "```", ""]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
