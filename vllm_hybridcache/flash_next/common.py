"""Small pieces shared by the Flash-Next layers: norms, RoPE tables, batch layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_hybridcache.flash_next.ops.reference import rms_norm


class Qwen4RMSNorm(nn.Module):
    """Qwen4Exp RMSNorm (`1 + w`, fp32 compute, optional per-stream groups)."""

    def __init__(self, dim: int, eps: float, group_size: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.group_size)


class RopeTable:
    """cos/sin rows for absolute positions, computed as transformers does.

    transformers multiplies fp32 positions by fp32 inverse frequencies and casts cos/sin to
    the activation dtype; we grow one fp32 table on demand and cast per call, which gives the
    same numbers for every position.
    """

    def __init__(self, head_dim: int, rope_parameters: dict) -> None:
        factor = rope_parameters.get("partial_rotary_factor", 1.0)
        dim = int(head_dim * factor)
        base = rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.rotary_dim = dim
        self._cos = torch.empty(0, dim)
        self._sin = torch.empty(0, dim)

    def _grow(self, n: int) -> None:
        if n <= self._cos.shape[0]:
            return
        size = max(n, 2 * self._cos.shape[0], 1024)
        freqs = torch.arange(size, dtype=torch.long).float()[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def tables(self, n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions 0..n-1, [n, R] in `dtype`."""
        self._grow(n)
        return (self._cos[:n].to(device=device, dtype=dtype),
                self._sin[:n].to(device=device, dtype=dtype))


@dataclass
class SectionBatch:
    """One step's requests as a state (section) layer sees them.

    Requests are ordered decodes first. `cu_seqlens` covers every request's new tokens.
    A request's state is read from `read_slots`. Prefills write their final state back to the
    same block. Decodes may carry speculative tokens (MTP): their state after their j-th token
    of this step goes to `dec_cols[:, j]` (vLLM's speculative state blocks) and their initial
    state is the column of the last accepted token of the previous step.
    """

    cu_seqlens: torch.Tensor  # [N + 1] int64 (cpu)
    read_slots: torch.Tensor  # [N] int64
    has_state: torch.Tensor  # [N] bool
    num_decodes: int
    dec_cols: torch.Tensor  # [num_decodes, 1 + num_spec] int64
    num_tokens: int

    @property
    def num_reqs(self) -> int:
        return self.cu_seqlens.numel() - 1


def section_batch(meta, num_tokens: int) -> SectionBatch | None:
    """Translate vLLM's Mamba metadata (decodes first) into one flat description."""
    if meta is None:
        return None
    nd, np_ = meta.num_decodes, meta.num_prefills
    if nd and meta.query_start_loc_d is not None:
        parts_cu = [meta.query_start_loc_d[: nd + 1].long().cpu()]
    else:
        parts_cu = [torch.arange(nd + 1, dtype=torch.long)]
    slots, has = [], []
    dec_cols = torch.zeros(0, 1, dtype=torch.long)
    if nd:
        dec_cols = meta.state_indices_tensor_d[:nd].long()
        start = torch.zeros(nd, dtype=torch.long)
        if meta.num_accepted_tokens is not None:
            start = meta.num_accepted_tokens[:nd].long().cpu() - 1
        slots.append(dec_cols.gather(1, start[:, None].to(dec_cols.device))[:, 0])
        has.append(torch.ones(nd, dtype=torch.bool))
    if np_:
        qp = meta.query_start_loc_p.long().cpu()
        parts_cu.append(qp[1:] + parts_cu[0][-1])
        slots.append(meta.state_indices_tensor_p.long())
        has.append(meta.has_initial_states_p.bool().cpu())
    cu = torch.cat(parts_cu)
    return SectionBatch(cu_seqlens=cu, read_slots=torch.cat(slots) if slots else cu[:0],
                        has_state=torch.cat(has) if has else torch.zeros(0, dtype=torch.bool),
                        num_decodes=nd, dec_cols=dec_cols, num_tokens=int(cu[-1]))
