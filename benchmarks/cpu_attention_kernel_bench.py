"""Our split-invariant CPU attention kernel against vLLM's own CPU attention op, kernel alone.

Why: the engine benchmark (`cpu_attention_pin_bench --on kernel`) measures a whole cold
prefill, where the attention is a small share on the embedded models and a long context costs
minutes to prime on a slow host. This times the two kernels on the same KV cache (written by
vLLM's own `cpu_attn_reshape_and_cache` into shuffled blocks, vLLM's `vec` layout, bf16) at
model shapes, for the calls an agent's serving makes: prefill steps, a short turn after a long
cached context, and a decode step after it. Medians over `--reps` interleaved runs (one of each
per round) after a warm-up, at each thread count of `--threads`; ratio = ours / vLLM's (< 1:
ours faster). Both outputs are checked against a float32 reference (max abs error printed).

    python -m benchmarks run cpu-attention-kernel
    python -m benchmarks run cpu-attention-kernel --shapes qwen3-next-80b --threads 1 2
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from benchmarks.copy_bench import _medians_ms  # interleaved medians, after a warm-up

# name: (query heads, kv heads, head dim, block tokens)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "qwen3-next-tiny": (4, 2, 64, 384),
    "qwen3-next-small": (8, 2, 128, 544),
    "qwen3-next-80b": (16, 2, 256, 544),   # Qwen3-Next-80B-A3B's attention layers
}

# call: (context before the queries, query tokens)
CALLS: dict[str, tuple[int, int]] = {
    "prefill 0-2048": (0, 2048),
    "prefill 2048-3200": (2048, 1152),
    "turn of 128 after 16K": (16384, 128),
    "decode after 16K": (16511, 1),
}


class _KV:
    """One request's keys and values in vLLM's CPU cache, its queries, and its block table."""

    def __init__(self, heads: int, kv_heads: int, dim: int, block: int, tokens: int) -> None:
        from vllm import _custom_ops as ops

        g = torch.Generator().manual_seed(0)
        nb = -(-tokens // block) + 1
        kv = torch.zeros(nb, kv_heads, block, 2 * dim, dtype=torch.bfloat16)
        self.kc, self.vc = kv.view(nb, kv_heads, 2 * block, dim).chunk(2, dim=2)
        self.table = torch.randperm(nb, generator=g).to(torch.int32)[None, : nb - 1]
        self.q = torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16)
        self.k = torch.randn(tokens, kv_heads, dim, generator=g).to(torch.bfloat16)
        self.v = torch.randn(tokens, kv_heads, dim, generator=g).to(torch.bfloat16)
        pos = torch.arange(tokens)
        slots = self.table[0].long()[pos // block] * block + pos % block
        ops.cpu_attn_reshape_and_cache(self.k, self.v, self.kc, self.vc, slots, "vec")
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim

    def calls(self, start: int, n: int) -> tuple[Callable[[], torch.Tensor], ...]:
        """(ours, vLLM's, float32 reference) for queries [start, start + n)."""
        from vllm import _custom_ops as ops

        from vllm_hybridcache.ops import cpu_attention

        q = self.q[start:start + n].contiguous()
        qsl = torch.tensor([0, n], dtype=torch.int32)
        seq = torch.tensor([start + n], dtype=torch.int32)
        scale = self.dim ** -0.5
        out = torch.empty_like(q)

        def ours() -> torch.Tensor:
            return cpu_attention.split_invariant_attention(q, self.kc, self.vc, out, qsl, seq,
                                                           self.table, scale)

        def vllm() -> torch.Tensor:
            md = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=1, num_heads=self.heads, num_kv_heads=self.kv_heads,
                head_dim=self.dim, seq_lens=seq, dtype=torch.bfloat16, query_start_loc=qsl,
                causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=True,
                dynamic_causal=None, kv_cache_dtype="auto")
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=self.kc, value_cache=self.vc, output=out,
                query_start_loc=qsl, seq_lens=seq, scale=scale, causal=True,
                alibi_slopes=None, sliding_window=-1, block_table=self.table, softcap=0.0,
                scheduler_metadata=md, s_aux=None)
            return out

        def reference() -> torch.Tensor:
            rep = self.heads // self.kv_heads
            k = self.k[: start + n].float().repeat_interleave(rep, dim=1).transpose(0, 1)
            v = self.v[: start + n].float().repeat_interleave(rep, dim=1).transpose(0, 1)
            s = (q.float().transpose(0, 1) @ k.transpose(1, 2)) * scale
            mask = torch.arange(start + n)[None, :] > (start + torch.arange(n))[:, None]
            p = s.masked_fill(mask, float("-inf")).softmax(-1)
            return (p @ v).transpose(0, 1)

        return ours, vllm, reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks run cpu-attention-kernel",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--calls", nargs="+", default=list(CALLS), choices=list(CALLS))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    from vllm_hybridcache.adapter.fingerprint import cpu_isa
    from vllm_hybridcache.ops import cpu_attention

    if not cpu_attention.available():
        print("cpu-attention-kernel: the kernel is not built here (make toolchain)")
        return 2
    print(f"machine: {os.cpu_count()} CPUs, ISA {cpu_isa()}; medians of {args.reps} "
          "interleaved runs, ms; bf16, vLLM's `vec` layout")
    print()
    print("| shape | call | threads | ours ms | vLLM ms | ours/vLLM | ours max err | "
          "vLLM max err |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    longest = max(a + b for a, b in (CALLS[c] for c in args.calls))
    for name in args.shapes:
        kv = _KV(*SHAPES[name], longest)
        for call in args.calls:
            ours, vllm, reference = kv.calls(*CALLS[call])
            ref = reference()
            err_ours = (ours().float() - ref).abs().max().item()
            err_vllm = (vllm().float() - ref).abs().max().item()
            for threads in args.threads:
                torch.set_num_threads(threads)
                t = _medians_ms({"ours": ours, "vllm": vllm}, args.reps)
                print(f"| {name} | {call} | {threads} | {t['ours']:.2f} | {t['vllm']:.2f} | "
                      f"{t['ours'] / t['vllm']:.2f} | {err_ours:.1e} | {err_vllm:.1e} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
