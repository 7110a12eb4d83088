"""Pure-torch reference of every Flash-Next op.

The arithmetic (order of casts, fp32 sections, the chunked delta-rule algorithm, the top-k call)
follows transformers' `modeling_qwen4_exp` line by line, because that module is the numerics
oracle: a backend is correct when it matches these functions, and these functions match
transformers. They are written for clarity and exactness, not speed, but stay vectorised where
that does not change the arithmetic so the model runs at usable speed on CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vllm_hybridcache.flash_next.ops.interface import FlashNextOps


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """transformers' `l2norm` (FLA convention)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             group_size: int | None = None) -> torch.Tensor:
    """Qwen4Exp RMSNorm: fp32 compute, optional groups, `(1 + w)` scale, cast back."""
    xf = x.float()
    if group_size is not None:
        xf = xf.reshape(*xf.shape[:-1], -1, group_size)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if group_size is not None:
        out = out.flatten(-2)
    return (out * (1.0 + weight.float())).type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x; cos/sin broadcast against x[..., :R]."""
    r = cos.shape[-1]
    x_rope, x_pass = x[..., :r], x[..., r:]
    x_rope = (x_rope * cos) + (rotate_half(x_rope) * sin)
    return torch.cat([x_rope, x_pass], dim=-1)


def _chunk_gated_delta_rule_one(q, k, v, g, beta, chunk_size, initial_state, use_qk_l2norm):
    """transformers' `torch_chunk_gated_delta_rule` for one sequence, [1, L, H, D] inputs."""
    initial_dtype = q.dtype
    batch_size, sequence_length, _, k_head_dim = k.shape
    num_v_heads, v_head_dim = v.shape[-2:]
    recurrent_state_shape = (batch_size, num_v_heads, k_head_dim, v_head_dim)
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (q, k, v, beta, g)
    ]
    if use_qk_l2norm:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)
    query = query * (query.shape[-1] ** -0.5)
    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))
    total = sequence_length + pad_size
    num_chunks = total // chunk_size
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
        for x in (query, key, k_beta, v_beta)
    ]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    strictly_upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool,
                                device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise_decay = cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)
    pairwise_decay = pairwise_decay.masked_fill(strictly_upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False,
                                               unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False,
                                               unitriangular=True)
    if initial_state is None:
        state = torch.zeros(recurrent_state_shape, dtype=new_values.dtype,
                            device=new_values.device)
    else:
        state = initial_state.to(new_values)
    out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        inter = query[:, :, i] @ state
        out[:, :, i] = inter + intra_chunk_attn[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch_size, num_v_heads, -1, v_head_dim)[:, :, :sequence_length]
    out = out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return out, state


def _segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


