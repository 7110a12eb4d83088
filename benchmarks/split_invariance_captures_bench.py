"""Cold prefill cost of fine segmentation's inner captures (on) against none (off), in vLLM.

The issue's measure: a cold prefill with fine captures on vs off, the forward the same. Both
arms run Flash-Next with its split-invariant forward (`VLLM_HYBRIDCACHE_FLASH_NEXT_SPLIT_INVARIANT
=1`, set by this script for the whole process) in a vLLM engine with the plugin at its default
settings; they differ only in the `inner_captures` setting: `on` runs in `fine` mode, `off` in
`step` mode (links only where a step ends). Two engines live in this process at once (each with
its engine core in a child process) and the arms alternate request by request, so the
machine's load hits both alike.

One measured request: the connector cleared (no link, no recent prompt), a fresh primer prompt
sent untimed (remembered as a recent prompt; its links end at or after `--junction` + 64, so
none serves the next prompt), then the timed prompt: `--tokens` tokens whose first
`--junction` tokens are the primer's. It is cold in both arms (the cached-token count is
checked) and in `on` captures, from inside its steps, a junction link at the last 64-aligned
position at or before `--junction` and a link at the prompt's last 64-aligned position, besides
the links at its cuts that both arms take. Time: `LLM.generate` of the prompt for one token.

    python -m benchmarks.split_invariance_captures_bench --models flash-next-tiny \
        flash-next-small --dtypes float32 bfloat16 \
        --out docs/benchmarks/split-invariance-captures.md
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

ARMS = ("off", "on")


def _prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def _engine(model_path: str, dtype: str, inner: bool, max_len: int, step: int):
    from vllm import LLM

    from vllm_hybridcache.serving.python_api import llm_kwargs

    before = descendants()
    # compiled like `vllm serve` (no enforce_eager): step costs as a server pays them
    llm = LLM(model=str(model_path), dtype=dtype, max_model_len=max_len,
              max_num_batched_tokens=step, max_num_seqs=1, seed=0,
              **llm_kwargs(inner_captures=inner))
    llm.hybridcache_pids = descendants() - before  # this engine's processes
    return llm


def _generate(llm, ids: list[int]) -> tuple[float, float, int]:
    """(wall s, CPU s of the engine's processes, cached tokens) of one request."""
    wall, cpu, out = timed_generate(llm, ids)
    return wall, cpu, out.num_cached_tokens or 0


def _one(llm, primer: list[int], prompt: list[int]) -> tuple[float, float]:
    llm.reset_prefix_cache(reset_connector=True)
    _generate(llm, primer)
    t, c, cached = _generate(llm, prompt)
    if cached:
        raise RuntimeError(f"the timed prompt was served {cached} tokens from cache: not cold")
    return t, c


def _served(llm, tokens: int, junction: int) -> str:
    """What a measured prompt's links serve afterwards (untimed, fresh prompts): an identical
    resend and a prompt that parts from it at the junction, as cached tokens. In `on` they show
    the inner links (the last 64-aligned position, the junction's); in `off` only the cuts'."""
    primer = _prompt(tokens, 10_000)
    prompt = primer[:junction] + _prompt(tokens - junction, 10_001)
    _one(llm, primer, prompt)
    resend = _generate(llm, prompt)[2]
    parted = _generate(llm, prompt[:junction] + _prompt(64, 4242))[2]
    return f"{resend} / {parted}"


def measure(model: str, dtype: str, tokens: int, junction: int, step: int,
            repeat: int, warmup: int = 2, control: bool = False) -> list[str]:
    """[row, per-round comment]; `control`: both engines with inner captures on (an A/A run
    that shows how far two identically set engines in one process differ)."""
    from vllm_hybridcache.models import ensure_model

    path = ensure_model(model)
    engines = {arm: _engine(path, dtype, control or arm == "on", tokens + 128, step)
               for arm in ARMS}
    for llm in engines.values():  # warm-up: the first calls of each shape, allocator growth
        for k in range(warmup):
            _one(llm, _prompt(tokens, 900 + k), _prompt(junction, 900 + k)
                 + _prompt(tokens - junction, 950 + k))

    def one(arm: str, r: int) -> dict[str, float]:
        # both arms get the same prompts; which goes first alternates with the round
        primer = _prompt(tokens, 2 * r)
        t, c = _one(engines[arm], primer,
                    primer[:junction] + _prompt(tokens - junction, 2 * r + 1))
        return {"wall": t, "cpu": c}

    ab = alternate(ARMS, repeat, one)
    served = {arm: _served(llm, tokens, junction) for arm, llm in engines.items()}
    for llm in engines.values():
        _shutdown(llm)
    engines.clear()  # the rounds' closure holds the dict: empty it to free the engines
    gc.collect()
    label = f"{model} (A/A control: both on)" if control else model
    return [f"| {label} | {dtype} | {tokens} | {junction} | {step} | {served['off']} "
            f"| {served['on']} | {ab.median('wall', 'off'):.3f} | {ab.median('wall', 'on'):.3f} "
            f"| {ab.ratio('wall', 'on', 'off'):.3f} | {ab.median('cpu', 'off'):.2f} "
            f"| {ab.median('cpu', 'on'):.2f} | {ab.ratio('cpu', 'on', 'off'):.3f} "
            f"| {ab.paired('cpu', 'on', 'off'):.3f} | {ab.load_range()} |",
            ab.rounds_comment(f"{model} {dtype}", {"wall": 3, "cpu": 2})]


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # already down
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["flash-next-tiny"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--junction", type=int, default=1000,
                    help="tokens the timed prompt shares with the primer (below the first cut)")
    ap.add_argument("--step", type=int, default=2048, help="vLLM's max_num_batched_tokens")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="untimed requests per engine")
    ap.add_argument("--control", action="store_true",
                    help="A/A run: both engines with inner captures on")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.junction < 64 or args.junction + 64 > min(args.tokens, 2048):
        ap.error("--junction must leave a 64-aligned junction below the first grid cut")
    os.environ["VLLM_HYBRIDCACHE_FLASH_NEXT_SPLIT_INVARIANT"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    lines = [
        f"command: `python -m benchmarks.split_invariance_captures_bench "
        f"{shlex.join(argv if argv is not None else sys.argv[1:])}`",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"{args.repeat} rounds of the arms (order alternating), medians in seconds of one "
        "cold request (prompt + 1 token): wall time, and CPU time of the engine's processes "
        "(`benchmarks/engine_cpu.py`)",
        "",
        "| model | dtype | tokens | shared with the primer | step | off: resend / parted cached "
        "| on: resend / parted cached "
        "| off s | on s | on/off | off CPU s | on CPU s | CPU on/off | CPU on/off, median of "
        "the rounds' ratios | load average (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return report(lines, (measure(model, dtype, args.tokens, args.junction, args.step,
                                  args.repeat, args.warmup, args.control)
                          for model in args.models for dtype in args.dtypes), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
