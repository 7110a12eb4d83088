"""KV blocks in use by N concurrent sessions that share a head: ours in place vs copy vs native.

One run, one machine, side by side, on one model (default the small Qwen3-Next). For each head
length (default 8K and 16K tokens) and each engine:

- `in_place`: the plugin with `attention_in_place` (attention K/V shared from vLLM's block pool,
  recurrent state from our links);
- `copy`: the plugin as before this setting (every resumed request copies the head's K/V rows
  into its own blocks);
- `native`: stock vLLM with its own prefix caching (hybrid models: `mamba_cache_mode=align`);

one request primes the head (captures links, registers blocks), then N sessions (default 4, 8,
16) arrive together, each the head plus its own 64-token question, `--gen` tokens generated.
After every engine step the benchmark reads how many KV blocks are referenced (free and
evictable cached blocks excluded) and keeps the peak, how many of the N sessions are running at
once (the most after any step) and how many times any was preempted. Blocks differ in size
between engines (native's `align` mode pads pages differently), so the figure compared is peak
bytes in use: peak blocks times the bytes a block holds (a page in each layer of a cache group).
Printed as a Markdown table with the ratios to native; a row whose `run` column is below N did
not have all its sessions running at once, so its peak is not like for like.

`--fit-kv-mib M` instead fixes every engine's KV space to M MiB (vLLM's
`kv_cache_memory_bytes`; `VLLM_CPU_KVCACHE_SPACE` is unset since it would override it) and
searches, per engine and head, the largest N of sessions that all run at once with no
preemption (doubling, then bisection; assumes fitting is monotone in N).

Engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the scheduler's block pool is
read directly: `LLMEngine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool`.
"""

from __future__ import annotations

import argparse
import gc
import os
from dataclasses import dataclass


@dataclass
class Trial:
    """What one wave of N sessions did: the figures the tables print."""

    n: int
    peak_blocks: int
    cached: int
    max_running: int
    preemptions: int

    @property
    def fits(self) -> bool:
        """All N sessions ran at once and none was preempted."""
        return self.max_running >= self.n and self.preemptions == 0


def _tokens(n: int, seed: int) -> list[int]:
    return [100 + (i * 7919 + seed * 104729) % 3500 for i in range(n)]


def _engine(model_path: str, mode: str, max_len: int, kv_bytes: int, max_seqs: int,
            batch_tokens: int):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    from vllm import LLM

    from vllm_hybridcache.serving.python_api import llm_kwargs

    if mode == "native":
        cache = {"enable_prefix_caching": True}
    else:
        cache = llm_kwargs(attention_in_place=mode == "in_place", session_anchors=0)
    return LLM(model=model_path, max_model_len=max_len, max_num_batched_tokens=batch_tokens,
               max_num_seqs=max_seqs, kv_cache_memory_bytes=kv_bytes,
               enforce_eager=True, seed=0, **cache)


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _block_bytes(sched) -> int:
    """Bytes one block ID holds across the whole pool: every layer's page at that ID.

    Groups share the pool's tensors (one tensor per layer slot of a group), so a block is a
    page in each of a group's layers, not one page: qwen3-next-small's groups have 2 layers.
    """
    return max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes
               for g in sched.kv_cache_config.kv_cache_groups if not g.host_resident)


