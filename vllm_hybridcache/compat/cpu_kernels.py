"""vLLM's CPU kernels: its linear and GDN prefill ops (Flash-Next's CPU backend calls them), the
attention pin that makes a query's arithmetic independent of its prefill step, and the GDN op
loop that hands states inside a step to the inner-capture hook (docs/split-invariance.md).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from vllm_hybridcache.compat.registry import checked

logger = logging.getLogger("vllm_hybridcache")


@checked("0.32.0", "0.33.0")
def vllm_cpu_linear(module: Any) -> Callable[[Any], Any]:
    """Dispatch a bf16 `nn.Linear` to vLLM's CPU GEMM; returns the new forward `x -> y`.

    vLLM's own linear layers run through `dispatch_cpu_unquantized_gemm` (oneDNN / packed
    kernels), which stores the chosen kernel as `module.cpu_linear(x, weight, bias)`; that
    attribute is not a documented interface.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    def forward(x: Any) -> Any:
        return module.cpu_linear(x, module.weight, module.bias)

    return forward


@functools.cache
@checked("0.32.0", "0.33.0")
def vllm_cpu_gdn_prefill() -> Callable[..., Any] | None:
    """vLLM's C++ chunked Gated-DeltaNet prefill for CPU, None when this build lacks it.

    `vllm._custom_ops.chunk_gated_delta_rule_cpu` (registered as `torch.ops._C`): a private
    module. Arguments as vLLM 0.32's Qwen3-Next calls it: (q, k, v, g, beta, state,
    use_qk_l2norm, cu_seqlens, ...) with a leading batch dimension of 1; the state is
    [N, H, Dk, Dv] float32, updated in place.
    """
    import torch

    try:
        from vllm import _custom_ops  # loads vLLM's C extension (torch.ops._C)

        if not hasattr(torch.ops._C, "chunk_gated_delta_rule_cpu"):
            return None
    except (ImportError, AttributeError, RuntimeError):  # no C extension in this build
        return None
    return _custom_ops.chunk_gated_delta_rule_cpu


# --------------------------------------------------------------------- CPU attention pin

CPU_ATTN_Q_HEADS: dict[str, int] = {"amx": 32, "vec": 8}
"""vLLM 0.32.0's CPU attention: query heads one register iteration of the kernel holds, per
ISA (`MaxQHeadNumPerIteration` of its C++ `AttentionImpl`). Any other ISA gets one query token
per piece, which is invariant on every ISA (see `pin_cpu_attention_split`)."""


