"""KV blocks in use by N concurrent sessions that share a head: ours in place vs copy vs native.

One run, one machine, side by side, on one model (default the small Qwen3-Next). For each head
length (default 8K and 16K tokens) and each engine:

- `in_place`: the plugin with `attention_in_place` (attention K/V shared from vLLM's block pool,
  recurrent state from our links);
- `copy`: the plugin as before this setting (every resumed request copies the head's K/V rows
  into its own blocks);
- `native`: stock vLLM with its own prefix caching (hybrid models: `mamba_cache_mode=align`);

one request primes the head (captures links, registers blocks), then N sessions (default 4, 8,
16) arrive together, each the head plus its own 64-token question, 8 tokens generated. After
every engine step the benchmark reads how many KV blocks are referenced (free and evictable
cached blocks excluded) and keeps the peak. Blocks differ in size between engines (native's
`align` mode pads pages differently), so the figure compared is peak bytes in use: peak blocks
times the page size. Printed as a Markdown table with the ratios to native.

Engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the scheduler's block pool is
read directly: `LLMEngine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool`.
"""

from __future__ import annotations

import argparse
import gc
import os


def _tokens(n: int, seed: int) -> list[int]:
    return [100 + (i * 7919 + seed * 104729) % 3500 for i in range(n)]


def _engine(model_path: str, mode: str, max_len: int, kv_gib: int):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    from vllm import LLM

    from vllm_hybridcache.serving.python_api import llm_kwargs

    if mode == "native":
        cache = {"enable_prefix_caching": True}
    else:
        cache = llm_kwargs(attention_in_place=mode == "in_place", session_anchors=0)
    return LLM(model=model_path, max_model_len=max_len, max_num_batched_tokens=4096,
               enforce_eager=True, seed=0, **cache)


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _page_bytes(sched) -> int:
    return max(g.kv_cache_spec.page_size_bytes
               for g in sched.kv_cache_config.kv_cache_groups)


def _sessions(llm, head: list[int], n: int, tag: int) -> tuple[int, int]:
    """Run n sessions on `head` together; (peak blocks in use, cached tokens summed)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0, detokenize=False, ignore_eos=True)
    engine = llm.llm_engine
    pool = _scheduler(llm).kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1  # the null block is never free
    for i in range(n):
        prompt = head + _tokens(64, 1000 * tag + i)
        engine.add_request(f"s{tag}-{i}", {"prompt_token_ids": prompt}, sp)
    peak, cached = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                cached += out.num_cached_tokens or 0
        peak = max(peak, total - pool.get_num_free_blocks())
    return peak, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-next-small")
    ap.add_argument("--heads", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--sessions", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--modes", nargs="+", default=["in_place", "copy", "native"])
    ap.add_argument("--kv-gib", type=int, default=2)
    args = ap.parse_args()
    from vllm_hybridcache.models import ensure_model

    path = str(ensure_model(args.model))
    max_len = max(args.heads) + 512
    rows: dict[tuple[int, int], dict[str, tuple[int, int, int]]] = {}
    for mode in args.modes:
        llm = _engine(path, mode, max_len, args.kv_gib)
        page = _page_bytes(_scheduler(llm))
        for h, head_len in enumerate(args.heads):
            head = _tokens(head_len, 7 + h)
            _sessions(llm, head, 1, tag=100 + h)            # prime: links and blocks
            for n in args.sessions:
                peak, cached = _sessions(llm, head, n, tag=10 * h + n)
                rows.setdefault((head_len, n), {})[mode] = (peak, peak * page, cached)
                print(f"# {mode} head {head_len} n {n}: peak blocks {peak}, "
                      f"{peak * page / 2**20:.1f} MiB, cached {cached}", flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    print(f"\nmodel {args.model}, KV space {args.kv_gib} GiB; peak KV in use (MiB) and the "
          "ratio to native; cached: prompt tokens served from a cache, summed\n")
    modes = args.modes
    print("| head | sessions | " + " | ".join(f"{m} MiB | {m} cached" for m in modes)
          + " | " + " | ".join(f"{m}/native" for m in modes if m != "native") + " |")
    print("|---" * (2 + 2 * len(modes) + len([m for m in modes if m != "native"])) + "|")
    for (head_len, n), by in sorted(rows.items()):
        cells = []
        for m in modes:
            peak, bytes_, cached = by.get(m, (0, 0, 0))
            cells += [f"{bytes_ / 2**20:.1f}", str(cached)]
        nat = by.get("native", (0, 0, 0))[1]
        ratios = [f"{by[m][1] / nat:.2f}" if nat and m in by else "-"
                  for m in modes if m != "native"]
        print(f"| {head_len} | {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
