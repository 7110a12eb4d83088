"""Decode speed of a CPU engine with the plugin against native vLLM: where a CPU worker's cores go.

Three in-process `vllm.LLM` engines of one model, the arms alternating request by request
(benchmarks/ab.py): `native` (vLLM with its own prefix caching), `ours` (`llm_kwargs()`: the
plugin's connector, scheduler and defaults) and `ours-extra-core` (the same with
`VLLM_CPU_NUM_OF_RESERVED_CPU` set to what vLLM reserves for any KV connector before the
plugin's binding bend, `compat.reserve_cpus_as_without_connector`: the engine as it ran before
that bend). Each request is a fresh short prompt and `--tokens` greedy decoded tokens, so the
time is decode steps; the CPU seconds are the engine's processes' (benchmarks/engine_cpu.py),
the polling engine core included.

    python -m benchmarks run decode [--model qwen3-next-tiny] [--tokens 256] [--repeat 7]
        [--out docs/benchmarks/decode.md]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import shlex
import sys
import time

from benchmarks.ab import alternate
from benchmarks.engine_cpu import cpu_seconds, descendants, emit

ARMS = ("native", "ours", "ours-extra-core")
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def _engine(model_path: str, arm: str, max_len: int):
    from vllm import LLM

    from vllm_hybridcache.serving.python_api import llm_kwargs

    kwargs = {"enable_prefix_caching": True} if arm == "native" else llm_kwargs()
    old = os.environ.get(RESERVED_ENV)
    if arm == "ours-extra-core":
        # vLLM's reservation with a KV connector: twice the local world size (1 here)
        os.environ[RESERVED_ENV] = "2"
    before = descendants()
    try:
        llm = LLM(model=model_path, max_model_len=max_len, seed=0, **kwargs)
    finally:
        if old is None:
            os.environ.pop(RESERVED_ENV, None)
        else:
            os.environ[RESERVED_ENV] = old
    llm.hybridcache_pids = descendants() - before
    return llm


def measure(model: str, tokens: int, prompt: int, repeat: int) -> list[str]:
    from vllm import SamplingParams

    from vllm_hybridcache.models import ensure_model

    path = str(ensure_model(model))
    engines = {arm: _engine(path, arm, 2048) for arm in ARMS}
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False)

    def run(arm: str, ids: list[int]) -> tuple[float, float, list[int]]:
        llm = engines[arm]
        c0, t0 = cpu_seconds(llm.hybridcache_pids), time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        return (time.perf_counter() - t0, cpu_seconds(llm.hybridcache_pids) - c0,
                list(out[0].outputs[0].token_ids))

    for arm in ARMS:  # warm-up: first calls of each shape
        for k in range(2):
            run(arm, _prompt(prompt, 900 + k))
    outputs: dict[str, list[list[int]]] = {a: [] for a in ARMS}

    def one(arm: str, r: int) -> dict[str, float]:
        wall, cpu, toks = run(arm, _prompt(prompt, r))
        outputs[arm].append(toks)
        return {"wall": wall, "cpu": cpu}

    ab = alternate(ARMS, repeat, one)
    for llm in engines.values():
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # already down
            pass
    engines.clear()
    gc.collect()
    same = sum(outputs["ours"][r] == outputs["native"][r] for r in range(repeat))
    rows = []
    for arm in ARMS:
        rows.append(f"| {model} | {arm} | {ab.median('wall', arm):.3f} "
                    f"| {ab.median('wall', arm) / tokens * 1e3:.2f} "
                    f"| {ab.paired('wall', arm, 'native'):.3f} | {ab.median('cpu', arm):.2f} "
                    f"| {ab.paired('cpu', arm, 'native'):.3f} |")
    rows.append(f"<!-- {model}: ours' tokens equal native's in {same}/{repeat} rounds; "
                f"load {ab.load_range()} -->")
    rows.append(ab.rounds_comment(model, {"wall": 3, "cpu": 2}))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen3-next-tiny"])
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens decoded per request")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    lines = [
        f"command: `python -m benchmarks run decode "
        f"{shlex.join(argv if argv is not None else sys.argv[1:])}`",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"{args.repeat} rounds of the arms (order alternating), one request each: a "
        f"{args.prompt}-token prompt and {args.tokens} greedy tokens; medians, and the median "
        "of the rounds' own ratios to native",
        "",
        "| model | arm | request s | ms per token | request / native (paired) | engine CPU s "
        "| CPU / native (paired) |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in args.models:
        rows = measure(model, args.tokens, args.prompt, args.repeat)
        lines += rows
        print("\n".join(rows), flush=True)
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
