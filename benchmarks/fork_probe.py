"""The fork probe (issue 33): forks of one conversation must not multiply K/V.

One server per system (`native`: vLLM 0.32 with `--enable-prefix-caching`; `ours`:
`--plugin hybridcache`), same model, same KV space (`VLLM_CPU_KVCACHE_SPACE`), so vLLM's
`vllm:kv_cache_usage_perc` is a fraction of the same bytes in both. Per server:

1. the head (`--head` tokens) is sent, 2 tokens generated (`return_token_ids`): it leaves a
   tree link at its last cut (the head's end, a grid multiple by default) and an end anchor
   one token deeper (the head and its first generated token);
2. for each N of `--sessions` (default 4, 8, 16), N requests arrive together, each the head,
   its first generated token and a suffix of its own (`--suffix` tokens), `--gen` tokens
   generated. The head is sent again before every wave: a fork's own end anchor replaces the
   head's (it extends its tokens), so without it only the first wave would meet the anchor.
   A poller reads `/metrics` every `--poll-s` seconds while they run; the peak of
   `vllm:kv_cache_usage_perc` over the wave is the figure compared. Each request's
   `cached_tokens` says whether it hit.

Before issue 33 every fork resumed from the anchor (the deepest hit) and copied the whole
head's K/V into blocks of its own: peak K/V 2.67x native's at N = 6. The goal: ours <= 1.1x
native, every request a hit. Waves run one after another on one server: the previous wave's
blocks are freed (cached, evictable: not counted in the usage) before the next one starts.

    python -m benchmarks.fork_probe [--model qwen3-next-tiny] [--sessions 4 8 16]
        [--out docs/benchmarks/fork-probe-qwen3-next-tiny.json]

The pure parts (prompts, metric parsing, the summary table) are tested in
tests/benchmarks/test_fork_probe.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

USAGE_METRIC = "vllm:kv_cache_usage_perc"
GOAL_RATIO = 1.1  # issue 33: peak K/V of ours at most this times native's


def head_tokens(n: int, seed: int = 0) -> list[int]:
    """A deterministic head of `n` token ids (ids 100..3599: inside every tiny vocabulary)."""
    return [100 + (i * 7919 + seed * 104729) % 3500 for i in range(n)]


def fork_prompts(head: list[int], first: int, n: int, suffix: int,
                 wave: int = 0) -> list[list[int]]:
    """`n` forks of a head: the head, its first generated token `first`, and a suffix of
    `suffix` tokens of each fork's own (distinct across forks and waves, so no fork's own end
    anchor or links serve another)."""
    out = []
    for k in range(n):
        seed = 1 + wave * 1000 + k
        own = [100 + (i * 6007 + seed * 15485863) % 3500 for i in range(suffix)]
        out.append([*head, first, *own])
    return out


def parse_usage(text: str) -> float | None:
    """The largest `vllm:kv_cache_usage_perc` sample in a Prometheus text page (one per
    engine), or None when the page has none."""
    best = None
    for line in text.splitlines():
        if not line.startswith(USAGE_METRIC):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name != USAGE_METRIC:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        best = value if best is None else max(best, value)
    return best


def summarize(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per N: each system's peak usage, hits and median TTFT, and ours/native."""
    rows = []
    waves = results.get("native", {}).get("waves") or results.get("ours", {}).get("waves") or []
    for i, w in enumerate(waves):
        row: dict[str, Any] = {"sessions": w["sessions"]}
        for system, res in results.items():
            sw = res["waves"][i]
            row[f"{system}_peak"] = sw["peak_usage"]
            row[f"{system}_hits"] = sum(1 for c in sw["cached"] if c > 0)
            row[f"{system}_cached_median"] = statistics.median(sw["cached"])
            row[f"{system}_ttft_median_s"] = statistics.median(sw["ttft_s"])
        if "native" in results and "ours" in results and row["native_peak"]:
            row["ratio"] = row["ours_peak"] / row["native_peak"]
            row["goal_met"] = (row["ratio"] <= GOAL_RATIO
                               and row["ours_hits"] == w["sessions"])
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table (usage in percent of the KV space)."""
    head = ("| N | native peak % | ours peak % | ours/native | native hits | ours hits | "
            "native cached (median) | ours cached (median) | native TTFT p50 s | "
            "ours TTFT p50 s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r['sessions']} | {100 * r['native_peak']:.2f} | {100 * r['ours_peak']:.2f} | "
            f"{r.get('ratio', float('nan')):.2f} | {r['native_hits']}/{r['sessions']} | "
            f"{r['ours_hits']}/{r['sessions']} | {r['native_cached_median']:.0f} | "
            f"{r['ours_cached_median']:.0f} | {r['native_ttft_median_s']:.3f} | "
            f"{r['ours_ttft_median_s']:.3f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ the run (needs servers)
class Poller:
    """Reads /metrics every `period` seconds in a thread; keeps the peak usage seen."""

    def __init__(self, base_url: str, period: float) -> None:
        self.url = base_url + "/metrics"
        self.period = period
        self.peak = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import requests

        while not self._stop.is_set():
            try:
                v = parse_usage(requests.get(self.url, timeout=5).text)
            except requests.RequestException:
                v = None
            if v is not None:
                self.peak = max(self.peak, v)
                self.samples += 1
            self._stop.wait(self.period)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def complete(base_url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: its generated token ids, cached tokens and time to first
    token."""
    import requests

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    ttft = None
    tokens: list[int] = []
    cached = 0
    with requests.post(base_url + "/v1/completions", json=body, stream=True,
                       timeout=1800) as r:
        r.raise_for_status()
        for raw in r.iter_lines():
            if not raw or not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                continue
            chunk = json.loads(raw[6:])
            for ch in chunk.get("choices") or ():
                if ttft is None:
                    ttft = time.monotonic() - t0
                tokens += ch.get("token_ids") or []
            usage = chunk.get("usage")
            if usage:
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                             or 0)
    return {"tokens": tokens, "cached": cached, "ttft_s": ttft if ttft is not None else 0.0}


