"""What fits where: a hybrid checkpoint's weights, K/V space and cache budgets on a box.

Why a tool and not only a table: the sizes that decide a deployment (the weights at a
quantization, the recurrent state a link copies, the K/V bytes a token holds, each per tensor
parallel rank) follow from the checkpoint's config, and the project's users run checkpoints
this repository never sees (docs/deploy-rocm.md, "Sizing"). Everything here is computed from
the config alone, with the same rules the engine applies:

- parameters: transformers builds the model on the meta device (no memory, no weights; with
  its vision tower when the config has one), and each parameter is counted in its group:
  routed experts, other projection weights (what a quantized checkpoint quantizes; the router,
  one-output gates and the GDN `in_proj_ba` stay bf16, `SMALL_PROJECTIONS`), embeddings and the
  LM head (kept in bf16 by the usual FP8 and 4-bit recipes), the rest (norms, convolutions,
  routers, a vision tower: bf16, on every rank) and persistent buffers (in their own dtypes);
- the recurrent state of a request (what every link copies whole): vLLM's own
  `MambaStateShapeCalculator` for Gated DeltaNet layers, Flash-Next's own section shapes
  (flash_next/gdn.py) for `qwen4_exp`;
- the K/V rows of a token (what a link copies since its parent): two rows of the kv heads a
  rank holds (replicated when there are fewer kv heads than ranks, as vLLM does) per
  full-attention layer; Flash-Next's QSA row (K, V and the index key, flash_next/backend.py).

Not counted: vLLM's activation peak and runtime buffers (the `reserve_gib` margin stands in
for them; vLLM profiles the real one at start-up), the MTP layer's weights (transformers'
classes do not build it), quantization formats' kernels (whether a chip runs a format is
vLLM's matter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GIB = 1024 ** 3


@dataclass(frozen=True)
class Quant:
    """A weight format: bytes per quantized weight, plus its scales (and zero points)."""

    name: str
    weight_bytes: float
    per_row_bytes: int = 0          # one scale per output row (per-channel formats)
    group: int = 0                  # weights per group (grouped formats), 0 = none
    per_group_bytes: float = 0.0    # scale + packed zero point of one group

    def bytes_for(self, rows: int, cols: int) -> float:
        n = rows * cols
        extra = rows * self.per_row_bytes
        if self.group:
            extra += rows * math.ceil(cols / self.group) * self.per_group_bytes
        return n * self.weight_bytes + extra


QUANTS: dict[str, Quant] = {
    "bf16": Quant("bf16", 2.0),
    # compressed-tensors FP8 dynamic / W8A8 int8: 1 byte a weight, a float32 scale per row
    "fp8": Quant("fp8", 1.0, per_row_bytes=4),
    "w8a8": Quant("w8a8", 1.0, per_row_bytes=4),
    # GPTQ/AWQ 4-bit, group 128: a half byte a weight, an fp16 scale and a 4-bit zero a group
    "w4a16": Quant("w4a16", 0.5, group=128, per_group_bytes=2.5),
}


@dataclass(frozen=True)
class Box:
    """A machine: its GPUs, the memory each may use, the host RAM and what the OS keeps."""

    name: str
    gpus: int
    gpu_gib: float               # memory one GPU may map (VRAM, or the GTT limit on an APU)
    host_gib: float
    unified: bool                # the GPU's memory is the host RAM (APU)
    gpu_memory_utilization: float
    os_gib: float = 8.0


BOXES: dict[str, Box] = {
    # Radeon AI PRO R9700: 32 GB of VRAM. The host RAM is an assumption (64 GiB), change it
    # with --host-gib.
    "r9700": Box("R9700 x1", 1, 32.0, 64.0, False, 0.90),
    "r9700x2": Box("R9700 x2", 2, 32.0, 64.0, False, 0.90),
    # Strix Halo with 128 GB: the GTT limit of docs/deploy-rocm.md (gttsize=122880 MiB)
    "strix-halo-128": Box("Strix Halo 128 GB", 1, 120.0, 128.0, True, 0.75),
}


@dataclass(frozen=True)
class ParamGroups:
    """Parameter counts by how a quantized checkpoint stores them; the (count, rows, cols) of
    every projection shape a quantization rewrites, routed experts apart."""

    experts: int
    dense: int
    embedding: int
    other: int
    dense_shapes: tuple[tuple[int, int, int], ...]
    expert_shapes: tuple[tuple[int, int, int], ...]
    buffers: int = 0            # elements of persistent buffers (stored in checkpoints too)
    buffer_bytes: int = 0       # in their own dtypes, on every rank

    @property
    def total(self) -> int:
        return self.experts + self.dense + self.embedding + self.other + self.buffers


def parameter_groups(config: Any) -> ParamGroups:
    """Count the parameters of `config`'s model, built by transformers on the meta device
    (with its vision tower when the config has one)."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision = getattr(config, "vision_config", None) is not None
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if vision
                 else AutoModelForCausalLM).from_config(config)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out = model.get_output_embeddings()
    if out is not None:
        embeddings.add(id(out.weight))
    experts = dense = embedding = other = 0
    dense_shapes: dict[tuple[int, int], int] = {}
    expert_shapes: dict[tuple[int, int], int] = {}
    for name, p in model.named_parameters():
        n = p.numel()
        if id(p) in embeddings:
            embedding += n
        elif ".experts." in name and p.ndim in (2, 3):
            experts += n
            shape = (int(p.shape[-2]), int(p.shape[-1]))
            expert_shapes[shape] = expert_shapes.get(shape, 0) + n // math.prod(shape)
        elif p.ndim == 2 and _is_projection(name, p.shape):
            dense += n
            shape = (int(p.shape[0]), int(p.shape[1]))
            dense_shapes[shape] = dense_shapes.get(shape, 0) + 1
        else:
            other += n
    buffers = buffer_bytes = 0
    for module in model.modules():   # persistent buffers are stored in checkpoints too
        for name, b in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                buffers += b.numel()
                buffer_bytes += b.numel() * b.element_size()

    def listed(shapes: dict[tuple[int, int], int]) -> tuple[tuple[int, int, int], ...]:
        return tuple((c, r, k) for (r, k), c in sorted(shapes.items()))

    return ParamGroups(experts, dense, embedding, other, listed(dense_shapes),
                       listed(expert_shapes), buffers, buffer_bytes)


