"""Two replicas behind the cluster front, three ways, one run: the cluster tier with routing
vs per-replica caches only (plugin, no cluster tier, round robin) vs stock vLLM with its native
prefix caching per replica (round robin).

Each system is launched exactly as `vllm-hybridcache cluster` launches it (local Ray, two
`vllm serve` replicas, the front on Ray Serve) and replays the sub-agents and concurrent trace
families (benchmarks/traces, the replayer of benchmarks/replay.py) through the front's one
port. Per family it prints: cached tokens as a fraction of the ideal (what one server with an
unbounded exact cache would have served), TTFT p50/p95, requests that failed, and from the
front's `/v1/cache/stats`: turns routed to their owner, the cluster tier's restores, tokens and
bytes it brought from the other replica, the seconds its restores took, and its fetch seconds
(fetch issued to payloads staged and verified) as a fraction of the prefill the remote tokens
would have cost. That prefill cost is measured in the same run on the same replicas: cold
prompts of two lengths (fresh cache_salt), seconds per token from the slope. With the cluster
tier on, a few conversations also have their last turn forced to the other replica (the
transfer case routing avoids), each compared with a cold run of that turn there.

Run: python -m benchmarks.cluster_routing [--model qwen3-next-tiny] [--size ci]
      [--families sub-agents,concurrent] [--systems cluster+routing,per-replica,native-rr]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

SYSTEMS: dict[str, dict[str, Any]] = {
    "cluster+routing": {"plugin": True, "cluster_tier": True, "policy": "affinity",
                        "flags": [], "what": "plugin + cluster tier, routed to the owner"},
    "per-replica": {"plugin": True, "cluster_tier": False, "policy": "round_robin",
                    "flags": [], "what": "plugin, private cache per replica, round robin"},
    "per-replica+routing": {"plugin": True, "cluster_tier": False, "policy": "affinity",
                            "flags": [], "what": "plugin, private caches, routed to the owner"},
    "native-rr": {"plugin": False, "cluster_tier": False, "policy": "round_robin",
                  "flags": ["--enable-prefix-caching"],
                  "what": "stock vLLM 0.32, native prefix caching, round robin"},
}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _cluster_tier(stats: dict[str, Any]) -> dict[str, float]:
    t = stats.get("tiers", {}).get("cluster", {})
    return {"restores": t.get("restores", 0), "tokens": t.get("tokens_served", 0),
            "bytes": t.get("restore_bytes", 0),
            "seconds": (t.get("restore_seconds") or {}).get("sum", 0.0),
            "fetches": t.get("fetches", 0), "fetch_bytes": t.get("fetch_bytes", 0),
            "fetch_s": (t.get("fetch_seconds") or {}).get("sum", 0.0),
            "locate_s": (t.get("locate_seconds") or {}).get("sum", 0.0)}


def _fetch_fraction(remote: dict[str, float], per_token_s: float | None) -> float | None:
    """Remote fetch seconds over the prefill seconds the remote tokens would have cost."""
    saved = remote["tokens"] * per_token_s if per_token_s else 0.0
    return remote["fetch_s"] / saved if saved > 0 else None


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 997 + 100 + i * 7) % 3000 + 10 for i in range(n)]


def cold_prefill_rate(url: str, replicas: list[str], lengths: tuple[int, int] = (512, 2048),
                      reps: int = 3) -> dict[str, Any]:
    """Seconds per prompt token of a cold prefill on each replica: the slope between two
    prompt lengths (median request seconds of `reps` cold runs each, one output token, a fresh
    cache_salt so nothing is cached), which leaves out what a request costs whatever its
    length (HTTP, the sampled token)."""
    import uuid

    import requests

    out: dict[str, Any] = {}
    for name in replicas:
        med = {}
        for n in lengths:
            secs = []
            for r in range(reps):
                t0 = time.perf_counter()
                resp = requests.post(url + "/v1/completions", headers={
                    "x-hybridcache-replica": name}, timeout=600, json={
                    "model": "tiny", "prompt": _prompt(7000 + r, n), "max_tokens": 1,
                    "temperature": 0, "cache_salt": f"cold-{uuid.uuid4().hex}"})
                secs.append(time.perf_counter() - t0)
                resp.raise_for_status()
            med[n] = _pct(secs, 0.5)
        lo, hi = lengths
        out[name] = {"per_token_s": (med[hi] - med[lo]) / (hi - lo), "median_s": med}
    return out


def moved_turns(url: str, stats, conversations: int, turns: int = 4) -> dict[str, Any]:
    """Conversations whose last turn is forced to the other replica: turns 1..k pinned to one
    replica, turn k+1 to the other, once resuming through the cluster tier and once cold
    (fresh cache_salt). Per moved turn: request seconds warm and cold, tokens the cluster
    tier served, fetch seconds and bytes (the other replica's stats before and after)."""
    import uuid

    import requests

    def post(name: str, prompt: list[int], **extra: Any) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        r = requests.post(url + "/v1/completions", headers={"x-hybridcache-replica": name},
                          timeout=600, json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                             "temperature": 0, "return_token_ids": True,
                                             **extra})
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()

    rows = []
    for c in range(conversations):
        a, b = ("r0", "r1") if c % 2 == 0 else ("r1", "r0")
        prompt = _prompt(500 + c, 600)
        for t in range(1, turns):
            post(a, prompt)
            prompt = prompt + [(c * 131 + t * 31 + i * 13) % 3000 + 10 for i in range(300)]
        before = _cluster_tier(stats()["replicas"][b])
        warm_s, warm = post(b, prompt)
        after = _cluster_tier(stats()["replicas"][b])
        cold_s, cold = post(b, prompt, cache_salt=f"cold-{uuid.uuid4().hex}")
        d = {k: after[k] - before[k] for k in after}
        rows.append({"replica": b, "prompt_tokens": len(prompt), "warm_s": warm_s,
                     "cold_s": cold_s, "remote_tokens": d["tokens"], "fetch_s": d["fetch_s"],
                     "fetch_bytes": d["fetch_bytes"], "locate_s": d["locate_s"],
                     "cached": (warm["usage"].get("prompt_tokens_details") or {}).get(
                         "cached_tokens") or 0,
                     "same_token": warm["choices"][0]["token_ids"]
                     == cold["choices"][0]["token_ids"]})
    return {"turns": rows}


