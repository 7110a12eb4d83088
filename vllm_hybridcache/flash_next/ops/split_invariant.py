"""Split-invariant forms of the Flash-Next ops whose per-token result depends on the step.

A forward is *split-invariant* at 64-aligned positions when every token's arithmetic is the
same whether its forward step starts at 0 or at any multiple of 64 and however many tokens the
step holds. Then the state at any 64-aligned position inside a step is the state a step ending
there would leave, which is what fine captures need (docs/split-invariance.md).

`tools.split_invariance` found what breaks it on the CPU backend (docs/split-invariance.md):

- `sparse_attention`: the reference's dense-masked form scores each block of queries against
  every key up to the block's furthest selected position (`span`) and runs the softmax and the
  probability-times-value product over that span; the span and the query blocks follow the
  step, so the reduction lengths (and the GEMM blockings) around a token change with it.
  In the "rowwise" form (`invariant_form`) the reference's dense-masked form stays, with its
  two GEMMs on the row-invariant kernel and the span rounded up to a multiple of 64: a
  longer span only appends keys of probability exactly 0 (`sparse_attention_rowwise`). In the
  "tiles" form every query is reduced over exactly its own selected rows, a fixed-length list
  (`budget + ratio - 1`, padded with -1), in ascending position order, with explicit
  elementwise products and sums over the innermost axis: nothing a query computes depends on
  the other queries of its step.
- `causal_conv1d_prefill` and `ple_conv` in bf16: `F.conv1d` picks its kernel by the sequence
  length, and the bf16 kernels round differently. Here each output is the sum of its K taps,
  multiplied and added one tap at a time in float32 (a fixed order per token), rounded to the
  weight dtype before SiLU as the reference does.

- GEMMs: a GEMM's kernel and blocking follow its row count (measured: the MoE expert GEMMs
  of a short last step, and GEMMs with one or four output columns, give other last bits for
  the same row). Here every GEMM (each `nn.Linear`, `hc_mix`'s three, the MoE router and
  experts) runs the row-invariant CPU linear (`ops/rowwise_linear.py`, csrc/): an output
  element's arithmetic is fixed by its own row and column, so one call of any shape gives a
  row the bits it gets alone. Where that kernel is not built (no compiler) or the model is
  not on the CPU, the former form ("tiles"): every row-wise computation runs on tiles of
  exactly `ROW_TILE` rows, the last one padded with zeros, so every GEMM call has one shape.
  Steps start at multiples of 64 = `ROW_TILE`, so the token at position p is always row
  p mod 64 of its tile; inside the MoE block every expert GEMM is padded to `ROW_TILE` rows
  too (a token's row there is its rank among the earlier tokens of its tile routed to the
  expert, which earlier tokens alone decide). The two forms give other bits; the engine
  fingerprint names the one in use (`invariant_form`).
- Indexer scores: `q @ keys^T` over every pooled group of the step's sequence, a GEMM whose
  shape follows the step; here that GEMM on the row-invariant kernel ("rowwise"), or one
  elementwise product and innermost sum per (query, head, group) ("tiles").

GDN chunked prefill (chunks of 64 counted from the step start) and the norms (one reduction
per row) are split-invariant at 64-aligned steps and pass through to the wrapped backend.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from vllm_hybridcache.config import (
    FLASH_NEXT_SPLIT_INVARIANT_ENV,
    SettingsError,
    connector_cache_off,
)
from vllm_hybridcache.flash_next.ops.interface import FlashNextOps
from vllm_hybridcache.flash_next.ops.reference import ReferenceOps, hc_mix_with, query_blocks

ENV_VAR = FLASH_NEXT_SPLIT_INVARIANT_ENV

ROW_TILE = 64  # rows of every GEMM call; divides the 64-token alignment of steps

# elements per query tile of sparse_attention's [tile, H, L, D] products and of the indexer's
# [tile, Hi, groups, D] products: a query's result does not depend on its tile (every reduction
# is per query); 2^21 floats (8 MiB) keeps a tile's product in cache while it is summed (2^24
# made the split-invariant prefill memory-bound: benchmarks/split_invariance_bench.py)
_TILE_ELEMENTS = 1 << 21

# sparse_attention reduces a tile over the first `_WIDTH_ALIGN * k` entries of the index lists
# that cover every selected entry of the tile (see `_attention_width`)
_WIDTH_ALIGN = 64


AUTO, ON, OFF = "auto", "1", "0"
_SPELLINGS = {"": AUTO, "auto": AUTO, "1": ON, "true": ON, "0": OFF, "false": OFF}


def setting() -> str:
    """`VLLM_HYBRIDCACHE_FLASH_NEXT_SPLIT_INVARIANT`: `auto` (unset, the default: `plan`
    decides per engine), `1` (on in every engine) or `0` (off). Anything else raises
    `SettingsError`, so a typo never silently picks a forward."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value not in _SPELLINGS:
        raise SettingsError(f"{ENV_VAR} must be auto, 1 or 0 (unset = auto), got {value!r}")
    return _SPELLINGS[value]