SMALL_PROJECTIONS = ("mlp.gate", "shared_expert_gate", "in_proj_ba")
"""Projections the usual recipes leave in bf16 (and so do the embedded quantized checkpoints,
models/quantize.py): the router, the shared-expert gate, the GDN `in_proj_ba`."""


def _is_projection(name: str, shape: Any) -> bool:
    """A projection a quantization recipe rewrites: not one of `SMALL_PROJECTIONS`, not a
    vision tower's weight."""
    leaf = name.rsplit(".weight", 1)[0]
    return (not leaf.endswith(SMALL_PROJECTIONS) and shape[0] > 1
            and "visual" not in name and "vision" not in name)


def weight_bytes_per_rank(groups: ParamGroups, quant: Quant, tp: int,
                          experts: bool = True) -> float:
    """Bytes of weights one of `tp` ranks holds: projections (and the routed experts, unless
    `experts` is False) in `quant`, split over the ranks (experts too: vLLM's fused MoE splits
    every expert); embeddings and LM head in bf16, split over the vocabulary; the rest in bf16
    on every rank."""
    shapes = groups.dense_shapes + (groups.expert_shapes if experts else ())
    projections = sum(c * quant.bytes_for(r, k) for c, r, k in shapes)
    kept = 0 if experts else 2.0 * groups.experts
    return ((projections + kept) / tp + 2.0 * groups.embedding / tp + 2.0 * groups.other
            + groups.buffer_bytes)


@dataclass(frozen=True)
class StateBytes:
    """What one request holds on one rank: its recurrent sections (copied whole by every
    link) and the K/V bytes of one token (a link copies its rows since the parent)."""

    sections: int
    row: int


def mtp_layers(text: Any) -> int:
    """The checkpoint's MTP layers (each holds one more attention layer's rows on the MTP
    route): Flash-Next and Qwen3.5 name them `mtp_num_hidden_layers`, Qwen3-Next
    `num_nextn_predict_layers`."""
    return int(getattr(text, "mtp_num_hidden_layers", 0)
               or getattr(text, "num_nextn_predict_layers", 0) or 0)


