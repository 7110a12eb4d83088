"""Flash-Next kernels on a GPU: correctness at the model's real head dimensions, and throughput
of the Triton backend against the torch reference (``ops.reference``, run on the same GPU) and,
when importable, against ``fla`` (flash-linear-attention: GDN chunked prefill and recurrent
step).

Runs on CUDA and ROCm (torch's ``cuda`` device). Without a GPU it refuses, unless ``--smoke``:
tiny shapes through Triton's CPU interpreter, to check that the script itself works.

    python -m benchmarks.kernels_bench                  # all ops, Flash-Next dimensions
    python -m benchmarks.kernels_bench --ops gdn_chunked_prefill,sparse_attention --tokens 8192
    TRITON_INTERPRET=1 python -m benchmarks.kernels_bench --smoke

Output: one line per op with the max abs error vs the reference (and the tolerance it is held
to), Triton / torch / fla times in ms (``triton.testing.do_bench``, median) and the speed-up
ratios ``torch/triton`` and ``fla/triton`` (> 1: Triton is faster). Exit status 1 if any op
exceeds its tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

OPS = ("gdn_chunked_prefill", "gdn_recurrent_step", "causal_conv1d_prefill",
       "causal_conv1d_update", "ple_conv", "indexer_topk", "sparse_attention")


@dataclass
class Dims:
    """Flash-Next (qwen4_exp) dimensions; the defaults are the transformers config defaults,
    the indexer's from the ``flash-next-small`` catalog entry (the config has no defaults)."""

    gdn_k_heads: int = 16
    gdn_v_heads: int = 32
    gdn_head_dim: int = 128
    conv_kernel: int = 4
    hidden: int = 2048
    hc_count: int = 4
    ngram: int = 3
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 256
    idx_heads: int = 4
    idx_dim: int = 128
    rope_dim: int = 64
    budget: int = 2048
    ratio: int = 4


SMOKE = Dims(gdn_k_heads=1, gdn_v_heads=2, gdn_head_dim=32, hidden=16, hc_count=2, heads=4,
             kv_heads=2, head_dim=32, idx_heads=2, idx_dim=32, rope_dim=8, budget=16, ratio=4)


@dataclass
class Row:
    op: str
    shape: str
    err: float
    tol: float
    t_triton: float
    t_torch: float | None
    t_fla: float | None


def _bench(fn: Callable[[], object], smoke: bool) -> float:
    if smoke:
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def _err(a, b) -> float:
    if isinstance(a, tuple):
        return max(_err(x, y) for x, y in zip(a, b, strict=True))
    if a.dtype in (torch.int32, torch.int64):
        return float((a != b).any(-1).float().mean())  # fraction of differing selections
    return float((a.float() - b.float()).abs().max())


def _fla():
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _cu(lens: list[int], dev: torch.device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=dev)


