"""Connector microbenchmark: cold vs warm time to first token, restore cost, capture overhead.

One run, one machine, side by side:
- for each prompt size (default 4K, 8K, 16K tokens) on the small model: the cold prefill time
  (cache cleared first) and the warm one (the same prompt again: restore the deepest link,
  prefill the tail), medians over `--repeats`;
- restore seconds (measured by the worker) as a fraction of the prefill time the hit saved;
- capture overhead: the cold prefill with the cache on (captures every cut) against an engine
  with its own prefix caching off (the cache-off floor), same prompts.

Time to first token is measured as the wall time of a 1-token generation (prefill + one
sample), in-process, so no HTTP or tokenizer time is included.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time


def _prompt(n: int, seed: int) -> list[int]:
    return [100 + (i * 7919 + seed * 104729) % 3500 for i in range(n)]


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def _engine(model_path: str, extra: dict | None):
    """The plugin with `extra` settings, or (None) stock vLLM with its prefix caching off: for
    hybrid models vLLM turns it on by default (`mamba_cache_mode=align`), which is not the
    cache-off floor."""
    # collective_rpc ships functions (the instrumentation's install_on_worker, worker_totals)
    # to the workers: local benchmark only
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM

    from vllm_hybridcache.serving.python_api import llm_kwargs

    cache = llm_kwargs(**extra) if extra is not None else {"enable_prefix_caching": False}
    return LLM(model=model_path, max_model_len=20480, max_num_batched_tokens=8192,
               enforce_eager=True, seed=0, **cache)


def _instrument(llm) -> None:
    """Give the worker's connector an `Instrumentation` (copy totals); production engines have
    none, so the benchmark installs one in the worker process."""
    from vllm_hybridcache.testing.instrumentation import install_on_worker

    if not all(llm.collective_rpc(install_on_worker)):
        raise RuntimeError("the engine's workers have no hybridcache connector")


def _totals(llm) -> dict:
    """Rank 0's cumulative copy counts and seconds."""
    from vllm_hybridcache.testing.instrumentation import worker_totals

    return llm.collective_rpc(worker_totals)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="connector_bench", description=__doc__)
    parser.add_argument("--model", default="qwen3-next-small")
    parser.add_argument("--sizes", default="4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grid", type=int, default=None, help="default: the plugin default")
    args = parser.parse_args(argv)
    from vllm_hybridcache.config import CacheSettings
    from vllm_hybridcache.models import ensure_model

    sizes = [int(s) for s in args.sizes.split(",")]
    grid = args.grid or CacheSettings().grid
    path = str(ensure_model(args.model))
    rows = []

    # Both engines stay up and the runs interleave, so machine load hits both sides alike.
    # Both run vLLM's default multiprocess engine (an in-process engine is several times
    # slower on CPU and would distort the comparison).
    llm = _engine(path, {"grid": grid})
    _instrument(llm)
    off = _engine(path, None)
    for engine in (llm, off):
        _ttft(engine, _prompt(512, 99))  # warm-up
    for n in sizes:
        cold, off_t, warm, cached, restore, capture = [], [], [], [], [], []
        for r in range(args.repeats):
            p = _prompt(n, r)
            llm.reset_prefix_cache(reset_connector=True)
            before = _totals(llm)
            cold.append(_ttft(llm, p)[0])
            mid = _totals(llm)
            capture.append(mid["capture_s"] - before["capture_s"])
            off_t.append(_ttft(off, p)[0])
            t, c = _ttft(llm, p)
            after = _totals(llm)
            warm.append(t)
            cached.append(c)
            restore.append((after["load_s"] - mid["load_s"])
                           / max(after["loads"] - mid["loads"], 1))
        rows.append({"tokens": n, "cold_s": statistics.median(cold),
                     "off_s": statistics.median(off_t), "capture_s": statistics.median(capture),
                     "warm_s": statistics.median(warm), "cached": statistics.median(cached),
                     "restore_s": statistics.median(restore)})
    del llm, off
    gc.collect()

    print(f"# connector_bench: model {args.model}, grid {grid}, medians of {args.repeats}")
    print("| prompt tokens | cold TTFT s (cache on) | cold TTFT s (cache off) | on/off | "
          "capture copies s | warm TTFT s | cached tokens | speed-up | restore s | restore / "
          "saved prefill |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        saved = r["cold_s"] * r["cached"] / r["tokens"]
        print(f"| {r['tokens']} | {r['cold_s']:.3f} | {r['off_s']:.3f} | "
              f"{r['cold_s'] / r['off_s']:.2f} | {r['capture_s']:.3f} | {r['warm_s']:.3f} | "
              f"{r['cached']:.0f} | {r['cold_s'] / r['warm_s']:.1f}x | {r['restore_s']:.4f} | "
              f"{100 * r['restore_s'] / saved:.2f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