def probe(base_url: str, model: str, head: list[int], sessions: list[int], suffix: int,
          gen: int, poll_s: float) -> dict[str, Any]:
    """Per N: prime the head (its end anchor), then one wave of N forks."""
    waves = []
    first = None
    for wave, n in enumerate(sessions):
        primed = complete(base_url, model, head, 2)
        if not primed["tokens"]:
            raise RuntimeError("the server returned no token ids (return_token_ids)")
        if first is not None and primed["tokens"][0] != first["tokens"][0]:
            raise RuntimeError("the head's first token changed between waves (greedy)")
        first = first or primed
        time.sleep(1.0)  # the head's end anchor lands with the next step; let it settle
        prompts = fork_prompts(head, first["tokens"][0], n, suffix, wave)
        with Poller(base_url, poll_s) as poller, ThreadPoolExecutor(n) as pool:
            outs = list(pool.map(lambda p: complete(base_url, model, p, gen), prompts))
        waves.append({"sessions": n, "head_cached": primed["cached"],
                      "peak_usage": poller.peak, "samples": poller.samples,
                      "cached": [o["cached"] for o in outs],
                      "ttft_s": [o["ttft_s"] for o in outs]})
        time.sleep(1.0)
    assert first is not None
    return {"first_token": first["tokens"][0], "waves": waves}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import resolve_model
    from benchmarks.servers import SYSTEMS, ServerSettings, running_server

    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="qwen3-next-tiny")
    p.add_argument("--head", type=int, default=6144)
    p.add_argument("--suffix", type=int, default=300)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--sessions", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--systems", nargs="+", default=["native", "ours"])
    p.add_argument("--kv-gib", type=int, default=1)
    p.add_argument("--poll-s", type=float, default=0.05)
    p.add_argument("--logs", default="/tmp/fork_probe_logs")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    path, name = resolve_model(args.model)
    settings = ServerSettings(model_path=path, served_name=name,
                              max_model_len=args.head + 1 + args.suffix + args.gen + 64,
                              kv_cache_space_gib=args.kv_gib)
    head = head_tokens(args.head)
    results: dict[str, dict[str, Any]] = {}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for system in args.systems:
        log = Path(args.logs) / f"{system}.log"
        with running_server(SYSTEMS[system], settings, log) as srv:
            res = probe(srv.base_url, name, head, args.sessions, args.suffix, args.gen,
                        args.poll_s)
            res["startup_s"] = srv.startup_s
            res["argv"] = srv.argv
            results[system] = res
        print(system, json.dumps(res["waves"]), flush=True)
    rows = summarize(results)
    table = markdown(rows) if {"native", "ours"} <= set(results) else ""
    print(table)
    if args.out:
        load = os.getloadavg()
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        Path(args.out).write_text(json.dumps(
            {"started": started, "model": args.model, "head": args.head,
             "suffix": args.suffix, "gen": args.gen, "kv_gib": args.kv_gib,
             "commit": commit, "loadavg_at_end": load, "results": results, "rows": rows},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
