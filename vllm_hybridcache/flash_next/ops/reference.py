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


def hc_mix_with(linear, x, norm_weight, down_weight, up_weight, inject_weight, *,
                hc_count, eps):
    """The hyper-connection mix (`FlashNextOps.hc_mix`) with its three GEMMs run by `linear`
    (F.linear here; the split-invariant forward passes its row-invariant kernel)."""
    hidden = x.shape[-1] // hc_count
    xn = rms_norm(x, norm_weight, eps, group_size=hidden)
    w = F.silu(linear(xn, down_weight) / hc_count)
    w = torch.sigmoid(linear(w, up_weight)).unflatten(-1, (hc_count, hidden))
    mixed = (w * xn.unflatten(-1, (hc_count, hidden))).mean(dim=-2)
    if inject_weight is None:
        return mixed, None
    inject = 2 * torch.sigmoid(linear(xn, inject_weight) / hc_count)
    return mixed, inject


def query_blocks(heads: int, key_cu_seqlens: torch.Tensor, query_seq_idx: torch.Tensor,
                 indices: torch.Tensor, elements: int):
    """The dense-masked attention's blocks: per sequence, its queries in blocks of at most 512,
    fewer where a block's scores (`heads` x queries x the sequence's keys) would pass
    `elements`. Yields (query rows, their index lists as int64, the sequence's first key row)."""
    key_cu = key_cu_seqlens.to(torch.long).tolist()
    seq_of = query_seq_idx.to(torch.long)
    for n in sorted(set(seq_of.tolist())):
        rows_q = torch.nonzero(seq_of == n).flatten()
        base = key_cu[n]
        step = max(1, min(512, elements // max(1, heads * (key_cu[n + 1] - base))))
        for s in range(0, rows_q.numel(), step):
            qi = rows_q[s:s + step]
            yield qi, indices[qi].to(torch.long), base


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
    def index_scores(self, q: torch.Tensor, block_keys: torch.Tensor,
                     groups: int | None = None) -> torch.Tensor:
        """[t, Hi, nb] = q.float() @ block_keys^T (block_keys fp32), before relu. Only the
        first `groups` columns are read (no query of the call sees a later group); a backend
        may leave the others at any finite value."""
        return torch.matmul(q.float(), block_keys.transpose(0, 1))

    def indexer_topk(self, q, raw_keys, key_cu_seqlens, query_seq_idx, query_pos,
                     k_norm_weight, cos, sin, *, budget, compress_ratio, eps):
        ratio = compress_ratio
        block_topk = budget // ratio
        width = budget + ratio - 1
        num_q, _, d = q.shape
        out = torch.full((num_q, width), -1, dtype=torch.int32, device=q.device)
        key_cu = key_cu_seqlens.to(torch.long).tolist()
        seq_of = query_seq_idx.to(torch.long)
        pos_all = query_pos.to(torch.long)
        arange_r = torch.arange(ratio, device=q.device)
        for n in sorted(set(seq_of.tolist())):
            keys = raw_keys[key_cu[n]:key_cu[n + 1]]
            nb = keys.shape[0] // ratio
            rows_q = torch.nonzero(seq_of == n).flatten()
            if nb:
                # pooled, normed, rotated block keys: a function of the sequence only
                groups = keys[: nb * ratio].view(nb, ratio, d)
                pooled = rms_norm(groups.float().mean(dim=1).to(keys.dtype), k_norm_weight, eps)
                starts = torch.arange(nb, device=keys.device) * ratio
                bk = apply_partial_rope(pooled, cos[starts], sin[starts]).float()
            step = max(1, min(1024, (1 << 24) // max(1, q.shape[1] * max(nb, 1))))
            for s in range(0, rows_q.numel(), step):
                qi = rows_q[s:s + step]
                pos = pos_all[qi]
                ncomplete = (pos + 1) // ratio
                tail_len = (pos + 1) - ncomplete * ratio
                t = qi.numel()
                chosen = torch.full((t, width), -1, dtype=torch.long, device=q.device)
                if nb:
                    # transformers scores each query separately: q.float() @ keys.float().T,
                    # relu, sum over heads, / sqrt(d); a batched matmul gives the same values
                    scores = torch.relu(self.index_scores(q[qi], bk,
                                                          int(ncomplete.max())))
                    scores = scores.sum(dim=1) / math.sqrt(d)  # [t, nb]
                    valid = torch.arange(nb, device=q.device)[None] < ncomplete[:, None]
                    masked = scores.masked_fill(~valid, float("-inf"))
                    kk = min(block_topk + 1, nb)
                    top_v, top_i = masked.topk(kk, dim=-1)
                    take = torch.clamp(ncomplete, max=block_topk)
                    # a tie at the cut makes the selected set depend on topk's tie order:
                    # redo those rows exactly as transformers does (1-D topk of the prefix)
                    tie = (ncomplete > block_topk) & (kk > block_topk)
                    if bool(tie.any()):
                        tie &= top_v[:, block_topk - 1] == top_v[:, min(block_topk, kk - 1)]
                    blk = torch.full((t, block_topk), -1, dtype=torch.long, device=q.device)
                    keep = torch.arange(min(block_topk, kk), device=q.device)[None] < take[:, None]
                    blk[:, : min(block_topk, kk)] = torch.where(
                        keep, top_i[:, :block_topk], -1)
                    for r in torch.nonzero(tie).flatten().tolist():
                        sel = scores[r, : int(ncomplete[r])].topk(block_topk, dim=0).indices
                        blk[r] = sel
                    toks = (blk.unsqueeze(-1) * ratio + arange_r).flatten(1)
                    toks = torch.where(blk.unsqueeze(-1).expand(-1, -1, ratio).flatten(1) >= 0,
                                       toks, -1)
                    chosen[:, : toks.shape[1]] = toks
                # the incomplete tail, after the selected blocks
                tail = (ncomplete * ratio).unsqueeze(-1) + arange_r[: ratio - 1]
                tail = torch.where(arange_r[: ratio - 1][None] < tail_len[:, None], tail, -1)
                merged = torch.cat([chosen[:, : block_topk * ratio], tail], dim=1)
                merged = torch.where(merged >= 0, merged, torch.iinfo(torch.long).max)
                merged = torch.sort(merged, dim=-1).values
                merged = torch.where(merged == torch.iinfo(torch.long).max, -1, merged)
                out[qi] = merged[:, :width].to(torch.int32)
        return out

    def sparse_attention(self, q, k, v, key_cu_seqlens, query_seq_idx, indices, scale):
        # Dense-masked formulation: per sequence and block of queries, scores against every
        # key up to the block's furthest selected position, -inf outside the selection.
        # Same arithmetic as gathering the selected rows (the masked terms are exact zeros
        # after softmax) but big GEMMs instead of a gather of budget-sized rows per query,
        # which on CPU is several times faster for large budgets.
        _, h, d = q.shape
        hkv = k.shape[1]
        rep = h // hkv
        out = torch.empty_like(q)
        for qi, sel, base in query_blocks(h, key_cu_seqlens, query_seq_idx, indices, 1 << 26):
            span = int(sel.max()) + 1 if sel.numel() else 1
            t = qi.numel()
            mask = torch.zeros(t, span + 1, dtype=torch.bool, device=q.device)
            mask.scatter_(1, torch.where(sel >= 0, sel, span), True)
            mask = mask[:, :span]
            kk = k[base:base + span].transpose(0, 1)  # [Hkv, S, D]
            vv = v[base:base + span].transpose(0, 1)
            qq = q[qi].view(t, hkv, rep, d).permute(1, 0, 2, 3).reshape(hkv, t * rep, d)
            scores = torch.matmul(qq, kk.transpose(1, 2)).view(hkv, t, rep, span) * scale
            scores = scores.float().masked_fill(~mask[None, :, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype).view(hkv, t * rep, span)
            o = torch.matmul(probs, vv).view(hkv, t, rep, d).permute(1, 0, 2, 3)
            out[qi] = o.reshape(t, h, d)
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
        return hc_mix_with(F.linear, x, norm_weight, down_weight, up_weight, inject_weight,
                           hc_count=hc_count, eps=eps)

    def hc_inject(self, streams, block_out, inject):
        return streams + (block_out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
