"""Cross-replica restore vs cold prefill on two replicas of one model (Ray actors, local Ray).

For each of N conversations: turns 1..k run on replica A; turn k+1 runs on replica B twice,
once cold (a fresh cache_salt: nothing cached) and once resuming from A's links through the
cluster tier. Prints per-turn seconds (one output token: the prefill dominates), the medians
and their ratio, the remote bytes and the remote fetch time (fetch issued to staged) as a
fraction of the prefill the remote tokens saved.
Run: python -m benchmarks.cluster_restore [--model qwen3-next-tiny]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-next-tiny")
    ap.add_argument("--conversations", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--grid", type=int, default=256)
    args = ap.parse_args()

    import ray

    from vllm_hybridcache.cluster.replica import replica_actor
    from vllm_hybridcache.models import ensure_model

    model = str(ensure_model(args.model))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ray.init(num_cpus=2, object_store_memory=256 << 20, include_dashboard=False,
             namespace="hybridcache", log_to_driver=False)
    engine = {"max_model_len": 8192, "max_num_batched_tokens": 2048, "enforce_eager": True,
              "seed": 0}
    Replica = replica_actor(num_cpus=1)
    a, b = (Replica.remote(model, n, {"grid": args.grid, "message_end_min": 64}, engine)
            for n in ("A", "B"))
    try:
        ray.get([a.stats.remote(), b.stats.remote()])
        cold_s, warm_s, cached, lengths = [], [], [], []
        for c in range(args.conversations):
            prompt = [(c * 997 + 100 + i * 7) % 3000 + 10 for i in range(600)]
            for t in range(1, args.turns):
                ray.get(a.generate.remote(prompt, max_tokens=1))
                prompt = prompt + [(c * 131 + t * 31 + i * 13) % 3000 + 10 for i in range(300)]
            t0 = time.perf_counter()
            cold = ray.get(b.generate.remote(prompt, max_tokens=1,
                                             salt=f"cold-{uuid.uuid4().hex}"))
            cold_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            warm = ray.get(b.generate.remote(prompt, max_tokens=1))
            warm_s.append(time.perf_counter() - t0)
            cached.append(warm["cached"])
            lengths.append(len(prompt))
            assert warm["tokens"] == cold["tokens"], "resumed turn differs from cold"
            print(f"conversation {c}: {len(prompt)} tokens, cold {cold_s[-1]:.3f} s, "
                  f"from A's links {warm_s[-1]:.3f} s ({warm['cached']} tokens cached)")
        xfer = ray.get(b.cluster_transfer.remote())
        st = ray.get(b.stats.remote())["cluster/tree"]
        mc, mw = statistics.median(cold_s), statistics.median(warm_s)
        print(f"median turn on B: cold {mc:.3f} s, resumed from A {mw:.3f} s, "
              f"ratio {mw / mc:.2f}")
        # the prefill the remote tokens saved, at B's cold rate (cold turn seconds per token,
        # an upper bound on the rate: the cold turn also samples a token)
        per_token = statistics.median(s / n for s, n in zip(cold_s, lengths, strict=True))
        saved = sum(cached) * per_token
        fetch = st["fetch_seconds"]["sum"]
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
