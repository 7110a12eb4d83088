"""Cross-replica restore vs cold prefill on two replicas of one model (Ray actors, local Ray).

For each of N conversations: turns 1..k run on replica A; turn k+1 runs on replica B twice,
once cold (a fresh cache_salt: nothing cached) and once resuming from A's links through the
cluster tier. Prints per-turn seconds (one output token: the prefill dominates), the medians
and their ratio, the remote bytes and the remote fetch time (locate to staged) as a fraction of
the cold prefill. Run: python -m benchmarks.cluster_restore [--model qwen3-next-tiny]
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
        cold_s, warm_s, cached = [], [], []
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
            assert warm["tokens"] == cold["tokens"], "resumed turn differs from cold"
            print(f"conversation {c}: {len(prompt)} tokens, cold {cold_s[-1]:.3f} s, "
                  f"from A's links {warm_s[-1]:.3f} s ({warm['cached']} tokens cached)")
        xfer = ray.get(b.cluster_transfer.remote())
        mc, mw = statistics.median(cold_s), statistics.median(warm_s)
        print(f"median turn on B: cold {mc:.3f} s, resumed from A {mw:.3f} s, "
              f"ratio {mw / mc:.2f}")
        print(f"remote bytes {xfer['bytes']} over {args.conversations} turns; remote fetch "
              f"time {xfer['seconds'] / args.conversations:.3f} s per turn = "
              f"{xfer['seconds'] / sum(cold_s):.2f} of the cold turn")
    finally:
        for r in (a, b):
            ray.get(r.shutdown.remote(), timeout=120)
        ray.shutdown()


if __name__ == "__main__":
    main()
