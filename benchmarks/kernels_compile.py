"""Compile every Flash-Next Triton kernel ahead of time for the real GPU targets, at Flash-Next's
dimensions and with each family's launch parameters, and report what the compiler allocated.

This needs no GPU: Triton compiles to AMD code objects (``hsaco``) and to CUDA ``cubin`` on
any machine. It catches what the CPU interpreter cannot (the interpreter accepts programs the
compiler rejects) and shows register pressure, spills and shared memory per architecture,
which is what the launch table in ``ops/triton/launch.py`` is tuned against.

    python -m benchmarks.kernels_compile                       # all kernels, all targets
    python -m benchmarks.kernels_compile --targets gfx1151 --kernels gdn_chunk

Targets: ``gfx1151`` (RDNA3.5 Strix Halo), ``gfx1201`` (RDNA4 R9700), ``gfx942`` (CDNA3
MI300), ``sm90`` (Hopper). Columns: registers per lane (AMD VGPRs / NVIDIA registers), spilled
registers (AMD: VGPR spill count; NVIDIA: stack bytes / 4), shared memory (LDS) bytes as
Triton allocates it, scratch (stack) bytes per lane. Exit status 1 if a kernel fails
to compile.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

TARGETS = {
    "gfx1151": ("hip", "gfx1151", 32, "rdna"),
    "gfx1201": ("hip", "gfx1201", 32, "rdna"),
    "gfx942": ("hip", "gfx942", 64, "cdna"),
    "sm90": ("cuda", 90, 32, "nvidia"),
}
KERNELS = ("conv", "ple_conv", "gdn_chunk", "gdn_recurrent", "gdn_recurrent_mtp",
           "indexer_pool", "indexer_pool_paged", "indexer_score", "indexer_topk",
           "sparse_attn", "sparse_attn_paged", "sparse_attn_split", "attn_combine")


@dataclass
class Spec:
    """One kernel instance: the jit function, pointer dtypes, float scalars and constexprs."""

    fn: object
    pointers: dict[str, str]
    floats: tuple[str, ...]
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int


def _specs(family: str) -> dict[str, Spec]:
    """Kernel instances as the wrappers launch them for ``family`` (bf16 activations)."""
    import triton

    from vllm_hybridcache.flash_next.ops.triton import conv, gdn, indexer, sparse_attn
    from vllm_hybridcache.flash_next.ops.triton.launch import _TABLE

    def cfg(name: str) -> dict[str, int]:
        return dict(_TABLE[name][family])

    out: dict[str, Spec] = {}
    c = cfg("conv")
    conv_ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
                 "state_ptr": "*bf16", "new_state_ptr": "*bf16", "cu_ptr": "*i32",
                 "slot_ptr": "*i32", "out_slot_ptr": "*i32", "init_ptr": "*i1"}
    for name, dil, chans in (("conv", 1, 8192), ("ple_conv", 3, 8192)):
        s = 3 * dil
        out[name] = Spec(conv._conv_kernel, conv_ptrs, (), {
            "W": 4, "DIL": dil, "S": s, "SP": triton.next_power_of_2(s), "HAS_BIAS": False,
            "SILU": True, "HAS_INIT": True, "CAST_X": False,
            "BD": min(c["BD"], chans), "BT": c["BT"]}, c["num_warps"], c["num_stages"])
    gdn_ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32",
                "b_ptr": "*bf16", "o_ptr": "*bf16", "state_ptr": "*fp32",
                "new_state_ptr": "*fp32", "cu_ptr": "*i32", "in_slot_ptr": "*i32",
                "out_slot_ptr": "*i32", "init_ptr": "*i1"}
    c = cfg("gdn_chunk")
    out["gdn_chunk"] = Spec(gdn._gdn_chunk_kernel, gdn_ptrs, ("scale",), {
        "HV": 32, "HK": 16, "K": 128, "V": 128, "KP": 128, "BV": c["BV"], "BT": c["BT"],
        "L2NORM": True, "HAS_INIT": True}, c["num_warps"], c["num_stages"])
    c = cfg("gdn_recurrent")
    for name, per_token in (("gdn_recurrent", False), ("gdn_recurrent_mtp", True)):
        out[name] = Spec(gdn._gdn_recurrent_kernel, gdn_ptrs, ("scale",), {
            "HV": 32, "HK": 16, "K": 128, "V": 128, "KP": 128, "BV": c["BV"], "L2NORM": True,
            "HAS_INIT": True, "PER_TOKEN": per_token}, c["num_warps"], c["num_stages"])
    c = cfg("indexer_pool")
    for name, paged in (("indexer_pool", False), ("indexer_pool_paged", True)):
        out[name] = Spec(indexer._pool_kernel, {
            "keys_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
            "out_ptr": "*bf16", "key_cu_ptr": "*i32", "block_cu_ptr": "*i32", "bt_ptr": "*i32"},
            ("eps",), {"RATIO": 4, "DI": 128, "DP": 128, "R": 64, "PAGED": paged,
                       "BB": c["BB"]}, c["num_warps"], c["num_stages"])
    # The score kernel is autotuned; compile its middle candidate (BB=64, 4 warps).
    out["indexer_score"] = Spec(indexer._score_kernel.fn, {
        "q_ptr": "*bf16", "bk_ptr": "*bf16", "score_ptr": "*fp32", "seq_ptr": "*i32",
        "pos_ptr": "*i32", "block_cu_ptr": "*i32"}, ("sqrt_d",), {
        "HI": 4, "HP": 16, "DI": 128, "DP": 128, "RATIO": 4, "UPCAST": False, "BB": 64}, 4, 1)
    c = cfg("indexer_topk")
    out["indexer_topk"] = Spec(indexer._topk_kernel, {
        "score_ptr": "*fp32", "out_ptr": "*i32", "pos_ptr": "*i32"}, (), {
        "TOPK": 512, "RATIO": 4, "RP": 4, "WIDTH": 2051, "WP": 4096, "BN": c["BN"]},
        c["num_warps"], c["num_stages"])
    c = cfg("sparse_attn")
    for name, paged, split in (("sparse_attn", False, False), ("sparse_attn_paged", True, False),
                               ("sparse_attn_split", True, True)):
        out[name] = Spec(sparse_attn._sparse_attn_kernel, {
            "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
            "o_ptr": "*fp32" if split else "*bf16", "idx_ptr": "*i32", "seq_ptr": "*i32",
            "kcu_ptr": "*i32", "bt_ptr": "*i32", "ml_ptr": "*fp32" if split else "*bf16"},
            ("scale",), {"G": 8, "GP": 16, "D": 256, "DP": 256, "PAGED": paged,
                         "UPCAST": False, "SPLIT": split, "BN": c["BN"]},
            c["num_warps"], c["num_stages"])
    out["attn_combine"] = Spec(sparse_attn._combine_kernel, {
        "ws_ptr": "*fp32", "ml_ptr": "*fp32", "o_ptr": "*bf16"}, (), {
        "D": 256, "DP": 256, "SP": 16}, 4, 1)
    return out


def _signature(spec: Spec) -> dict[str, str]:
    sig = {}
    for name in spec.fn.arg_names:
        if name in spec.constexprs:
            sig[name] = "constexpr"
        elif name in spec.pointers:
            sig[name] = spec.pointers[name]
        elif name in spec.floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _amd_usage(asm: str) -> dict[str, int]:
    def get(key: str) -> int:
        m = re.search(re.escape(key) + r":\s+(\d+)", asm)
        return int(m.group(1)) if m else -1

    return {"regs": get(".vgpr_count"), "spills": get(".vgpr_spill_count"),
            "shared": get(".group_segment_fixed_size"),
            "scratch": get(".private_segment_fixed_size")}


def _cuda_usage(cubin: bytes) -> dict[str, int]:
    """Registers and local-memory (spill) bytes of the cubin Triton built, via cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=False)
    finally:
        os.unlink(f.name)
    text = res.stdout + res.stderr
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return {"regs": int(regs.group(1)) if regs else -1,
            "spills": int(stack.group(1)) // 4 if stack else -1, "shared": -1,
            "scratch": int(stack.group(1)) if stack else -1}