def run_system(name: str, model: str, families: list[str], size: str, seed: int,
               grid: int, max_tokens: int, moved: int = 6) -> dict[str, Any]:
    import ray
    import requests

    from benchmarks.ideal import PromptTokenizer
    from benchmarks.replay import ReplayConfig, replay
    from benchmarks.servers import free_port
    from benchmarks.traces import generate
    from vllm_hybridcache.cluster.directory import NAMESPACE
    from vllm_hybridcache.fleet.launcher import Cluster
    from vllm_hybridcache.fleet.routing import Policy

    spec = SYSTEMS[name]
    os.environ["VLLM_HYBRIDCACHE_GRID"] = str(grid)
    os.environ.setdefault("VLLM_HYBRIDCACHE_MESSAGE_END_MIN", "64")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    serve_args = ["--served-model-name", "tiny", "--max-model-len", "16384",
                  "--enable-prompt-tokens-details", "--seed", "0", "--enforce-eager",
                  *spec["flags"]]
    tokenizer = PromptTokenizer(model)
    ray.init(num_cpus=2, object_store_memory=512 << 20, include_dashboard=False,
             namespace=NAMESPACE, log_to_driver=False)
    out: dict[str, Any] = {"system": name, "what": spec["what"], "families": {}}
    cluster = None
    try:
        t0 = time.perf_counter()
        cluster = Cluster(model, 2, serve_args, plugin=spec["plugin"],
                          cluster_tier=spec["cluster_tier"])
        url = cluster.serve_front("127.0.0.1", free_port("127.0.0.1", 8480),
                                  Policy(spec["policy"]))
        out["startup_s"] = time.perf_counter() - t0

        def stats() -> dict[str, Any]:
            return requests.get(url + "/v1/cache/stats", timeout=60).json()

        for family in families:
            trace = generate(family, size, seed)
            before = stats()
            res = replay(trace, ReplayConfig(base_url=url, model="tiny", max_tokens=max_tokens),
                         tokenizer)
            after = stats()
            ok = [r for r in res.requests if r.error is None]
            cached = sum(r.cached_tokens or 0 for r in ok)
            ideal = sum(r.ideal_tokens for r in res.requests)
            ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
            rb, ra = before["routing"], after["routing"]
            owner = ra["outcomes"].get("owner", 0) - rb["outcomes"].get("owner", 0)
            had = ra["with_owner"] - rb["with_owner"]
            cb, ca = _cluster_tier(before), _cluster_tier(after)
            out["families"][family] = {
                "requests": len(res.requests), "failed": len(res.requests) - len(ok),
                "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
                "cached_tokens": cached, "ideal_tokens": ideal,
                "cached_of_ideal": cached / ideal if ideal else None,
                "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
                "wall_s": res.wall_s,
                "routed_to_owner": owner, "had_owner": had,
                "outcomes": {k: v - rb["outcomes"].get(k, 0) for k, v in ra["outcomes"].items()},
                "remote": {k: ca[k] - cb[k] for k in ca},
            }
        if spec["cluster_tier"]:
            out["moved"] = moved_turns(url, stats, moved)
            out["cold_prefill"] = cold_prefill_rate(url, sorted(cluster.endpoints))
            rate = {n: v["per_token_s"] for n, v in out["cold_prefill"].items()}
            per_token = _pct(list(rate.values()), 0.5)
            for f in out["families"].values():
                f["remote"]["fetch_of_prefill_saved"] = _fetch_fraction(f["remote"], per_token)
            for row in out["moved"]["turns"]:
                row["fetch_of_prefill_saved"] = _fetch_fraction(
                    {"tokens": row["remote_tokens"], "fetch_s": row["fetch_s"]},
                    rate[row["replica"]])
                row["wait_of_prefill_saved"] = _fetch_fraction(  # directory answer + fetch
                    {"tokens": row["remote_tokens"],
                     "fetch_s": row["fetch_s"] + row["locate_s"]}, rate[row["replica"]])
            fr = [r["fetch_of_prefill_saved"] for r in out["moved"]["turns"]
                  if r["fetch_of_prefill_saved"] is not None]
            out["moved"]["fetch_of_prefill_saved_p50"] = _pct(fr, 0.5)
            out["moved"]["fetch_of_prefill_saved_max"] = max(fr) if fr else None
            wr = [r["wait_of_prefill_saved"] for r in out["moved"]["turns"]
                  if r["wait_of_prefill_saved"] is not None]
            out["moved"]["wait_of_prefill_saved_p50"] = _pct(wr, 0.5)
            out["moved"]["wait_of_prefill_saved_max"] = max(wr) if wr else None
            w = [r["warm_s"] for r in out["moved"]["turns"]]
            cs = [r["cold_s"] for r in out["moved"]["turns"]]
            out["moved"]["warm_p50_s"], out["moved"]["cold_p50_s"] = _pct(w, 0.5), _pct(cs, 0.5)
    finally:
        if cluster is not None:
            cluster.stop()
        ray.shutdown()
    return out


