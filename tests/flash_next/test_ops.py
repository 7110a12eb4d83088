"""Each Flash-Next op against transformers' own qwen4_exp functions and modules (the oracle),
and every backend against the reference. Fast: no engine."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

from vllm_hybridcache.flash_next.ops import get_backend
from vllm_hybridcache.flash_next.ops.reference import apply_partial_rope, rms_norm

BACKENDS = ["reference", "cpu"]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gdn_chunked_prefill_matches_transformers(backend):
    g = _gen()
    ops = get_backend(backend)
    lens = [1, 70, 130]
    h, dk, dv = 4, 16, 8
    t = sum(lens)
    q, k = (torch.randn(t, h, dk, generator=g) for _ in range(2))
    v = torch.randn(t, h, dv, generator=g)
    gg = -torch.rand(t, h, generator=g)
    beta = torch.rand(t, h, generator=g)
    init = torch.randn(len(lens), h, dk, dv, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    out, st = ops.gdn_chunked_prefill(q, k, v, gg, beta, cu, init)
    for n in range(len(lens)):
        s, e = cu[n], cu[n + 1]
        ro, rs = hf.torch_chunk_gated_delta_rule(
            q[None, s:e], k[None, s:e], v[None, s:e], g=gg[None, s:e], beta=beta[None, s:e],
            initial_state=init[n:n + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[s:e], ro[0], rtol=0, atol=0)
        torch.testing.assert_close(st[n], rs[0], rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gdn_recurrent_step_matches_transformers(backend):
    g = _gen(1)
    ops = get_backend(backend)
    n, h, dk, dv = 3, 4, 16, 8
    q, k = (torch.randn(n, h, dk, generator=g) for _ in range(2))
    v = torch.randn(n, h, dv, generator=g)
    gg, beta = -torch.rand(n, h, generator=g), torch.rand(n, h, generator=g)
    state = torch.randn(n, h, dk, dv, generator=g)
    out, st = ops.gdn_recurrent_step(q, k, v, gg, beta, state)
    ro, rs = hf.torch_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g=gg[:, None], beta=beta[:, None],
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ro[:, 0])
    torch.testing.assert_close(st, rs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_conv1d_prefill_then_update(backend):
    g = _gen(2)
    ops = get_backend(backend)
    c, kw = 6, 4
    w = torch.randn(c, kw, generator=g)
    x = torch.randn(12, c, generator=g)
    full = hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    # split 12 tokens as 5 + 1 + 6 through the state
    cu = torch.tensor([0, 5])
    y1, s1 = ops.causal_conv1d_prefill(x[:5], w, cu, None)
    y2, s2 = ops.causal_conv1d_update(x[5:6], w, s1)
    y3, _ = ops.causal_conv1d_prefill(x[6:], w, torch.tensor([0, 6]), s2)
    torch.testing.assert_close(torch.cat([y1, y2, y3]), full)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ple_conv_matches_transformers_layer(backend):
    g = _gen(3)
    ops = get_backend(backend)
    c, kw, dil = 8, 4, 3
    w = torch.randn(c, kw, generator=g)
    x = torch.randn(20, c, generator=g)
    conv = torch.nn.Conv1d(c, c, kw, groups=c, dilation=dil, bias=False)
    conv.weight.data = w.unsqueeze(1)
    xp = torch.nn.functional.pad(x.t()[None], ((kw - 1) * dil, 0))
    full = torch.nn.functional.silu(conv(xp))[0].t()
    y1, s1 = ops.ple_conv(x[:7], w, dil, torch.tensor([0, 7]), None)
    y2, s2 = ops.ple_conv(x[7:8], w, dil, torch.tensor([0, 1]), s1)
    y3, _ = ops.ple_conv(x[8:], w, dil, torch.tensor([0, 12]), s2)
    torch.testing.assert_close(torch.cat([y1, y2, y3]), full.detach())


def _tiny_text_config(**kw):
    from transformers import Qwen4ExpTextConfig

    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                shared_expert_intermediate_size=16, hc_count=2, hc_lowrank=8,
                indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                indexer_compress_ratio=4, eos_token_id=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5})
    base.update(kw)
    return Qwen4ExpTextConfig(**base)


@pytest.mark.parametrize("seq", [45, 300])
@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_topk_matches_transformers_indexer(backend, seq):
    torch.manual_seed(4)
    ops = get_backend(backend)
    cfg = _tiny_text_config()
    idx = hf.Qwen4ExpTextQSAIndexer(cfg, 3).eval()
    for p in idx.parameters():
        p.data.normal_(0, 0.3)
    rope = hf.Qwen4ExpTextRotaryEmbedding(cfg)
    x = torch.randn(1, seq, cfg.hidden_size)
    pos = torch.arange(seq)[None, None].expand(3, 1, -1)
    cos, sin = rope(x, pos)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        mask = idx(x, (cos, sin), causal, None)[0, 0]  # [seq, seq] bool
        qk = idx.index_qk_proj(x)[0]
        d = cfg.indexer_head_dim
        q = qk[:, : 2 * d].view(seq, 2, d)
        raw = qk[:, 2 * d:]
        q = rms_norm(q, idx.q_layernorm.weight, cfg.rms_norm_eps)
        q = apply_partial_rope(q, cos[0, :, None], sin[0, :, None])
        sel = ops.indexer_topk(q, raw, torch.tensor([0, seq]), torch.zeros(seq, dtype=torch.long),
                               torch.arange(seq), idx.k_layernorm.weight, cos[0], sin[0],
                               budget=cfg.indexer_budget, compress_ratio=4,
                               eps=cfg.rms_norm_eps)
    ours = torch.zeros(seq, seq + 1, dtype=torch.bool)
    ours.scatter_(1, torch.where(sel >= 0, sel, seq).long(), True)
    assert torch.equal(ours[:, :seq], mask)
    # the budget really binds: late queries see fewer than all tokens
    assert int(mask[-1].sum()) < seq


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_attention_matches_masked_dense(backend):
    g = _gen(5)
    ops = get_backend(backend)
    s, h, hkv, d = 10, 4, 2, 8
    q = torch.randn(s, h, d, generator=g)
    k, v = torch.randn(s, hkv, d, generator=g), torch.randn(s, hkv, d, generator=g)
    idx = torch.full((s, 5), -1, dtype=torch.int32)
    for t in range(s):
        chosen = torch.randperm(t + 1, generator=g)[:5].sort().values
        idx[t, : chosen.numel()] = chosen.to(torch.int32)
    out = ops.sparse_attention(q, k, v, torch.tensor([0, s]), torch.zeros(s, dtype=torch.long),
                               idx, 0.3)
    mask = torch.full((s, s), float("-inf"))
    for t in range(s):
        sel = idx[t][idx[t] >= 0].long()
        mask[t, sel] = 0
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    att = torch.softmax(torch.einsum("thd,shd->hts", q, kk) * 0.3 + mask, -1)
    ref = torch.einsum("hts,shd->thd", att, vv)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hc_mix_matches_transformers(backend):
    torch.manual_seed(6)
    ops = get_backend(backend)
    cfg = _tiny_text_config()
    gr = hf.Qwen4ExpTextGatedResidual(cfg)
    for p in gr.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(5, cfg.hc_count * cfg.hidden_size)
    with torch.no_grad():
        mixed, streams, inj = gr(x)
        m2, i2 = ops.hc_mix(x, gr.hc_norm.weight, gr.input_mix_weight_down.weight,
                            gr.input_mix_weight_up.weight, gr.block_inject_weight.weight,
                            hc_count=cfg.hc_count, eps=cfg.rms_norm_eps)
        block = torch.randn(5, cfg.hidden_size)
        ref = streams + (block.unsqueeze(-2) * inj.unsqueeze(-1)).flatten(-2)
        torch.testing.assert_close(ops.hc_inject(x, block, i2), ref)
    torch.testing.assert_close(m2, mixed)
    torch.testing.assert_close(i2, inj)


def test_cpu_backend_bf16_gdn_prefill_close_to_reference():
    """bf16 GDN prefill runs vLLM's C++ CPU kernel; it must agree with the reference."""
    g = _gen(7)
    lens = [3, 150]
    t, h, dk, dv = sum(lens), 4, 64, 64
    q, k = (torch.randn(t, h, dk, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(t, h, dv, generator=g).bfloat16()
    gg = -torch.rand(t, h, generator=g) * 0.5
    beta = torch.rand(t, h, generator=g).bfloat16()
    init = torch.randn(len(lens), h, dk, dv, generator=g) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    ro, rs = get_backend("reference").gdn_chunked_prefill(q, k, v, gg, beta, cu, init)
    co, cs = get_backend("cpu").gdn_chunked_prefill(q, k, v, gg, beta, cu, init)
    torch.testing.assert_close(co.float(), ro.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cs, rs, atol=2e-2, rtol=2e-2)
    assert torch.equal(init, init.clone())  # inputs untouched
