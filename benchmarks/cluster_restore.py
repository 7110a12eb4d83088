"""Cross-replica restore vs cold prefill on two replicas of one model (Ray actors, local Ray).

For each of N conversations: turns 1..k run on replica A with live history (each turn's prompt
is the previous one, its answer and a new message, so turns 2..k resume from A's end anchors);
turn k+1 runs on replica B twice, once cold (a fresh cache_salt: nothing cached) and once
resuming through the cluster tier (A's end anchor of turn k when end anchors move, else A's
first turn's tree links), then once on A from its own anchor. Prints per-turn seconds (one
output token: the prefill dominates), the medians and their ratio, the cached tokens by kind,
the remote bytes and the remote fetch time (fetch issued to staged) as a fraction of the
prefill the remote tokens saved, and how many moved turns gave the cold token and A's token
(an anchor is session-exact: the greedy gate, not bit equality, holds it to a cold run).
Both replicas share the cluster secret `--secret-file` (default: a fresh one in a private
folder, removed at the end; the replicas run on this machine's local Ray).
Run: python -m benchmarks.cluster_restore [--model qwen3-next-tiny] [--secret-file FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path


def _secret_file(given: str | None) -> tuple[str, Path | None]:
    """The cluster secret's file, and the private folder made for it when none was given
    (0700, the file 0600 with a new secret: core/auth.py `load_key_file`)."""
    from vllm_hybridcache.core.auth import load_key_file

    if given:
        load_key_file(Path(given))  # refused here, before any replica starts
        return given, None
    folder = Path(tempfile.mkdtemp(prefix="hybridcache-bench-secret-"))
    path = folder / "cluster.secret"
    load_key_file(path, create=True)
    return str(path), folder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-next-tiny")
    ap.add_argument("--conversations", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--grid", type=int, default=256)
    ap.add_argument("--secret-file", default=None,
                    help="the cluster secret's file (default: a fresh one, removed at the end)")
    args = ap.parse_args(argv)
    secret, secret_dir = _secret_file(args.secret_file)
    try:
        _run(args, secret)
    finally:
        if secret_dir is not None:
            shutil.rmtree(secret_dir, ignore_errors=True)


def _run(args: argparse.Namespace, secret: str) -> None:

    import ray

    from vllm_hybridcache.models import ensure_model
    from vllm_hybridcache.testing.replica import replica_actor

    model = str(ensure_model(args.model))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ray.init(num_cpus=2, object_store_memory=256 << 20, include_dashboard=False,
             namespace="hybridcache", log_to_driver=False)
    engine = {"max_model_len": 8192, "max_num_batched_tokens": 2048, "enforce_eager": True,
              "seed": 0}
    Replica = replica_actor(num_cpus=1)
    settings = {"grid": args.grid, "message_end_min": 64, "cluster_secret_file": secret}
    a, b = (Replica.remote(model, n, settings, engine) for n in ("A", "B"))
    try:
        ray.get([a.stats.remote(), b.stats.remote()])
        cold_s, warm_s, cached, lengths = [], [], [], []
        same_cold = same_owner = 0
        for c in range(args.conversations):
            prompt = [(c * 997 + 100 + i * 7) % 3000 + 10 for i in range(600)]
            for t in range(1, args.turns):
                answer = ray.get(a.generate.remote(prompt, max_tokens=1))["tokens"]
                prompt = prompt + answer + [(c * 131 + t * 31 + i * 13) % 3000 + 10
                                            for i in range(299)]
            # a finished request's end anchor is captured (and published) in the engine's next
            # step; `vllm serve` runs it right away, an idle in-process engine only at its next
            # request: one tiny request does it here
            ray.get(a.generate.remote([1, 2, 3], max_tokens=1))
            t0 = time.perf_counter()
            cold = ray.get(b.generate.remote(prompt, max_tokens=1,
                                             salt=f"cold-{uuid.uuid4().hex}"))
            cold_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            warm = ray.get(b.generate.remote(prompt, max_tokens=1))
            warm_s.append(time.perf_counter() - t0)
            cached.append(warm["cached"])
            lengths.append(len(prompt))
            own = ray.get(a.generate.remote(prompt, max_tokens=1))
            same_cold += warm["tokens"] == cold["tokens"]
            same_owner += warm["tokens"] == own["tokens"]
            print(f"conversation {c}: {len(prompt)} tokens, cold {cold_s[-1]:.3f} s, "
                  f"from A {warm_s[-1]:.3f} s ({warm['cached']} tokens cached; on A "
                  f"{own['cached']})")
        stats = ray.get(b.stats.remote())
        kinds = {k: stats[f"cluster/{k}"] for k in ("tree", "anchor") if f"cluster/{k}" in stats}
        for k, s in kinds.items():
            print(f"B's cluster tier, kind {k}: {s['restores']} restores, {s['tokens_served']} "
                  f"tokens served, {s['fetches']} fetches, {s['fetch_bytes']} bytes, "
                  f"misses {s['misses']}")
        print(f"moved turns with the cold run's token: {same_cold}/{args.conversations}, with "
              f"A's own resumed token: {same_owner}/{args.conversations}")
        xfer = {"bytes": sum(s["fetch_bytes"] for s in kinds.values())}
        st = {"fetch_seconds": {"sum": sum(s["fetch_seconds"]["sum"] for s in kinds.values())},
              "locate_seconds": {"sum": max(s["locate_seconds"]["sum"]
                                            for s in kinds.values())}}
        mc, mw = statistics.median(cold_s), statistics.median(warm_s)
        print(f"median turn on B: cold {mc:.3f} s, resumed from A {mw:.3f} s, "
              f"ratio {mw / mc:.2f}")
        # the prefill the remote tokens saved, at B's cold rate (cold turn seconds per token,
        # an upper bound on the rate: the cold turn also samples a token)
        per_token = statistics.median(s / n for s, n in zip(cold_s, lengths, strict=True))
        saved = sum(cached) * per_token
        fetch = st["fetch_seconds"]["sum"]
        # both kinds' fetches of a turn run side by side (summed: an upper bound); their
        # locates too (the longer kind's sum is quoted)
        print(f"remote bytes {xfer['bytes']} over {args.conversations} turns; fetch (issued to "
              f"staged) {fetch / args.conversations:.4f} s per turn, locate "
              f"{st['locate_seconds']['sum'] / args.conversations:.4f} s per turn; "
              f"{sum(cached)} tokens served remotely, their cold prefill {saved:.3f} s: fetch / "
              f"prefill saved {fetch / saved:.1%}" if saved else "nothing served remotely")
    finally:
        for r in (a, b):
            ray.get(r.shutdown.remote(), timeout=120)
        ray.shutdown()


if __name__ == "__main__":
    main()