def state_bytes(config: Any, tp: int, dtype: Any = None, mtp: bool = False,
                ssm_dtype: str = "auto") -> StateBytes:
    """One rank's state of one request for `config` at tensor parallel size `tp` (`mtp`: on
    the MTP route, the draft layer's rows included). `ssm_dtype`: vLLM's
    `--mamba-ssm-cache-dtype` ("auto" = the model's dtype; vLLM's CPU platform sets float32
    where its GDN kernel is accelerated); Flash-Next keeps its recurrent state in float32
    whatever it says."""
    import torch

    dtype = dtype or torch.bfloat16
    text = config.get_text_config()
    size = torch.empty((), dtype=dtype).element_size()
    types = list(getattr(text, "layer_types", None) or [])
    if not types or "linear_attention" not in types:
        raise ValueError("the config names no linear_attention layers: not a Gated DeltaNet "
                         "hybrid this tool knows")
    if mtp:
        types += ["full_attention"] * mtp_layers(text)
    if str(getattr(text, "model_type", "")).startswith("qwen4_exp"):
        return _flash_next_state(text, types, tp, dtype)
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )

    conv, ssm = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
        text.linear_value_head_dim, text.linear_conv_kernel_dim)
    conv_dtype, ssm_dtype = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        dtype, "auto", ssm_dtype)
    per_layer = (math.prod(conv) * torch.empty((), dtype=conv_dtype).element_size()
                 + math.prod(ssm) * torch.empty((), dtype=ssm_dtype).element_size())
    kv_heads = max(1, text.num_key_value_heads // tp)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return StateBytes(sections=types.count("linear_attention") * per_layer,
                      row=types.count("full_attention") * 2 * kv_heads * head_dim * size)


def _flash_next_state(text: Any, types: list[str], tp: int, dtype: Any) -> StateBytes:
    import torch

    from vllm_hybridcache.flash_next.backend import row_width
    from vllm_hybridcache.flash_next.gdn import gdn_state_shapes, ple_state_shapes, section_dtypes

    def nbytes(shapes, dtypes) -> int:
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size()
                   for s, d in zip(shapes, dtypes, strict=True))

    gdn = nbytes(gdn_state_shapes(text, tp), section_dtypes(dtype, False))
    ple_ids = set(getattr(text, "ple_layer_ids", None) or [])
    ple = nbytes(ple_state_shapes(text), section_dtypes(dtype, True)[2:]) if ple_ids else 0
    attention = [t for t in types if t != "linear_attention"]
    size = torch.empty((), dtype=dtype).element_size()
    return StateBytes(sections=types.count("linear_attention") * gdn + len(ple_ids) * ple,
                      row=len(attention) * row_width(text, tp) * size)


@dataclass(frozen=True)
class Fit:
    """One line of the table: a quantization at a tensor parallel size on a box."""

    quant: str
    tp: int
    weights_gib: float          # per GPU
    kv_gib: float               # per GPU, what vLLM's share leaves for K/V and states
    kv_tokens: int              # tokens of K/V that space holds beside max_num_seqs states
    fits: bool                  # the weights and one max_model_len request fit
    link_mib: float             # a link at the grid: sections + grid rows, all ranks
    budget_gib: float           # host RAM for the cache (VLLM_HYBRIDCACHE_BUDGET_BYTES)
    links: int                  # grid links the budget holds
    session_gib: float          # the links of one max_model_len session (disk tier sizing)


def cache_budget_gib(box: Box) -> float:
    """The cache budget for `box` (see `plan`); the compose files set it (deploy/)."""
    gpu_share = box.gpu_gib * box.gpu_memory_utilization if box.unified else 0.0
    return max(0.0, (box.host_gib - gpu_share - box.os_gib) / 2)