class ReferenceOps(FlashNextOps):
    """Pure torch; exact semantics of the transformers reference."""

    name = "reference"

    # ---------------------------------------------------------------- GDN
    def gdn_chunked_prefill(self, q, k, v, g, beta, cu_seqlens, initial_state, *,
                            use_qk_l2norm=True, chunk_size=64):
        segs = _segments(cu_seqlens)
        out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
        states = []
        for n, (s, e) in enumerate(segs):
            init = None if initial_state is None else initial_state[n:n + 1]
            if e == s:
                states.append(init[0].float() if init is not None else torch.zeros(
                    q.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32,
                    device=q.device))
                continue
            o, st = _chunk_gated_delta_rule_one(
                q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
                chunk_size, init, use_qk_l2norm)
            out[s:e] = o[0]
            states.append(st[0])
        return out, torch.stack(states) if states else torch.zeros(
            0, q.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32, device=q.device)

    def gdn_recurrent_step(self, q, k, v, g, beta, state, *, use_qk_l2norm=True):
        initial_dtype = q.dtype
        query, key, value, b, decay = (x.to(torch.float32) for x in (q, k, v, beta, g))
        if use_qk_l2norm:
            query = l2norm(query, dim=-1, eps=1e-6)
            key = l2norm(key, dim=-1, eps=1e-6)
        query = query / (query.shape[-1] ** 0.5)
        st = state.to(torch.float32) * decay.exp()[..., None, None]
        kv_mem = (st * key.unsqueeze(-1)).sum(dim=-2)
        delta = (value - kv_mem) * b.unsqueeze(-1)
        st = st + key.unsqueeze(-1) * delta.unsqueeze(-2)
        out = (st * query.unsqueeze(-1)).sum(dim=-2)
        return out.to(initial_dtype), st

    # ---------------------------------------------------------------- conv
    def causal_conv1d_prefill(self, x, weight, cu_seqlens, conv_state, activation="silu"):
        c, kw = weight.shape
        y = torch.empty_like(x)
        new_states = []
        for n, (s, e) in enumerate(_segments(cu_seqlens)):
            prev = (conv_state[n] if conv_state is not None
                    else x.new_zeros(c, kw - 1))
            seq = torch.cat([prev.to(x.dtype), x[s:e].t()], dim=-1)  # [C, K-1+L]
            out = F.conv1d(seq.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1),
                           None, padding=0, groups=c)[0]
            if activation is not None:
                out = F.silu(out)
            y[s:e] = out.t().to(x.dtype)
            new_states.append(seq[:, seq.shape[-1] - (kw - 1):])
        return y, torch.stack(new_states) if new_states else x.new_zeros(0, c, kw - 1)

    def causal_conv1d_update(self, x, weight, conv_state, activation="silu"):
        c, _kw = weight.shape
        seq = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [N, C, K]
        out = F.conv1d(seq.to(weight.dtype), weight.unsqueeze(1), None, padding=0, groups=c)
        out = out[..., -1]
        if activation is not None:
            out = F.silu(out)
        return out.to(x.dtype), seq[..., 1:]

    # ---------------------------------------------------------------- QSA
    def indexer_topk(self, q, raw_keys, key_cu_seqlens, query_seq_idx, query_pos,
                     k_norm_weight, cos, sin, *, budget, compress_ratio, eps):
        ratio = compress_ratio
        block_topk = budget // ratio
        width = budget + ratio - 1
        num_q, _, d = q.shape
        out = torch.full((num_q, width), -1, dtype=torch.int32, device=q.device)
        key_cu = key_cu_seqlens.tolist()
        seq_idx = query_seq_idx.tolist()
        pos_list = query_pos.tolist()
        # Pooled, normed, rotated block keys are a function of the sequence only.
        block_keys: dict[int, torch.Tensor] = {}
        for n in sorted(set(seq_idx)):
            keys = raw_keys[key_cu[n]:key_cu[n + 1]]
            nb = keys.shape[0] // ratio
            if nb == 0:
                block_keys[n] = keys.new_zeros(0, d)
                continue
            groups = keys[: nb * ratio].view(nb, ratio, d)
            pooled = groups.float().mean(dim=1).to(keys.dtype)
            pooled = rms_norm(pooled, k_norm_weight, eps)
            starts = torch.arange(nb, device=keys.device) * ratio
            block_keys[n] = apply_partial_rope(pooled, cos[starts], sin[starts])
        for t in range(num_q):
            n, pos = seq_idx[t], pos_list[t]
            visible = pos + 1
            ncomplete = visible // ratio
            parts = []
            if ncomplete > 0:
                bk = block_keys[n][:ncomplete]
                scores = torch.matmul(q[t].float(), bk.float().transpose(-1, -2)).transpose(-1, -2)
                scores = torch.relu(scores).sum(dim=-1) / math.sqrt(d)
                sel = scores.topk(min(block_topk, ncomplete), dim=0).indices
                tok = (sel.unsqueeze(-1) * ratio
                       + torch.arange(ratio, device=q.device)).flatten()
                parts.append(tok)
            parts.append(torch.arange(ncomplete * ratio, visible, device=q.device))
            chosen = torch.sort(torch.cat(parts)).values.to(torch.int32)
            out[t, : chosen.numel()] = chosen
        return out

    def sparse_attention(self, q, k, v, key_cu_seqlens, query_seq_idx, indices, scale):
        num_q, h, _d = q.shape
        hkv = k.shape[1]
        rep = h // hkv
        out = torch.empty_like(q)
        key_cu = key_cu_seqlens.to(torch.long)
        valid = indices >= 0
        rows = indices.clamp_min(0).to(torch.long) + key_cu[query_seq_idx.long()].unsqueeze(-1)
        step = 256
        for s in range(0, num_q, step):
            e = min(num_q, s + step)
            kk = k[rows[s:e]]  # [t, L, Hkv, D]
            vv = v[rows[s:e]]
            if rep > 1:
                kk = kk.repeat_interleave(rep, dim=2)
                vv = vv.repeat_interleave(rep, dim=2)
            scores = torch.einsum("thd,tlhd->thl", q[s:e], kk) * scale
            scores = scores.masked_fill(~valid[s:e, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[s:e] = torch.einsum("thl,tlhd->thd", probs, vv)
        return out

    # ---------------------------------------------------------------- PLE
    def ple_conv(self, x, weight, dilation, cu_seqlens, conv_state):
        c, kw = weight.shape
        state_len = (kw - 1) * dilation
        y = torch.empty_like(x)
        new_states = []
        for n, (s, e) in enumerate(_segments(cu_seqlens)):
            prev = conv_state[n] if conv_state is not None else x.new_zeros(c, state_len)
            seq = torch.cat([prev.to(x.dtype), x[s:e].t()], dim=-1)
            out = F.conv1d(seq.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), None,
                           groups=c, dilation=dilation)[0]
            y[s:e] = F.silu(out).t().to(x.dtype)
            new_states.append(seq[:, seq.shape[-1] - state_len:])
        return y, torch.stack(new_states) if new_states else x.new_zeros(0, c, state_len)

    # ---------------------------------------------------------------- hyper-connections
    def hc_mix(self, x, norm_weight, down_weight, up_weight, inject_weight, *, hc_count, eps):
        hidden = x.shape[-1] // hc_count
        xn = rms_norm(x, norm_weight, eps, group_size=hidden)
        w = F.silu(F.linear(xn, down_weight) / hc_count)
        w = torch.sigmoid(F.linear(w, up_weight)).unflatten(-1, (hc_count, hidden))
        mixed = (w * xn.unflatten(-1, (hc_count, hidden))).mean(dim=-2)
        if inject_weight is None:
            return mixed, None
        inject = 2 * torch.sigmoid(F.linear(xn, inject_weight) / hc_count)
        return mixed, inject

    def hc_inject(self, streams, block_out, inject):
        return streams + (block_out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