def cpu_attention_piece_tokens(isa: str, num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per piece such that a piece is one query tile of one register iteration.

    The kernel groups a KV head's query heads per token (GQA) when the iteration's head count
    is a multiple of the group, else it runs heads one by one (q_heads_per_kv = 1).
    """
    heads = CPU_ATTN_Q_HEADS.get(isa)
    if heads is None:
        return 1
    group = num_heads // max(num_kv_heads, 1)
    return max(1, heads // group) if heads % group == 0 else heads


def split_attention_queries(query_start_loc: Any, seq_lens: Any,
                            tokens: int) -> tuple[Any, Any, Any]:
    """Cut every request's queries into pieces of at most `tokens` consecutive queries, each a
    causal request of its own: (query_start_loc, seq_lens, row of the original request) of the
    pieces, which hold the same query rows in the same order."""
    import torch

    qsl = query_start_loc.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    n_pieces = (q_lens + tokens - 1) // tokens
    rows = torch.repeat_interleave(torch.arange(len(q_lens)), n_pieces)
    first = torch.repeat_interleave(torch.cumsum(n_pieces, 0) - n_pieces, n_pieces)
    k = torch.arange(len(rows)) - first                     # piece index inside its request
    ends = torch.minimum((k + 1) * tokens, q_lens[rows])    # query offset of the piece's end
    new_qsl = torch.cat([qsl[:1], qsl[rows] + ends]).to(query_start_loc.dtype)
    new_seq = (seq_lens.to(torch.int64)[rows] - q_lens[rows] + ends).to(seq_lens.dtype)
    return new_qsl, new_seq, rows


@checked("0.32.0", "0.33.0")
def pin_cpu_attention_split(builder_cls: Any = None) -> bool:
    """Make vLLM's CPU attention compute each query the same way whatever step it is in.

    Why (docs/split-invariance.md, "vLLM's Qwen3-Next on CPU"): vLLM 0.32.0's CPU attention
    (`cpu_attention_with_kv_cache`, scheduled by `get_scheduler_metadata`) splits a request's
    queries into work items across threads by the step's total KV length, then into query
    tiles, and sizes each tile's KV tiles from the tile's query head count
    (`calcu_tile_size_with_constant_q`); a query's softmax and P@V sums are blocked by those KV
    tiles, so its bits follow the step. A query tile of at most one register iteration
    (`MaxQHeadNumPerIteration` heads) is rounded up to exactly that many heads and takes the
    one-round KV tile size, the same for every such tile. So each request's queries are cut
    into pieces of that size (`cpu_attention_piece_tokens`), each a causal request of its own
    sharing the request's block-table row, and the scheduler metadata is rebuilt for the
    pieces with KV splitting off (a one-token piece could otherwise have its KV range split
    and reduced across threads). Layers with a sliding window, non-causal or encoder
    attention keep vLLM's metadata. Wraps `CPUAttentionMetadataBuilder.build` (or
    `builder_cls.build`, a subclass in tests); returns False when already wrapped.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    cls = builder_cls or cpu_attn.CPUAttentionMetadataBuilder
    original = cls.build
    if getattr(original, "_hybridcache_pinned", False):
        return False

    def build(self: Any, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> Any:
        md = original(self, common_prefix_len, common_attn_metadata, fast_build)
        if (md.causal is not True or md.dynamic_causal is not None
                or md.encoder_cache is not None or self.window_size != -1):
            return md
        tokens = cpu_attention_piece_tokens(self.isa, self.num_heads, self.num_kv_heads)
        qsl, seq_lens, rows = split_attention_queries(md.query_start_loc, md.seq_lens, tokens)
        md.query_start_loc, md.seq_lens = qsl, seq_lens
        md.block_table = md.block_table[rows]
        md.max_query_len = min(md.max_query_len, tokens)
        md.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype, query_start_loc=qsl,
            causal=True, sliding_window_size=self.window_size, isa=self.isa,
            enable_kv_split=False, dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
        return md

    build._hybridcache_pinned = True  # type: ignore[attr-defined]
    build._hybridcache_original = original  # type: ignore[attr-defined]  # vLLM's, for tests
    cls.build = build
    return True


# --------------------------------------------------------------------- CPU GDN inner states

CPU_GDN_INNER_MODELS: tuple[str, ...] = ("Qwen3NextForCausalLM",)
"""vLLM model classes whose whole bf16 forward on vLLM 0.32.0's CPU backend was checked to be
split-invariant at 64-aligned positions with the attention pin on, and whose recurrent layers
run `_cpu_gdn_attention_nonspec` (docs/split-invariance.md): fine segmentation may be claimed
for them once `install_cpu_gdn_inner_states` is in place."""


def _gdn_sub_metadata(md: Any, *, decodes: int, decode_tokens: int, qsl: Any, slots: Any,
                      has_initial: Any) -> Any:
    """`md` (a `GDNAttentionMetadata`) for a sub-batch: `decodes` decode requests first, then
    prefills; `qsl`, `slots`, `has_initial` cover the sub-batch's non-spec requests."""
    import dataclasses

    n = int(qsl[-1])
    prefills = len(slots) - decodes
    return dataclasses.replace(
        md, num_decodes=decodes, num_decode_tokens=decode_tokens, num_prefills=prefills,
        num_prefill_tokens=n - decode_tokens, num_actual_tokens=n,
        non_spec_query_start_loc=qsl, non_spec_state_indices_tensor=slots,
        has_initial_state=has_initial)


@checked("0.32.0", "0.33.0")
def install_cpu_gdn_inner_states() -> bool:
    """Let vLLM's CPU Gated-DeltaNet layers hand their states at offsets inside a step.

    Why: fine segmentation (docs/split-invariance.md) captures links at 64-aligned positions
    inside a prefill step, from states the recurrent layers hand to the worker's hook (the
    `InnerCapture` protocol of inner_capture.py, set as `layer.inner_capture`). vLLM 0.32.0's
    CPU GDN op (`cpu_gdn_attention_core`, a registered custom op) runs the private module
    function `_cpu_gdn_attention_nonspec` (looked up by name at each call), whose conv and
    `chunk_gated_delta_rule_cpu` kernels write only the final state into the request's slot.
    We replace that module function: a prefilling request whose slot has wanted offsets runs
    through vLLM's original function once per piece (a one-request batch ending at the next
    offset, the state flowing through its slot, has_initial_state true after the first
    piece), which is exactly the op a step ending there runs; after each inner piece the slot's
    conv state (the last width-1 conv inputs, in the cache's layout) and SSM state go to the
    hook as state indices 0 and 1, cloned. Every other request (decodes, prefills without
    wanted offsets) runs through the original function as one batch; with no hook or no
    wanted offset in the step the original is called unchanged. The pieces give the same
    outputs as one call because the kernels' 64-token chunks count from the sequence start
    and step starts are 64-aligned (tests/unit/test_cpu_gdn_inner_states.py). Returns False
    when already installed.
    """
    import torch
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn

    from vllm_hybridcache.inner_capture import capture_pieces

    original = gdn._cpu_gdn_attention_nonspec
    if getattr(original, "_hybridcache_inner", False):
        return False

    def nonspec(layer: Any, md: Any, mixed_qkv: Any, b: Any, a: Any,
                core_attn_out: Any) -> None:
        hook = getattr(layer, "inner_capture", None)
        if hook is None or md.num_prefills == 0:
            return original(layer, md, mixed_qkv, b, a, core_attn_out)
        nd = md.num_decodes
        qsl = md.non_spec_query_start_loc
        slots = md.non_spec_state_indices_tensor
        bounds = qsl.tolist()
        pieces = {i: capture_pieces(hook, int(slots[i]), bounds[i + 1] - bounds[i])
                  for i in range(nd, nd + md.num_prefills)}
        pieces = {i: p for i, p in pieces.items() if len(p) > 1}
        if not pieces:
            return original(layer, md, mixed_qkv, b, a, core_attn_out)
        rest = [i for i in range(nd + md.num_prefills) if i not in pieces]
        if rest:
            idx = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in rest])
            lens = torch.tensor([bounds[i + 1] - bounds[i] for i in rest])
            sub_qsl = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(qsl.dtype)
            out = core_attn_out.new_zeros((len(idx), *core_attn_out.shape[1:]))
            sub = _gdn_sub_metadata(md, decodes=nd, decode_tokens=bounds[nd] - bounds[0],
                                    qsl=sub_qsl, slots=slots[rest],
                                    has_initial=md.has_initial_state[rest])
            original(layer, sub, mixed_qkv[idx], b[idx], a[idx], out)
            core_attn_out.index_copy_(0, idx, out)
        for i, ends in pieces.items():
            slot, start, prev = int(slots[i]), bounds[i], 0
            has_initial = md.has_initial_state[i:i + 1]
            for end in ends:
                lo, hi = start + prev, start + end
                sub = _gdn_sub_metadata(md, decodes=0, decode_tokens=0,
                                        qsl=qsl.new_tensor([0, hi - lo]), slots=slots[i:i + 1],
                                        has_initial=has_initial)
                original(layer, sub, mixed_qkv[lo:hi], b[lo:hi], a[lo:hi],
                         core_attn_out[lo:hi])
                if end < ends[-1]:
                    hook.put(layer.prefix, slot, end, 0, layer.kv_cache[0][slot])
                    hook.put(layer.prefix, slot, end, 1, layer.kv_cache[1][slot])
                has_initial = torch.ones_like(has_initial)
                prev = end
        return None

    nonspec._hybridcache_inner = True  # type: ignore[attr-defined]
    nonspec._hybridcache_original = original  # type: ignore[attr-defined]
    gdn._cpu_gdn_attention_nonspec = nonspec
    return True


@checked("0.32.0", "0.33.0")
def takes_cpu_gdn_inner_capture(layer: Any) -> bool:
    """Whether `layer` (from the static forward context) is one of vLLM's Qwen GDN layers whose
    CPU op hands states inside a step through `layer.inner_capture` (the bend is in place)."""
    if not cpu_gdn_inner_states_installed():
        return False
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    return isinstance(layer, QwenGatedDeltaNetAttention)


@checked("0.32.0", "0.33.0")
def cpu_gdn_inner_states_installed() -> bool:
    """Whether this process runs vLLM's CPU GDN op with `install_cpu_gdn_inner_states` in
    place (on the CPU platform; False where vLLM's module is missing or another platform)."""
    try:
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu()
                and getattr(gdn._cpu_gdn_attention_nonspec, "_hybridcache_inner", False))