def plan(vllm_config: Any = None) -> tuple[bool, str]:
    """(whether Flash-Next runs its split-invariant forward in the engine of `vllm_config`,
    why). `1` and `0` decide alone. `auto` turns it on only where it was measured cheaper than
    the step forward (docs/split-invariance.md, "Cost"): an engine running the plugin's
    connector with the cache on (off means off), not speculative and not on vLLM's linear
    layers (a quantized checkpoint, TP > 1: fine cuts are off there anyway), the CPU backend,
    bfloat16 weights, and a host that qualifies (`host_qualifies`): without AVX512-BF16 and
    AMX the rowwise forward took 0.30x the step forward's cold prefill and 0.37-0.45x its
    server CPU on every trace family; with AVX512-BF16 (torch's bf16 GEMM uses it) and the
    kernel's bf16 pair arithmetic, 1.11-1.22x a cold prefill but 0.55-0.88x the server CPU
    on the trace families (it caches more); with AMX it was not measured (off). In float32
    it took 1.02-1.16x a cold prefill and 0.94-1.06x on the trace families over two runs
    (not reliably within 3%), so float32 stays in step mode. The same answer in every
    process of an engine: it reads the engine's config, the setting and the host."""
    value = setting()
    if value != AUTO:
        return value == ON, f"{ENV_VAR}={value}"
    if vllm_config is None:
        return False, "auto without an engine config"
    if off := connector_cache_off(vllm_config):
        return False, f"auto: {off}"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return False, "auto: speculative decoding segments at steps"
    if getattr(vllm_config, "quant_config", None) is not None:
        return False, "auto: a quantized checkpoint runs vLLM's linear layers"
    if hasattr(vllm_config, "parallel_config"):
        from vllm_hybridcache.flash_next.parallel import config_world

        if config_world(vllm_config) > 1:
            return False, "auto: TP > 1 runs vLLM's linear layers"
    from vllm_hybridcache.flash_next.ops.triton.select import default_backend_name

    backend = default_backend_name()
    if backend != "cpu":
        return False, f"auto: the {backend} backend (the row-invariant kernel is CPU only)"
    dtype = str(getattr(getattr(vllm_config, "model_config", None), "dtype", ""))
    if dtype.removeprefix("torch.") != "bfloat16":
        return False, (f"auto: {dtype or 'no'} dtype (measured in bfloat16 only as cheaper; "
                       "float32 costs up to 1.06x on the trace families)")
    return host_qualifies()


def host_qualifies() -> tuple[bool, str]:
    """(whether this host is one where the rowwise forward was measured the cheaper one for a
    bf16 engine, `plan`'s reason): no bf16 GEMM hardware of torch's, or AVX512-BF16 with the
    kernel built with its bf16 pair arithmetic (docs/split-invariance.md, "Cost"); the kernel
    built either way. AMX: not measured, off."""
    fast_bf16 = _host_bf16_gemm()
    if fast_bf16 and fast_bf16 != AVX512_BF16_HOST:
        return False, f"auto: {fast_bf16} (torch's bf16 GEMM uses it; rowwise not measured)"
    if not rowwise_available():
        return False, "auto: the row-invariant CPU kernel did not build on this host"
    if fast_bf16:
        if not _kernel_sums_bf16_pairs():
            return False, (f"auto: {fast_bf16} and the row-invariant kernel was built without "
                           "its bf16 pair arithmetic (it then does float32's work: 2.1-2.8x "
                           "torch's bf16 GEMM)")
        return True, ("auto: bfloat16 on the CPU backend, AVX512-BF16 and the kernel's bf16 "
                      "pair arithmetic: the cheaper forward on the trace families here")
    return True, ("auto: bfloat16 on the CPU backend, no AVX512-BF16/AMX, the row-invariant "
                  "kernel built: the cheaper forward here")