def plan(groups: ParamGroups, states: dict[int, StateBytes], box: Box, quant: Quant, tp: int,
         *, max_model_len: int, max_num_seqs: int, grid: int = 2048,
         reserve_gib: float = 2.0) -> Fit:
    """Whether `quant` at `tp` fits `box`, the K/V space left and the cache budget to set.

    Fits: the weights, `reserve_gib` and one `max_model_len` request's K/V and state within
    vLLM's share of a GPU. The budget: half the host RAM that the GPUs' share (on an APU) and
    the OS leave; the other half is the engine process's (tokenizers, pinned buffers, the
    weights' page cache while loading) and holds the cache's memory floor, below which
    captures stop (`memory_floor_bytes`, 8 GiB in the compose files)."""
    st = states[tp]
    weights = weight_bytes_per_rank(groups, quant, tp)
    usable = box.gpu_gib * GIB * box.gpu_memory_utilization - reserve_gib * GIB - weights
    kv_tokens = int(max(0.0, usable - max_num_seqs * st.sections) // st.row) if st.row else 0
    fits = usable >= st.sections + st.row * max_model_len
    budget = cache_budget_gib(box)
    link = tp * (st.sections + grid * st.row)
    session = math.ceil(max_model_len / grid) * link
    return Fit(quant.name, tp, weights / GIB, max(0.0, usable) / GIB, kv_tokens, fits,
               link / 2 ** 20, budget, int(budget * GIB // link) if link else 0,
               session / GIB)


def table(config: Any, boxes: list[Box], quants: list[Quant], *, max_model_len: int,
          max_num_seqs: int, grid: int = 2048, reserve_gib: float = 2.0,
          mtp: bool = False, ssm_dtype: str = "auto") -> list[tuple[Box, Fit]]:
    """Every box x quantization x tensor parallel size the box's GPUs allow (1 and, with two
    GPUs, 2)."""
    groups = parameter_groups(config)
    rows = []
    for box in boxes:
        sizes = [tp for tp in (1, 2, 4, 8) if tp <= box.gpus]
        states = {tp: state_bytes(config, tp, mtp=mtp, ssm_dtype=ssm_dtype) for tp in sizes}
        for q in quants:
            for tp in sizes:
                rows.append((box, plan(groups, states, box, q, tp, max_model_len=max_model_len,
                                       max_num_seqs=max_num_seqs, grid=grid,
                                       reserve_gib=reserve_gib)))
    return rows


def render(rows: list[tuple[Box, Fit]], title: str) -> str:
    """The table as markdown (docs/deploy-rocm.md, "Sizing")."""
    out = [f"{title}", "",
           "| box | weights | TP | weights GiB / GPU | fits | K/V space GiB / GPU | "
           "K/V tokens | link MiB (grid) | cache budget GiB | links it holds | "
           "disk GiB a full session |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for box, f in rows:
        out.append(f"| {box.name} | {f.quant} | {f.tp} | {f.weights_gib:.1f} | "
                   f"{'yes' if f.fits else 'no'} | {f.kv_gib:.1f} | "
                   f"{f.kv_tokens:,} | {f.link_mib:.0f} | {f.budget_gib:.0f} | {f.links:,} | "
                   f"{f.session_gib:.1f} |")
    return "\n".join(out)


PRESETS: dict[str, str] = {
    # transformers' default config of the class, which is the published shape of the model
    # its docstring names (79.7 B and 35.1 B parameters as built here)
    "qwen3-next-80b-a3b": "Qwen3NextConfig",
    "qwen3.5-35b-a3b": "Qwen3_5MoeConfig",
}


def load_config(source: str) -> Any:
    """A checkpoint folder, a config.json, or `preset:NAME` (`PRESETS`: Qwen3-Next-80B-A3B,
    Qwen3.5-35B-A3B)."""
    from pathlib import Path

    import transformers
    from transformers import AutoConfig

    if source.startswith("preset:"):
        name = source.removeprefix("preset:")
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return getattr(transformers, PRESETS[name])()
    path = Path(source)
    if path.is_file():
        import json

        data = json.loads(path.read_text())
        return AutoConfig.for_model(data.pop("model_type"), **data)
    if not path.is_dir():  # never a hub id: nothing is downloaded
        raise ValueError(f"{source}: no checkpoint folder or config.json there")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="vllm-hybridcache sizing",
        description="What fits where: weights per GPU, K/V space, link size and cache budget "
                    "for a hybrid checkpoint on the project's boxes (docs/deploy-rocm.md).")
    p.add_argument("model", help="checkpoint folder, config.json, or preset:NAME ("
                   + ", ".join(sorted(PRESETS)) + ")")
    p.add_argument("--box", nargs="+", choices=sorted(BOXES), default=sorted(BOXES))
    p.add_argument("--quant", nargs="+", choices=sorted(QUANTS),
                   default=["bf16", "fp8", "w4a16"])
    p.add_argument("--host-gib", type=float, help="host RAM of the box (replaces the preset's)")
    p.add_argument("--max-model-len", type=int, default=65536)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--grid", type=int, default=2048, help="the cache's grid (links' rows)")
    p.add_argument("--reserve-gib", type=float, default=2.0,
                   help="GPU memory kept for activations and runtime buffers")
    p.add_argument("--mtp", action="store_true", help="the MTP route: the draft layer's rows")
    p.add_argument("--mamba-ssm-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="vLLM's flag of that name, as the server will run")
    args = p.parse_args(argv)
    try:
        config = load_config(args.model)
        boxes = [BOXES[b] for b in args.box]
        if args.host_gib is not None:
            from dataclasses import replace

            boxes = [replace(b, host_gib=args.host_gib) for b in boxes]
        rows = table(config, boxes, [QUANTS[q] for q in args.quant],
                     max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                     grid=args.grid, reserve_gib=args.reserve_gib, mtp=args.mtp,
                     ssm_dtype=args.mamba_ssm_cache_dtype)
    except (OSError, ValueError, KeyError) as e:
        print(f"vllm-hybridcache sizing: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a config transformers cannot build: say so, no traceback
        print(f"vllm-hybridcache sizing: error: cannot size {args.model}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(render(rows, f"{args.model}: max_model_len {args.max_model_len}, "
                       f"max_num_seqs {args.max_num_seqs}, grid {args.grid}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