def compile_one(kernel: str, target: str, overrides: dict[str, int] | None = None
                ) -> dict[str, int]:
    """Compile ``kernel`` for ``target``; returns register/spill/shared/scratch figures.

    ``overrides`` replaces launch parameters (``num_warps``, ``num_stages`` or a constexpr such
    as ``BV``) to try a change to the launch table without editing it.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch, warp, family = TARGETS[target]
    spec = _specs(family)[kernel]
    for key, val in (overrides or {}).items():
        if key in ("num_warps", "num_stages"):
            setattr(spec, key, val)
        elif key in spec.constexprs:
            spec.constexprs[key] = val
    src = ASTSource(spec.fn, signature=_signature(spec), constexprs=spec.constexprs)
    compiled = triton.compile(src, target=GPUTarget(backend, arch, warp),
                              options={"num_warps": spec.num_warps,
                                       "num_stages": spec.num_stages})
    if backend == "hip":
        usage = _amd_usage(compiled.asm["amdgcn"])
        usage["shared"] = int(compiled.metadata.shared)
    else:
        usage = _cuda_usage(compiled.asm["cubin"])
        usage["shared"] = int(compiled.metadata.shared)
    usage["warps"] = spec.num_warps
    return usage


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                    help="override a launch parameter for every kernel that has it")
    args = ap.parse_args(argv)
    overrides = {k: int(v) for k, v in (item.split("=", 1) for item in args.set)}
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter defines no compilable kernels",
              file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    failed = 0
    print(f"{'target':8} {'kernel':18} {'warps':>5} {'regs':>5} {'spills':>6} {'shared B':>9} "
          f"{'scratch B':>9}")
    for target in [t for t in args.targets.split(",") if t]:
        for kernel in [k for k in args.kernels.split(",") if k]:
            try:
                u = compile_one(kernel, target, overrides)
            except Exception as exc:
                failed += 1
                msg = str(exc).strip().splitlines()
                print(f"{target:8} {kernel:18} FAILED: {msg[-1] if msg else type(exc).__name__}")
                continue
            print(f"{target:8} {kernel:18} {u['warps']:5d} {u['regs']:5d} {u['spills']:6d} "
                  f"{u['shared']:9d} {u['scratch']:9d}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