AVX512_BF16_HOST = "the host has AVX512-BF16"


def _kernel_sums_bf16_pairs() -> bool:
    """Whether the built kernel computes bf16 as pair dot products (`arithmetic()`)."""
    from vllm_hybridcache.ops import rowwise_linear

    return "bfloat16:dpbf16" in rowwise_linear.arithmetic()


def _host_bf16_gemm() -> str:
    """'' where torch's CPU bf16 GEMM has no hardware of its own on this host, else what it
    has, AMX first (an AMX host has AVX512-BF16 too), or that torch cannot tell (then the
    cheaper-forward claim is not made)."""
    probes = (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    for label, name in probes:
        probe = getattr(torch.cpu, name, None)
        if probe is None:
            return f"this torch cannot tell whether the host has {label}"
        if probe():
            return f"the host has {label}"
    return ""


def enabled(vllm_config: Any = None) -> bool:
    """Whether the split-invariant forward runs in the engine of `vllm_config` (`plan`)."""
    return plan(vllm_config)[0]


def row_tiles(fn, x: torch.Tensor, *args, tile: int = ROW_TILE):
    """`fn(x, *args)` for a row-wise `fn`, run on tiles of exactly `tile` rows (the last one
    padded with zeros) and cut back to x's rows; tuple results are cut element by element."""
    t = x.shape[0]
    pad = (-t) % tile
    xp = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
    outs = [fn(xp[i:i + tile], *args) for i in range(0, t + pad, tile)]
    if isinstance(outs[0], tuple):
        return tuple(None if parts[0] is None else torch.cat(parts)[:t]
                     for parts in zip(*outs, strict=True))
    return torch.cat(outs)[:t] if outs else fn(x, *args)


def rowwise_available() -> bool:
    """Whether this process has the row-invariant CPU linear (csrc/rowwise_linear_cpu.cpp,
    built for the host on first use); without it the GEMMs run on 64-row tiles."""
    from vllm_hybridcache.ops import rowwise_linear

    return rowwise_linear.available()


def invariant_form(model: torch.nn.Module | None = None) -> str:
    """Which form of the split-invariant forward runs: "rowwise" (every GEMM, the attention's
    two and the indexer's scores on the row-invariant CPU kernel: every row's arithmetic its
    own, one call of any shape) or "tiles" (GEMMs on padded 64-row tiles, the per-query
    attention and elementwise indexer scores). The two give other bits, so the engine
    fingerprint names the form. A model on another device keeps the tiles (the kernel is CPU
    only)."""
    on_cpu = model is None or all(p.device.type == "cpu" for p in model.parameters())
    return "rowwise" if on_cpu and rowwise_available() else "tiles"


def _rowwise_here(x: torch.Tensor) -> bool:
    """Whether an op on `x` runs the "rowwise" form (the kernel built, `x` on the CPU)."""
    return x.device.type == "cpu" and rowwise_available()


def tile_linear_layers(model: torch.nn.Module) -> int:
    """Make every `nn.Linear` of `model` (whatever forward the backend gave it) and every block
    with a row-invariant mode row-invariant, in the form `invariant_form` gives; returns how many
    were changed.

    "rowwise": each `nn.Linear` runs the row-invariant CPU linear on its own weight and bias,
    and a block with a `row_linear` attribute (the MoE block: its router and expert GEMMs) is
    given that kernel. "tiles": each `nn.Linear` runs through `row_tiles`, and a block with a
    fixed-row mode (`fixed_rows`: it gathers rows per expert, so it tiles them itself) turns
    it on. Asking for the attributes rather than the class keeps this module, an op, from
    importing the model's layers."""
    rowwise = invariant_form(model) == "rowwise"
    if rowwise:
        from vllm_hybridcache.ops.rowwise_linear import rowwise_linear
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not getattr(module, "_row_tiled", False):
            if rowwise:
                module.forward = lambda x, m=module: rowwise_linear(x, m.weight, m.bias)
            else:
                inner = module.forward
                module.forward = lambda x, inner=inner: row_tiles(inner, x)
            module._row_tiled = True
            n += 1
        elif rowwise and hasattr(module, "row_linear"):
            module.row_linear = rowwise_linear
            n += 1
        elif not rowwise and hasattr(module, "fixed_rows"):
            module.fixed_rows = ROW_TILE
            n += 1
    return n


def invariant_hc_mix(hc_mix, x, norm_weight, down_weight, up_weight, inject_weight, *,
                     hc_count, eps):
    """A backend's `hc_mix` made row-invariant: its three GEMMs on the row-invariant kernel
    ("rowwise", on the CPU where it is built), else the whole mix on 64-row tiles."""
    if _rowwise_here(x):
        from vllm_hybridcache.ops.rowwise_linear import rowwise_linear

        return hc_mix_with(rowwise_linear, x, norm_weight, down_weight, up_weight,
                           inject_weight, hc_count=hc_count, eps=eps)
    return row_tiles(lambda rows: hc_mix(rows, norm_weight, down_weight, up_weight,
                                         inject_weight, hc_count=hc_count, eps=eps), x)


def _segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def conv_taps(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
              conv_state: torch.Tensor | None, dilation: int,
              activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv, one tap at a time in float32 (see module docstring)."""
    c, kw = weight.shape
    state_len = (kw - 1) * dilation
    w = weight.float()
    y = torch.empty_like(x)
    states = []
    for n, (s, e) in enumerate(_segments(cu_seqlens)):
        prev = conv_state[n] if conv_state is not None else x.new_zeros(c, state_len)
        seq = torch.cat([prev.to(x.dtype), x[s:e].t()], dim=-1)  # [C, L + n]
        length = e - s
        seqf = seq.float()
        acc = w[:, :1] * seqf[:, :length]
        for j in range(1, kw):
            acc = acc + w[:, j:j + 1] * seqf[:, j * dilation: j * dilation + length]
        out = acc.to(weight.dtype)
        if activation is not None:
            out = F.silu(out)
        y[s:e] = out.t().to(x.dtype)
        states.append(seq[:, seq.shape[-1] - state_len:])
    return y, torch.stack(states) if states else x.new_zeros(0, c, state_len)


def _attention_width(ends: list[int], width: int) -> int:
    """Index-list entries a tile of queries reduces over: the smallest multiple of
    `_WIDTH_ALIGN` covering every query's last selected entry (`ends`: one past it), at most
    `width`; the full width when a query selects nothing (kept as it was: all -inf)."""
    if min(ends) == 0:
        return width
    return min(width, -(-max(ends) // _WIDTH_ALIGN) * _WIDTH_ALIGN)


def sparse_attention_per_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               key_cu_seqlens: torch.Tensor, query_seq_idx: torch.Tensor,
                               indices: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of each query over its own selected rows only (module docstring).

    Every query's list has `width` entries, but past its last selected entry every entry is
    padding (-1): its score is -inf, its probability exp(-inf) = 0 exactly, its product with a
    value row a zero. A tile therefore reduces only over the first entries that cover its
    queries' selections (`_attention_width`), which is bit for bit the full-width result:
    torch's CPU softmax and sums add a row's elements lane by lane and chunk by chunk in index
    order, with a chunk structure that does not change below 2^19 elements, so trailing zeros
    leave every partial sum as it was (tests/flash_next/test_split_invariant_speed.py compares
    it with the full-width form on random selections). For a prompt shorter than the budget
    (and every early query of a longer one) most of the list is padding; reducing it was most
    of the split-invariant prefill's cost (docs/split-invariance.md, "Cost")."""
    t_all, h, d = q.shape
    hkv = k.shape[1]
    rep = h // hkv
    width = indices.shape[1]
    out = torch.empty_like(q)
    if t_all == 0 or width == 0:  # nothing to reduce: a sum over no rows is zero
        return torch.zeros_like(q)
    base = key_cu_seqlens.to(torch.long)[query_seq_idx.to(torch.long)]
    kf, vf = k.float(), v.float()  # converted once: the same values as per gathered row
    # one past each query's last selected entry (0: none selected)
    ends = ((indices >= 0) * torch.arange(1, width + 1, device=indices.device)).amax(1).tolist()

    def tile_end(s: int, w: int) -> int:
        return min(t_all, s + max(1, _TILE_ELEMENTS // max(1, h * w * d)))

    s = 0
    while s < t_all:
        e = tile_end(s, _attention_width(ends[s:s + 1], width))
        e = tile_end(s, _attention_width(ends[s:e], width))
        w = _attention_width(ends[s:e], width)
        t = e - s
        idx = indices[s:e, :w].to(torch.long)
        valid = idx >= 0
        rows = base[s:e, None] + idx.clamp(min=0)  # [t, w]
        ks = kf[rows].permute(0, 2, 1, 3)  # [t, Hkv, w, D]
        vs = vf[rows].permute(0, 2, 1, 3)
        qq = q[s:e].float().view(t, hkv, rep, 1, d)
        # [t, Hkv, rep, w]: one dot product of length D per (query, head, row), innermost axis
        scores = (qq * ks.unsqueeze(2)).sum(-1) * scale
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).float()  # rounded as the reference
        # [t, Hkv, rep, D]: rows added in ascending position order for every query
        o = (probs.unsqueeze(-1) * vs.unsqueeze(2)).sum(3)
        out[s:e] = o.reshape(t, h, d).to(q.dtype)
        s = e
    return out


def sparse_attention_rowwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             key_cu_seqlens: torch.Tensor, query_seq_idx: torch.Tensor,
                             indices: torch.Tensor, scale: float, linear) -> torch.Tensor:
    """The reference's dense-masked attention with its two GEMMs run by the row-invariant
    `linear` (the "rowwise" form, module docstring).

    Per sequence, block of queries and KV head: scores of each query row against every key
    up to the block's furthest selected position (`span`, rounded up to a multiple of
    `_WIDTH_ALIGN` with zero keys), -inf outside the query's selection, the softmax, the
    probabilities rounded to the activations' dtype, and `P @ V`. A score's arithmetic is its
    own row's and key's, whatever the block; a key past the query's selection gets score -inf
    and probability exactly 0, and a longer `span` only appends such entries: trailing zeros
    to the softmax's sums (the same argument as `sparse_attention_per_query`'s, over lengths
    that are multiples of 64) and multiply-adds of exact zeros to each lane of `P @ V`'s
    partial sums. So the block a query lands in, which follows the step, changes no bit."""
    _, h, d = q.shape
    hkv = k.shape[1]
    rep = h // hkv
    out = torch.empty_like(q)
    for qi, sel, base in query_blocks(h, key_cu_seqlens, query_seq_idx, indices, 1 << 24):
        t = qi.numel()
        span = int(sel.max()) + 1 if sel.numel() else 0
        width = max(_WIDTH_ALIGN, -(-span // _WIDTH_ALIGN) * _WIDTH_ALIGN)
        mask = torch.zeros(t, width + 1, dtype=torch.bool, device=q.device)
        mask.scatter_(1, torch.where(sel >= 0, sel, width), True)
        mask = mask[:, :width]
        pad = width - span
        qq = q[qi]
        for g in range(hkv):
            kk = k[base:base + span, g]
            vv = v[base:base + span, g]
            if pad:
                kk = torch.cat([kk, kk.new_zeros(pad, d)])
                vv = torch.cat([vv, vv.new_zeros(pad, d)])
            rows = qq[:, g * rep:(g + 1) * rep].reshape(t * rep, d)
            scores = linear(rows, kk) * scale  # [t * rep, width], the activations' dtype
            scores = scores.float().view(t, rep, width).masked_fill(
                ~mask[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype).view(t * rep, width)
            o = linear(probs, vv.t().contiguous())  # [t * rep, D]
            out[qi, g * rep:(g + 1) * rep] = o.view(t, rep, d)
    return out


class _RowwiseScores(ReferenceOps):
    """The reference indexer with its score GEMM run by the row-invariant linear: a score is
    its own (query, head, group) dot product, whatever the call's other rows and columns."""

    def index_scores(self, q: torch.Tensor, block_keys: torch.Tensor,
                     groups: int | None = None) -> torch.Tensor:
        from vllm_hybridcache.ops.rowwise_linear import rowwise_linear

        t, hi, d = q.shape
        nb = block_keys.shape[0]
        ng = nb if groups is None else max(0, min(nb, groups))
        out = torch.zeros(t, hi, nb, dtype=torch.float32, device=q.device)
        if ng:
            out[:, :, :ng] = rowwise_linear(q.float().reshape(t * hi, d),
                                            block_keys[:ng].float()).view(t, hi, ng)
        return out


class _ElementwiseScores(ReferenceOps):
    """The reference indexer with per-(query, head, group) scores (see module docstring)."""

    def index_scores(self, q: torch.Tensor, block_keys: torch.Tensor,
                     groups: int | None = None) -> torch.Tensor:
        """Scores of the first `groups` groups (all when None), each its own product and
        innermost sum over D, so computing fewer groups leaves those bits as they are; the
        columns after them are zeros (the caller masks every group a query cannot see)."""
        t, hi, d = q.shape
        nb = block_keys.shape[0]
        ng = nb if groups is None else max(0, min(nb, groups))
        out = torch.zeros(t, hi, nb, dtype=torch.float32, device=q.device)
        tile = max(1, _TILE_ELEMENTS // max(1, hi * ng * d))
        for s in range(0, t, tile):
            out[s:s + tile, :, :ng] = (q[s:s + tile, :, None, :].float()
                                       * block_keys[None, None, :ng]).sum(-1)
        return out


_INDEXER = _ElementwiseScores()
_ROWWISE_INDEXER = _RowwiseScores()


class SplitInvariantOps(FlashNextOps):
    """A backend whose step-dependent ops are replaced by split-invariant forms; every other
    op is the wrapped backend's."""

    def __init__(self, inner: FlashNextOps) -> None:
        self.inner = inner
        self.name = f"{inner.name}+split_invariant"

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def prepare_model(self, model: torch.nn.Module) -> None:
        self.inner.prepare_model(model)
        tile_linear_layers(model)

    def gdn_chunked_prefill(self, *args, **kwargs):
        return self.inner.gdn_chunked_prefill(*args, **kwargs)

    def gdn_recurrent_step(self, *args, **kwargs):
        return self.inner.gdn_recurrent_step(*args, **kwargs)

    def causal_conv1d_prefill(self, x, weight, cu_seqlens, conv_state, activation="silu"):
        return conv_taps(x, weight, cu_seqlens, conv_state, 1, activation)

    def causal_conv1d_update(self, *args, **kwargs):
        return self.inner.causal_conv1d_update(*args, **kwargs)

    def indexer_topk(self, q, *args, **kwargs):
        if _rowwise_here(q):
            return _ROWWISE_INDEXER.indexer_topk(q, *args, **kwargs)
        return _INDEXER.indexer_topk(q, *args, **kwargs)

    def sparse_attention(self, q, k, v, key_cu_seqlens, query_seq_idx, indices, scale):
        if _rowwise_here(q):
            from vllm_hybridcache.ops.rowwise_linear import rowwise_linear

            return sparse_attention_rowwise(q, k, v, key_cu_seqlens, query_seq_idx, indices,
                                            scale, rowwise_linear)
        return sparse_attention_per_query(q, k, v, key_cu_seqlens, query_seq_idx, indices,
                                          scale)

    def ple_conv(self, x, weight, dilation, cu_seqlens, conv_state):
        return conv_taps(x, weight, cu_seqlens, conv_state, dilation, "silu")

    def hc_mix(self, x, norm_weight, down_weight, up_weight, inject_weight, *, hc_count, eps):
        return invariant_hc_mix(self.inner.hc_mix, x, norm_weight, down_weight, up_weight,
                                inject_weight, hc_count=hc_count, eps=eps)

    def hc_inject(self, *args, **kwargs):
        return self.inner.hc_inject(*args, **kwargs)