def run_op(op: str, d: Dims, tokens: int, seqs: int, dev: torch.device, dtype: torch.dtype,
           smoke: bool, tri, ref) -> Row:
    """Build inputs for ``op`` at ``d``, check against the reference, time all backends."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device=dev).to(dt)

    lens = [tokens // seqs] * seqs
    cu = _cu(lens, dev)
    t = sum(lens)
    fla_fn: Callable[[], object] | None = None
    if op in ("gdn_chunked_prefill", "gdn_recurrent_step"):
        h, k_dim = d.gdn_v_heads, d.gdn_head_dim
        n = t if op == "gdn_chunked_prefill" else seqs
        q = torch.nn.functional.normalize(rnd(n, h, k_dim).float(), dim=-1).to(dtype)
        k = torch.nn.functional.normalize(rnd(n, h, k_dim).float(), dim=-1).to(dtype)
        v = rnd(n, h, k_dim)
        gg = -torch.nn.functional.softplus(rnd(n, h, dt=torch.float32))
        beta = torch.sigmoid(rnd(n, h, dt=torch.float32)).to(dtype)
        state = rnd(seqs, h, k_dim, k_dim, dt=torch.float32) * 0.1
        fla = _fla()
        if op == "gdn_chunked_prefill":
            args = (q, k, v, gg, beta, cu, state)
            shape = f"T={t} N={seqs} H={h} D={k_dim}"
            tol = 2e-2 if dtype != torch.float32 else 1e-3
            if fla is not None:
                def fla_fn():
                    return fla[0](q[None], k[None], v[None], gg[None], beta[None],
                                  initial_state=state, output_final_state=True,
                                  cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=True)
        else:
            args = (q, k, v, gg, beta, state)
            shape = f"N={seqs} H={h} D={k_dim}"
            tol = 2e-2 if dtype != torch.float32 else 1e-4
            if fla is not None:
                def fla_fn():
                    return fla[1](q[:, None], k[:, None], v[:, None], gg[:, None],
                                  beta[:, None], initial_state=state,
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    elif op in ("causal_conv1d_prefill", "causal_conv1d_update"):
        c = 2 * d.gdn_k_heads * d.gdn_head_dim + d.gdn_v_heads * d.gdn_head_dim
        w = rnd(c, d.conv_kernel)
        st = rnd(seqs, c, d.conv_kernel - 1)
        if op == "causal_conv1d_prefill":
            args = (rnd(t, c), w, cu, st)
            shape = f"T={t} N={seqs} C={c}"
        else:
            args = (rnd(seqs, c), w, st)
            shape = f"N={seqs} C={c}"
        tol = 2e-2 if dtype != torch.float32 else 1e-5
    elif op == "ple_conv":
        c = d.hc_count * d.hidden
        args = (rnd(t, c), rnd(c, 4), d.ngram, cu, rnd(seqs, c, 3 * d.ngram))
        shape = f"T={t} N={seqs} C={c} dil={d.ngram}"
        tol = 2e-2 if dtype != torch.float32 else 1e-5
    elif op == "indexer_topk":
        # Decode-like: one query per sequence at the end of a `tokens // seqs` history (the
        # reference loops over queries in Python; a full prefill would time the loop).
        pos = torch.tensor(lens, device=dev) - 1
        inv = 1.0 / (1e7 ** (torch.arange(0, d.rope_dim, 2, device=dev).float() / d.rope_dim))
        emb = torch.outer(torch.arange(max(lens), device=dev).float(), inv)
        emb = torch.cat([emb, emb], -1)
        args = (rnd(seqs, d.idx_heads, d.idx_dim), rnd(t, d.idx_dim), cu,
                torch.arange(seqs, device=dev), pos, rnd(d.idx_dim) * 0.1,
                emb.cos().to(dtype), emb.sin().to(dtype))
        kwargs = {"budget": d.budget, "compress_ratio": d.ratio, "eps": 1e-6}
        shape = f"N={seqs} ctx={lens[0]} Hi={d.idx_heads} Di={d.idx_dim} budget={d.budget}"
        tol = 0.0 if dtype == torch.float32 else 0.02  # fraction of rows; bf16: near-ties
        return _finish(op, shape, tol, args, kwargs, tri, ref, smoke, None)
    elif op == "sparse_attention":
        width = d.budget + d.ratio - 1
        ctx = lens[0]
        idx = torch.stack([torch.randperm(ctx, generator=g, device=dev)[:width].sort().values
                           for _ in range(seqs)]).to(torch.int32)
        args = (rnd(seqs, d.heads, d.head_dim), rnd(t, d.kv_heads, d.head_dim),
                rnd(t, d.kv_heads, d.head_dim), cu, torch.arange(seqs, device=dev), idx,
                d.head_dim ** -0.5)
        shape = f"N={seqs} ctx={ctx} H={d.heads}/{d.kv_heads} D={d.head_dim} sel={width}"
        tol = 2e-2 if dtype != torch.float32 else 1e-4
    else:
        raise ValueError(op)
    return _finish(op, shape, tol, args, {}, tri, ref, smoke, fla_fn)


def _finish(op, shape, tol, args, kwargs, tri, ref, smoke, fla_fn) -> Row:
    got = getattr(tri, op)(*args, **kwargs)
    want = getattr(ref, op)(*args, **kwargs)
    err = _err(got, want)
    t_tri = _bench(lambda: getattr(tri, op)(*args, **kwargs), smoke)
    t_ref = _bench(lambda: getattr(ref, op)(*args, **kwargs), smoke)
    t_fla = None
    if fla_fn is not None:
        try:
            t_fla = _bench(fla_fn, smoke)
        except Exception as exc:  # an fla release with another signature must not stop the run
            print(f"{op}: fla call failed ({type(exc).__name__}: {exc}); no fla figure",
                  file=sys.stderr)
    return Row(op, shape, err, tol, t_tri, t_ref, t_fla)


def _fmt(rows: list[Row], device: str) -> str:
    lines = [f"device: {device}",
             f"{'op':24} {'shape':52} {'err':>9} {'tol':>7} {'triton ms':>10} {'torch ms':>10}"
             f" {'torch/tri':>9} {'fla ms':>8} {'fla/tri':>8}"]
    for r in rows:
        ratio = f"{r.t_torch / r.t_triton:9.2f}" if r.t_torch else f"{'-':>9}"
        fla = f"{r.t_fla:8.3f}" if r.t_fla is not None else f"{'-':>8}"
        fla_ratio = f"{r.t_fla / r.t_triton:8.2f}" if r.t_fla is not None else f"{'-':>8}"
        flag = "" if r.err <= r.tol else "  FAIL"
        lines.append(f"{r.op:24} {r.shape:52} {r.err:9.2e} {r.tol:7.0e} {r.t_triton:10.3f} "
                     f"{r.t_torch:10.3f} {ratio} {fla} {fla_ratio}{flag}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " +
                    ", ".join(OPS))
    ap.add_argument("--tokens", type=int, default=4096, help="prefill tokens (all sequences)")
    ap.add_argument("--seqs", type=int, default=4, help="sequences (decode batch size)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU through TRITON_INTERPRET=1 (script check only)")
    args = ap.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        ap.error(f"unknown ops: {unknown}")

    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke needs TRITON_INTERPRET=1 in the environment (set before Python "
                  "starts, since kernels read it when they are defined)", file=sys.stderr)
            return 2
        dev, dims, tokens, seqs = torch.device("cpu"), SMOKE, 130, 2
        device_name = "cpu (Triton interpreter; timings meaningless)"
    else:
        if not torch.cuda.is_available():
            print("no CUDA/ROCm device: nothing to benchmark (use --smoke to check the script)",
                  file=sys.stderr)
            return 2
        dev, dims, tokens, seqs = torch.device("cuda"), Dims(), args.tokens, args.seqs
        from vllm_hybridcache.flash_next.ops.triton.launch import profile

        prof = profile(dev)
        device_name = (f"{torch.cuda.get_device_name(dev)} ({prof.family} {prof.name}, "
                       f"wave{prof.wave}, {prof.lds_bytes // 1024} KB LDS/smem)")
    from vllm_hybridcache.flash_next.ops.reference import ReferenceOps
    from vllm_hybridcache.flash_next.ops.triton.backend import TritonBackend

    dtype = getattr(torch, args.dtype)
    tri, ref = TritonBackend(), ReferenceOps()
    rows = [run_op(op, dims, tokens, seqs, dev, dtype, args.smoke, tri, ref) for op in ops]
    print(_fmt(rows, device_name))
    if _fla() is None:
        print("fla (flash-linear-attention) not importable: no fla column")
    return 0 if all(r.err <= r.tol for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