def _frac(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def report(results: list[dict[str, Any]]) -> str:
    lines = ["| system | family | cached/ideal | TTFT p50 s | TTFT p95 s | failed | "
             "to owner | remote restores | remote tokens | remote MB | remote restore s | "
             "fetch s | fetch / prefill saved |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        for fam, f in res["families"].items():
            share = (f"{f['routed_to_owner']}/{f['had_owner']}" if f["had_owner"] else "-")
            r = f["remote"]
            lines.append(
                f"| {res['system']} | {fam} | {f['cached_of_ideal']:.1%} | "
                f"{f['ttft_p50_s']:.3f} | {f['ttft_p95_s']:.3f} | {f['failed']} | {share} | "
                f"{r['restores']} | {r['tokens']} | {r['bytes'] / 1e6:.2f} | "
                f"{r['seconds']:.3f} | {r.get('fetch_s', 0.0):.4f} | "
                f"{_frac(r.get('fetch_of_prefill_saved'))} |")
    for res in results:
        if "moved" not in res:
            continue
        m = res["moved"]
        lines += ["", f"{res['system']}: last turn forced to the other replica "
                  f"(cold prefill s/token: " + ", ".join(
                      f"{n} {v['per_token_s'] * 1e3:.3f} ms" for n, v in
                      res["cold_prefill"].items()) + ")", "",
                  "| replica | prompt tokens | remote tokens | fetch s | locate s | fetch MB | "
                  "fetch / prefill saved | locate + fetch / prefill saved | warm s | cold s | "
                  "same token |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for t in m["turns"]:
            lines.append(f"| {t['replica']} | {t['prompt_tokens']} | {t['remote_tokens']} | "
                         f"{t['fetch_s']:.4f} | {t['locate_s']:.4f} | "
                         f"{t['fetch_bytes'] / 1e6:.2f} | {_frac(t['fetch_of_prefill_saved'])} | "
                         f"{_frac(t['wait_of_prefill_saved'])} | {t['warm_s']:.3f} | "
                         f"{t['cold_s']:.3f} | {t['same_token']} |")
        lines.append(f"median fetch / prefill saved {_frac(m['fetch_of_prefill_saved_p50'])} "
                     f"(max {_frac(m['fetch_of_prefill_saved_max'])}); with the directory's "
                     f"answer {_frac(m['wait_of_prefill_saved_p50'])} (max "
                     f"{_frac(m['wait_of_prefill_saved_max'])}); moved turn median "
                     f"{m['warm_p50_s']:.3f} s warm vs {m['cold_p50_s']:.3f} s cold")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-next-tiny")
    ap.add_argument("--size", default="ci")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--families", default="sub-agents,concurrent")
    ap.add_argument("--moved", type=int, default=6,
                    help="conversations whose last turn is forced to the other replica")
    ap.add_argument("--systems", default="cluster+routing,per-replica,native-rr")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    from vllm_hybridcache.models import ensure_model

    model = str(ensure_model(args.model))
    results = []
    for name in args.systems.split(","):
        res = run_system(name, model, args.families.split(","), args.size, args.seed,
                         args.grid, args.max_tokens, args.moved)
        results.append(res)
        print(json.dumps(res, indent=1), flush=True)
    print(report(results))
    base = {f: r["families"][f]["ttft_p50_s"] for r in results[:1] for f in r["families"]}
    for res in results[1:]:
        for f, v in res["families"].items():
            if base.get(f) and v["ttft_p50_s"]:
                print(f"{res['system']} / {results[0]['system']} TTFT p50 on {f}: "
                      f"{v['ttft_p50_s'] / base[f]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "median_note": "one run; this machine is noisy",
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