def _sessions(llm, head: list[int], n: int, tag: int, gen: int) -> Trial:
    """Run n sessions on `head` together and watch the block pool and the scheduler's queues."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=gen, temperature=0, detokenize=False, ignore_eos=True)
    engine = llm.llm_engine
    sched = _scheduler(llm)
    pool = sched.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1  # the null block is never free
    ids = [f"s{tag}-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        prompt = head + _tokens(64, 1000 * tag + i)
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    mine = set(ids)

    def ours(req) -> bool:
        # the engine suffixes a random tag to the caller's id: "<id>-<8 chars>"
        return req.request_id.rsplit("-", 1)[0] in mine

    peak, cached, max_running = 0, 0, 0
    preempted: dict[str, int] = {}
    while engine.has_unfinished_requests():
        # finished requests leave the scheduler inside step(): count those still running first
        running_before = sum(ours(r) for r in sched.running)
        for out in engine.step():
            if out.finished:
                cached += out.num_cached_tokens or 0
        running_after = sum(ours(r) for r in sched.running)
        max_running = max(max_running, running_before, running_after)
        for req in sched.requests.values():
            if ours(req):
                preempted[req.request_id] = max(preempted.get(req.request_id, 0),
                                                req.num_preemptions)
        peak = max(peak, total - pool.get_num_free_blocks())
    return Trial(n, peak, cached, max_running, sum(preempted.values()))


def _fit(llm, head: list[int], tag: int, gen: int, start: int,
         cap: int) -> tuple[int, list[Trial]]:
    """Largest N (up to cap) whose sessions all run at once unpreempted; the trials run.

    Doubles from `start` until a wave does not fit, then bisects; a wave that does not fit
    still ran r sessions at once, so r and r + 1 are tried first (the answer, as a rule).
    """
    trials: list[Trial] = []

    def fits(n: int) -> bool:
        _sessions(llm, head, 1, tag=tag * 1000 + 999, gen=1)  # re-prime: a wave may evict it
        t = _sessions(llm, head, n, tag=tag * 1000 + len(trials), gen=gen)
        trials.append(t)
        print(f"#   n {n}: running at once {t.max_running}, preemptions {t.preemptions}, "
              f"peak blocks {t.peak_blocks} -> {'fits' if t.fits else 'does not fit'}",
              flush=True)
        return t.fits

    good, bad, n = 0, None, max(1, start)
    while n <= cap:
        if not fits(n):
            bad = n
            break
        good, n = n, n * 2
    if bad is None:
        return good, trials
    hint = trials[-1].max_running
    while bad - good > 1:
        mid = hint if good < hint < bad else (good + bad) // 2
        hint = 0
        if fits(mid):
            good = mid
            hint = mid + 1
        else:
            bad = mid
            hint = trials[-1].max_running
    return good, trials


def _peak_table(args, rows) -> None:
    print(f"\nmodel {args.model}, KV space {args.kv_gib} GiB, {args.gen} tokens generated; peak "
          "KV in use (MiB) and the ratio to native; run: the most sessions running at once; "
          "pre: preemptions; cached: prompt tokens served from a cache, summed\n")
    modes = args.modes
    others = [m for m in modes if m != "native"]
    print("| head | sessions | " + " | ".join([f"{m} MiB | {m} run | {m} pre | {m} cached"
                                              for m in modes] + [f"{m}/native" for m in others])
          + " |")
    print("|---" * (2 + 4 * len(modes) + len(others)) + "|")
    for (head_len, n), by in sorted(rows.items()):
        cells = []
        for m in modes:
            t, page = by[m]
            cells += [f"{t.peak_blocks * page / 2**20:.1f}", str(t.max_running),
                      str(t.preemptions), str(t.cached)]
        nat = by.get("native")
        nat_bytes = nat[0].peak_blocks * nat[1] if nat else 0
        ratios = [f"{by[m][0].peak_blocks * by[m][1] / nat_bytes:.2f}" if nat_bytes else "-"
                  for m in others]
        print(f"| {head_len} | {n} | " + " | ".join(cells + ratios) + " |")


def _fit_table(args, fits) -> None:
    print(f"\nmodel {args.model}, KV space fixed at {args.fit_kv_mib} MiB per engine, "
          f"{args.gen} tokens generated; largest N of sessions sharing the head that all run "
          "at once with no preemption (blocks: the pool's size)\n")
    modes = args.modes
    print("| head | " + " | ".join(f"{m} N | {m} blocks" for m in modes) + " |")
    print("|---" * (1 + 2 * len(modes)) + "|")
    for head_len in args.heads:
        cells = []
        for m in modes:
            n, blocks = fits.get((head_len, m), (0, 0))
            cells += [str(n), str(blocks)]
        print(f"| {head_len} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-next-small")
    ap.add_argument("--heads", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--sessions", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--modes", nargs="+", default=["in_place", "copy", "native"])
    ap.add_argument("--kv-gib", type=int, default=2)
    ap.add_argument("--gen", type=int, default=64,
                    help="tokens generated per session (long enough that all overlap)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=8192,
                    help="vLLM's max_num_batched_tokens (the step's token budget)")
    ap.add_argument("--fit-kv-mib", type=int, default=0,
                    help="fix the KV space (MiB) and search the largest N that fits instead")
    ap.add_argument("--fit-start", type=int, default=4, help="first N the fit search tries")
    args = ap.parse_args(argv)
    from vllm_hybridcache.models import ensure_model

    path = str(ensure_model(args.model))
    max_len = max(args.heads) + 64 + args.gen + 64
    kv_bytes = args.fit_kv_mib * 2**20 if args.fit_kv_mib else args.kv_gib * 2**30
    rows: dict[tuple[int, int], dict[str, tuple[Trial, int]]] = {}
    fits: dict[tuple[int, str], tuple[int, int]] = {}
    for mode in args.modes:
        llm = _engine(path, mode, max_len, kv_bytes, args.max_num_seqs, args.batch_tokens)
        sched = _scheduler(llm)
        page = _block_bytes(sched)
        print(f"# {mode}: {sched.kv_cache_manager.block_pool.num_gpu_blocks} blocks of "
              f"{page / 2**10:.0f} KiB in {kv_bytes / 2**20:.0f} MiB", flush=True)
        for h, head_len in enumerate(args.heads):
            head = _tokens(head_len, 7 + h)
            if args.fit_kv_mib:
                print(f"# {mode} head {head_len}: fit search", flush=True)
                n, _ = _fit(llm, head, tag=100 + h, gen=args.gen, start=args.fit_start,
                            cap=args.max_num_seqs)
                fits[(head_len, mode)] = (n, sched.kv_cache_manager.block_pool.num_gpu_blocks)
                continue
            _sessions(llm, head, 1, tag=100 + h, gen=1)            # prime: links and blocks
            for n in args.sessions:
                t = _sessions(llm, head, n, tag=10 * h + n, gen=args.gen)
                rows.setdefault((head_len, n), {})[mode] = (t, page)
                print(f"# {mode} head {head_len} n {n}: peak blocks {t.peak_blocks}, "
                      f"{t.peak_blocks * page / 2**20:.1f} MiB, running at once "
                      f"{t.max_running}, preemptions {t.preemptions}, cached {t.cached}",
                      flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    if args.fit_kv_mib:
        _fit_table(args, fits)
    else:
        _peak_table(args, rows)


if __name__ == "__main__":
    main()
