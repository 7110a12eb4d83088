"""CPU prefill and decode throughput of Flash-Next beside vLLM's Qwen3-Next of similar size.

Each model gets one engine (bf16, prefix caching off, chunked prefill of `--chunk` tokens) and
one request at a time: a random prompt of the context length generating `1 + --decode` tokens.
The engine's own per-request timestamps split it: prefill = scheduled -> first token, decode =
first -> last token over the decode tokens (one request, so the machine's other load is the
only noise; `--repeat` keeps the best of several runs). Results print as a markdown table and,
with --out, are written with the command that produced them.

    python -m benchmarks.model_bench --out docs/benchmarks/model.md
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass


@dataclass
class Row:
    model: str
    context: int
    prefill_s: float
    prefill_tps: float
    decode_tps: float


def _prompt(n: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 4086, (n,), generator=g).tolist()


def _timed(llm, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(prefill seconds, seconds per decode token) from the engine's request timestamps."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    m = out.metrics
    if m is None or not m.first_token_ts:
        return time.perf_counter() - start, float("nan")
    prefill = m.first_token_ts - m.scheduled_ts
    n = max(1, m.num_generation_tokens - 1)
    return prefill, (m.last_token_ts - m.first_token_ts) / n


def bench_model(name: str, contexts: list[int], decode: int, chunk: int,
                repeat: int = 1) -> list[Row]:
    from vllm import LLM

    from vllm_hybridcache.models import ensure_model

    path = ensure_model(name)
    llm = LLM(model=str(path), dtype="bfloat16", enable_prefix_caching=False,
              max_model_len=max(contexts) + decode + 16, max_num_batched_tokens=chunk,
              max_num_seqs=4, enforce_eager=True, seed=0, disable_log_stats=False)
    rows = []
    try:
        _timed(llm, _prompt(64, 1), 2)  # warm-up
        for n in contexts:
            ids = _prompt(n, n)
            runs = [_timed(llm, ids, 1 + decode) for _ in range(repeat)]
            prefill = min(r[0] for r in runs)
            per_token = min(r[1] for r in runs)
            rows.append(Row(name, n, prefill, n / prefill, 1.0 / per_token))
            print(f"{name:18s} ctx={n:6d} prefill {n / prefill:9.1f} tok/s  "
                  f"decode {rows[-1].decode_tps:7.2f} tok/s", flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return rows


def render(rows: list[Row], argv: list[str], decode: int, chunk: int) -> str:
    cmd = "python -m benchmarks.model_bench " + " ".join(shlex.quote(a) for a in argv)
    lines = [
        "# Flash-Next vs Qwen3-Next on CPU: prefill and decode throughput",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
        f"Python {platform.python_version()}. bf16, one request at a time, chunked prefill "
        f"of {chunk} tokens, prefix caching off, decode = {decode} tokens after the prompt; "
        "times from the engine's request timestamps.",
        "",
        "| model | context | prefill s | prefill tok/s | decode tok/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.model} | {r.context} | {r.prefill_s:.2f} | {r.prefill_tps:.1f} "
                     f"| {r.decode_tps:.2f} |")
    lines += [
        "",
        "Flash-Next runs through the plugin's CPU backend (`flash_next/ops/cpu.py`): vLLM's C++",
        "GDN prefill kernel and vLLM's CPU GEMM dispatch for the linear layers, torch for",
        "everything else (QSA indexer and sparse attention, PLE, hyper-connections, MoE).",
        "Qwen3-Next is vLLM's in-tree model with its CPU kernels (GDN, attention, fused MoE).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="flash-next-small,qwen3-next-small")
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=1, help="runs per context (best kept)")
    p.add_argument("--out", default=None, help="write the markdown report here")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    contexts = [int(c) for c in args.contexts.split(",")]
    rows: list[Row] = []
    for name in args.models.split(","):
        rows += bench_model(name, contexts, args.decode, args.chunk, args.repeat)
    report = render(rows, argv, args.decode, args.chunk)
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
