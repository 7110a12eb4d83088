"""Cold prefill cost of a split-invariant CPU attention: the pin of vLLM's kernel
(`VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT=1`) or our kernel (`=kernel`, `--on kernel`).

Two vLLM engines of the same model live in this process at once (each with its engine core in
a child process, which reads the switch when the plugin registers there): `off` (vLLM's CPU
attention as shipped, `=0`) and `on` (`--on pin`: every request's queries cut into pieces of
one register iteration, `compat.pin_cpu_attention_split`; `--on kernel`: our split-invariant
kernel, csrc/split_attention_cpu.cpp, in place of vLLM's op). vLLM's own prefix caching is off
and the plugin's connector is not installed, so the arms differ only in the attention. The arms
alternate request by request (the order flips every round); each request is a fresh prompt
prefilled cold for one token. Prints medians, the ratio and the machine's load average.

With `--context C` each request is instead a fresh `--tokens`-token turn after one fixed
C-token context that vLLM's own prefix caching holds in both arms (sent once per engine before
the rounds): what a resumed agent turn costs, where every query of the turn attends over the
whole context (the pin cuts the turn's queries into pieces, each reading the context's keys
and values again).

    python -m benchmarks.cpu_attention_pin_bench --models qwen3-next-tiny \
        --dtypes bfloat16 float32 --out docs/benchmarks/split-invariance-cpu-attention.md
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import sys

from benchmarks.ab import alternate
from benchmarks.engine_cpu import descendants, report, timed_generate
from vllm_hybridcache.config import CPU_ATTN_SPLIT_INVARIANT_ENV

ARMS = ("off", "on")


def _prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def _engine(model_path, dtype: str, setting: str, max_len: int, step: int,
            prefix_caching: bool = False):
    from vllm import LLM

    os.environ[CPU_ATTN_SPLIT_INVARIANT_ENV] = setting
    before = descendants()
    try:
        # compiled like `vllm serve` (no enforce_eager): step costs as a server pays them
        llm = LLM(model=str(model_path), dtype=dtype, max_model_len=max_len,
                  max_num_batched_tokens=step, max_num_seqs=1, seed=0,
                  enable_prefix_caching=prefix_caching)
    finally:
        os.environ.pop(CPU_ATTN_SPLIT_INVARIANT_ENV, None)
    llm.hybridcache_pids = descendants() - before  # this engine's processes
    return llm


def _generate(llm, ids: list[int]) -> tuple[float, float, int]:
    """(wall s, CPU s of the engine's processes, first token) of one request."""
    wall, cpu, out = timed_generate(llm, ids)
    return wall, cpu, out.outputs[0].token_ids[0]


ON = {"pin": "1", "kernel": "kernel"}


def measure(model: str, dtype: str, tokens: int, step: int, repeat: int,
            context: int = 0, on: str = "pin") -> list[str]:
    from vllm_hybridcache.models import ensure_model

    path = ensure_model(model)
    ctx = _prompt(context, 7) if context else []
    engines = {arm: _engine(path, dtype, ON[on] if arm == "on" else "0",
                            context + tokens + 64, step, prefix_caching=bool(context))
               for arm in ARMS}
    for llm in engines.values():  # warm-up: the first calls of each shape, allocator growth
        for k in range(2):  # (with a context: its first prefill puts it in the prefix cache)
            _generate(llm, ctx + _prompt(tokens, 900 + k))

    def one(arm: str, r: int) -> dict[str, float]:
        t, c, tok = _generate(engines[arm], ctx + _prompt(tokens, r))
        return {"wall": t, "cpu": c, "first": tok}

    ab = alternate(ARMS, repeat, one)
    for llm in engines.values():
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # already down
            pass
    engines.clear()  # the rounds' closure holds the dict: empty it to free the engines
    gc.collect()
    same = sum(a == b for a, b in zip(ab.values("first", "off"), ab.values("first", "on"),
                                      strict=True))
    return [f"| {model} | {dtype} | {on} | {context} | {tokens} | {step} "
            f"| {ab.median('wall', 'off'):.3f} | {ab.median('wall', 'on'):.3f} "
            f"| {ab.ratio('wall', 'on', 'off'):.3f} | {ab.median('cpu', 'off'):.2f} "
            f"| {ab.median('cpu', 'on'):.2f} | {ab.ratio('cpu', 'on', 'off'):.3f} "
            f"| {ab.paired('cpu', 'on', 'off'):.3f} | {same}/{repeat} | {ab.load_range()} |",
            ab.rounds_comment(f"{model} {dtype}", {"wall": 3, "cpu": 2})]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen3-next-tiny"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=3200)
    ap.add_argument("--context", type=int, default=0,
                    help="a cached context of this many tokens before each request's tokens")
    ap.add_argument("--step", type=int, default=2048, help="vLLM's max_num_batched_tokens")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--on", choices=sorted(ON), default="pin",
                    help="what the `on` arm runs: the pin of vLLM's kernel or our kernel")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    lines = [
        f"command: `python -m benchmarks.cpu_attention_pin_bench "
        f"{shlex.join(argv if argv is not None else sys.argv[1:])}`",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"{args.repeat} rounds of the arms (order alternating), medians in seconds of one "
        "cold request (prompt + 1 token): wall time, and CPU time of the engine's processes "
        "(`benchmarks/engine_cpu.py`); first token: rounds where both arms chose the same",
        "",
        "| model | dtype | on | cached context | tokens | step | off s | on s | on/off "
        "| off CPU s "
        "| on CPU s "
        "| CPU on/off | CPU on/off, median of the rounds' ratios | same first token "
        "| load average (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return report(lines, (measure(model, dtype, args.tokens, args.step, args.repeat,
                                  args.context, args.on)
                          for model in args.models for dtype in args.dtypes), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
