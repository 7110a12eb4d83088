"""The Flash-Next kernel interface: every op the model calls, with shapes and semantics.

One backend (`reference`, `cpu`, `triton`, ...) implements all of it. The model never calls a
kernel directly, so a backend can be swapped without touching the layers, and every backend is
tested op by op against `ops.reference`, whose semantics are exactly those of transformers'
`modeling_qwen4_exp` (the numerics oracle).

Conventions (all ops):
- Variable-length batches are packed along the token axis; `cu_seqlens` is an int32/int64
  tensor of shape [N + 1] with cu_seqlens[0] = 0 and cu_seqlens[N] = T (cumulative offsets).
- Recurrent GDN state is float32 in and out, layout [N, H, Dk, Dv] (as transformers keeps it:
  `state[n, h, i, j]` maps key dim i to value dim j).
- Convolution states are channel-major [N, C, L], holding the last L *inputs* (before the
  convolution), oldest first; a sequence without history starts from zeros.
- Ops are functional: they return new states and never modify their inputs, so a caller can
  gather states from a cache, run the op and scatter the result back (and a test can compare).
- Output dtypes follow the activations (`q`/`x`), never the fp32 state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class FlashNextOps(ABC):
    """All kernels of the Flash-Next model. Subclass and implement every method."""

    name: str = "abstract"

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Called once after the weights are loaded. A backend may repack weights or swap
        module implementations (e.g. a faster GEMM); the default does nothing."""
        del model

    # ---------------------------------------------------------------- GDN (linear attention)
    @abstractmethod
    def gdn_chunked_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cu_seqlens: torch.Tensor,
        initial_state: torch.Tensor | None,
        *,
        use_qk_l2norm: bool = True,
        chunk_size: int = 64,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gated delta rule over whole segments (prefill, or several tokens per sequence).

        q, k: [T, H, Dk] (key heads already repeated to the H value heads); v: [T, H, Dv];
        g: [T, H] float32 log-decay (<= 0); beta: [T, H]; cu_seqlens: [N + 1];
        initial_state: [N, H, Dk, Dv] float32 or None (zeros).
        Computed in float32; q/k are l2-normalised when `use_qk_l2norm`, q is scaled by Dk**-0.5.
        Returns (out [T, H, Dv] in q.dtype, final_state [N, H, Dk, Dv] float32).
        The reference follows transformers' chunked algorithm (chunks of `chunk_size` counted
        from each sequence's first token in this call).
        """

    @abstractmethod
    def gdn_recurrent_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        *,
        use_qk_l2norm: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode token per sequence.

        q, k: [N, H, Dk]; v: [N, H, Dv]; g, beta: [N, H]; state: [N, H, Dk, Dv] float32.
        Returns (out [N, H, Dv] in q.dtype, new_state [N, H, Dk, Dv] float32).
        """

    # ---------------------------------------------------------------- causal depthwise conv
    @abstractmethod
    def causal_conv1d_prefill(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        cu_seqlens: torch.Tensor,
        conv_state: torch.Tensor | None,
        activation: str | None = "silu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise causal conv over packed segments, continuing from `conv_state`.

        x: [T, C]; weight: [C, K]; cu_seqlens: [N + 1]; conv_state: [N, C, K - 1] or None.
        The convolution runs in weight.dtype (as transformers does), then `activation`
        ("silu" or None). Returns (y [T, C] in x.dtype, new_state [N, C, K - 1] in x.dtype).
        """

    @abstractmethod
    def causal_conv1d_update(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        conv_state: torch.Tensor,
        activation: str | None = "silu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per sequence. x: [N, C]; weight: [C, K]; conv_state: [N, C, K - 1].

        Returns (y [N, C], new_state [N, C, K - 1]).
        """

    # ---------------------------------------------------------------- QSA
    @abstractmethod
    def indexer_topk(
        self,
        q: torch.Tensor,
        raw_keys: torch.Tensor,
        key_cu_seqlens: torch.Tensor,
        query_seq_idx: torch.Tensor,
        query_pos: torch.Tensor,
        k_norm_weight: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        budget: int,
        compress_ratio: int,
        eps: float,
    ) -> torch.Tensor:
        """QSA token selection for each query.

        q: [T, Hi, Di] index queries (already q-normed and RoPE'd at the query position);
        raw_keys: [S, Di] raw (un-normed, un-rotated) index keys of every sequence, packed by
        `key_cu_seqlens` [N + 1] (row p of a sequence is its token at position p);
        query_seq_idx: [T] sequence of each query; query_pos: [T] its position (it sees keys
        0..pos); k_norm_weight: [Di] (RMSNorm, `1 + w` convention); cos/sin: [P, R] RoPE tables
        (transformers' `cat(freqs, freqs)` layout, R <= Di rotated dims, in raw_keys.dtype).
        For a query at pos: the first (pos + 1) // ratio complete groups of `compress_ratio`
        keys are mean-pooled (fp32 mean, cast back), RMS-normed, rotated at the group's first
        position and scored by sum_h relu(q_h . k_b) / sqrt(Di); the top budget // ratio groups
        are selected, plus the incomplete tail (the last (pos + 1) % ratio positions).
        Returns [T, budget + ratio - 1] int32: selected positions ascending, padded with -1.
        """

    @abstractmethod
    def sparse_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cu_seqlens: torch.Tensor,
        query_seq_idx: torch.Tensor,
        indices: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Softmax attention of each query over its selected positions only.

        q: [T, H, D]; k, v: [S, Hkv, D] packed per sequence by key_cu_seqlens [N + 1];
        query_seq_idx: [T]; indices: [T, L] positions within the query's sequence, -1 = none.
        Query head h reads kv head h // (H // Hkv). Softmax in float32.
        Returns [T, H, D] in q.dtype.
        """

    # ---------------------------------------------------------------- PLE
    @abstractmethod
    def ple_conv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        dilation: int,
        cu_seqlens: torch.Tensor,
        conv_state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """PLE's dilated depthwise causal conv followed by SiLU.

        x: [T, C]; weight: [C, K]; conv_state: [N, C, L] with L = (K - 1) * dilation, or None.
        Returns (silu(conv) [T, C] in x.dtype, new_state [N, C, L]).
        """

    # ---------------------------------------------------------------- hyper-connections
    @abstractmethod
    def hc_mix(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        down_weight: torch.Tensor,
        up_weight: torch.Tensor,
        inject_weight: torch.Tensor | None,
        *,
        hc_count: int,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hyper-connection input mixer (transformers' `GatedResidual`).

        x: [T, hc * H] streams; norm_weight: [hc * H] (grouped RMSNorm per stream, 1 + w);
        down_weight: [r, hc * H]; up_weight: [hc * H, r]; inject_weight: [hc, hc * H] or None.
        mixed = mean_s(sigmoid(up(silu(down(xn) / hc))) * xn) -> [T, H];
        inject = 2 * sigmoid(inject(xn) / hc) -> [T, hc] (None without inject_weight).
        """

    @abstractmethod
    def hc_inject(
        self, streams: torch.Tensor, block_out: torch.Tensor, inject: torch.Tensor
    ) -> torch.Tensor:
        """streams [T, hc * H] + block_out [T, H] scaled per stream by inject [T, hc]."""
