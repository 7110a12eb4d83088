"""Two replicas behind the cluster front, three ways, one run: the cluster tier with routing
vs per-replica caches only (plugin, no cluster tier, round robin) vs stock vLLM with its native
prefix caching per replica (round robin).

Each system is launched exactly as `vllm-hybridcache cluster` launches it (local Ray, two
`vllm serve` replicas, the front on Ray Serve) and replays the sub-agents and concurrent trace
families (benchmarks/traces, the replayer of benchmarks/replay.py) through the front's one
port. Per family it prints: cached tokens as a fraction of the ideal (what one server with an
unbounded exact cache would have served), TTFT p50/p95, requests that failed, and from the
front's `/v1/cache/stats`: turns routed to their owner, the cluster tier's restores, tokens and
bytes it brought from the other replica and the seconds its restores took.

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
            "seconds": (t.get("restore_seconds") or {}).get("sum", 0.0)}


def run_system(name: str, model: str, families: list[str], size: str, seed: int,
               grid: int, max_tokens: int) -> dict[str, Any]:
    import ray
    import requests

    from benchmarks.ideal import PromptTokenizer
    from benchmarks.replay import ReplayConfig, replay
    from benchmarks.servers import free_port
    from benchmarks.traces import generate
    from vllm_hybridcache.cluster.directory import NAMESPACE
    from vllm_hybridcache.cluster.launcher import Cluster
    from vllm_hybridcache.cluster.routing import Policy

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
    finally:
        if cluster is not None:
            cluster.stop()
        ray.shutdown()
    return out


def report(results: list[dict[str, Any]]) -> str:
    lines = ["| system | family | cached/ideal | TTFT p50 s | TTFT p95 s | failed | "
             "to owner | remote restores | remote tokens | remote MB | remote restore s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        for fam, f in res["families"].items():
            share = (f"{f['routed_to_owner']}/{f['had_owner']}" if f["had_owner"] else "-")
            r = f["remote"]
            lines.append(
                f"| {res['system']} | {fam} | {f['cached_of_ideal']:.1%} | "
                f"{f['ttft_p50_s']:.3f} | {f['ttft_p95_s']:.3f} | {f['failed']} | {share} | "
                f"{r['restores']} | {r['tokens']} | {r['bytes'] / 1e6:.2f} | "
                f"{r['seconds']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-next-tiny")
    ap.add_argument("--size", default="ci")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--families", default="sub-agents,concurrent")
    ap.add_argument("--systems", default="cluster+routing,per-replica,native-rr")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    from vllm_hybridcache.models import ensure_model

    model = str(ensure_model(args.model))
    results = []
    for name in args.systems.split(","):
        res = run_system(name, model, args.families.split(","), args.size, args.seed,
                         args.grid, args.max_tokens)
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
