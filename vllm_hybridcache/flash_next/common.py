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

    Requests are ordered decodes first. `cu_seqlens` covers every request's new tokens,
    `slots` is each request's state block, `has_state` whether it continues earlier tokens.
    """

    cu_seqlens: torch.Tensor  # [N + 1] int64 (cpu)
    slots: torch.Tensor  # [N] int64
    has_state: torch.Tensor  # [N] bool
    num_decodes: int  # leading requests with exactly one new token and a state
    num_tokens: int


def section_batch(meta, num_tokens: int) -> SectionBatch | None:
    """Translate vLLM's Mamba metadata (decodes first) into one flat description."""
    if meta is None:
        return None
    nd, np_ = meta.num_decodes, meta.num_prefills
    parts_cu = [torch.arange(nd + 1, dtype=torch.long)]
    slots, has = [], []
    if nd:
        slots.append(meta.state_indices_tensor_d[:, 0].long())
        has.append(torch.ones(nd, dtype=torch.bool))
    if np_:
        qp = meta.query_start_loc_p.long().cpu()
        parts_cu.append(qp[1:] + nd)
        slots.append(meta.state_indices_tensor_p.long())
        has.append(meta.has_initial_states_p.bool().cpu())
    cu = torch.cat(parts_cu)
    return SectionBatch(cu_seqlens=cu, slots=torch.cat(slots) if slots else cu[:0],
                        has_state=torch.cat(has) if has else torch.zeros(0, dtype=torch.bool),
                        num_decodes=nd, num_tokens=int(cu[-1]))
