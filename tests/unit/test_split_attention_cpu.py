"""The split-invariant CPU attention kernel (csrc/split_attention_cpu.cpp, ops/cpu_attention.py)
on vLLM's own CPU KV cache: a query's output is the same bit for bit whatever prefill step or
batch computes it, it is attention (against a float32 reference), and vLLM's own op under the
same step patterns is not split-invariant (the negative control: the patterns are sensitive).
The plan that routes vLLM's attention to it (compat.split_attention_plan) is checked too.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hybridcache.ops import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="the kernel needs a C++ compiler (make toolchain)")


class _Cache:
    """One or more requests' keys and values written by vLLM's own cache op in its `vec`
    layout, with shuffled block tables; queries per request."""

    def __init__(self, dtype, heads, kv_heads, dim, block, lens, seed=0):
        from vllm import _custom_ops as ops

        g = torch.Generator().manual_seed(seed)
        self.dtype, self.heads, self.dim = dtype, heads, dim
        per_req = [-(-n // block) for n in lens]
        nb = sum(per_req) + 2
        kv = torch.zeros(nb, kv_heads, block, 2 * dim, dtype=dtype).view(nb, kv_heads,
                                                                         2 * block, dim)
        self.kc, self.vc = kv.chunk(2, dim=2)
        order = torch.randperm(nb, generator=g).to(torch.int32)
        width = max(per_req)
        self.table = torch.zeros(len(lens), width, dtype=torch.int32)
        self.q, self.k, self.v, used = [], [], [], 0
        for r, n in enumerate(lens):
            self.table[r, :per_req[r]] = order[used:used + per_req[r]]
            used += per_req[r]
            q = torch.randn(n, heads, dim, generator=g).to(dtype)
            k, v = (torch.randn(n, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
            pos = torch.arange(n)
            slots = self.table[r].long()[pos // block] * block + pos % block
            ops.cpu_attn_reshape_and_cache(k, v, self.kc, self.vc, slots, "vec")
            self.q.append(q)
            self.k.append(k)
            self.v.append(v)

    def run(self, spans: list[tuple[int, int, int]], vllm_op: bool = False) -> torch.Tensor:
        """One call over the query spans (request, start, end), each a causal request whose
        last key is its last query's; the outputs in span order."""
        q = torch.cat([self.q[r][s:e] for r, s, e in spans])
        out = torch.empty_like(q)
        lens = torch.tensor([e - s for _, s, e in spans])
        qsl = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
        seq = torch.tensor([e for _, _, e in spans], dtype=torch.int32)
        table = self.table[[r for r, _, _ in spans]]
        scale = self.dim ** -0.5
        if not vllm_op:
            return cpu_attention.split_invariant_attention(q, self.kc, self.vc, out, qsl, seq,
                                                           table, scale)
        from vllm import _custom_ops as ops

        md = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(spans), num_heads=self.heads, num_kv_heads=self.kc.shape[1],
            head_dim=self.dim, seq_lens=seq, dtype=self.dtype, query_start_loc=qsl,
            causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=True,
            dynamic_causal=None, kv_cache_dtype="auto")
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=self.kc, value_cache=self.vc, output=out, query_start_loc=qsl,
            seq_lens=seq, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=table, softcap=0.0, scheduler_metadata=md, s_aux=None)
        return out

    def prefill(self, steps: list[int], vllm_op: bool = False) -> torch.Tensor:
        """Request 0's outputs, its prompt prefilled in steps of these lengths."""
        outs, s = [], 0
        for n in steps:
            outs.append(self.run([(0, s, s + n)], vllm_op))
            s += n
        return torch.cat(outs)


def _steps(total: int, n: int, first: int | None = None) -> list[int]:
    steps = [] if first is None else [first]
    while sum(steps) < total:
        steps.append(min(n, total - sum(steps)))
    return steps


N = 2200   # several of the kernel's 128-key tiles and of vLLM's KV tiles
PATTERNS = [_steps(N, 2048), _steps(N, 256), _steps(N, 64), _steps(N, 320, first=64),
            [N], [2176, 1, 1, 22], [64, 1, 2, 3, 2130]]


@pytest.mark.parametrize("dtype,heads,kv_heads,dim,block", [
    (torch.bfloat16, 4, 1, 64, 384),      # qwen3-next-tiny's layer, its hybrid block
    (torch.bfloat16, 8, 2, 128, 64),      # qwen3-next-small's
    (torch.float32, 4, 2, 64, 96),
])
def test_each_query_is_computed_the_same_whatever_its_step(dtype, heads, kv_heads, dim, block):
    cache = _Cache(dtype, heads, kv_heads, dim, block, [N])
    base = cache.prefill(PATTERNS[0])
    for steps in PATTERNS[1:]:
        assert torch.equal(cache.prefill(steps), base), steps[:4]
    # negative control: vLLM's own op under the same patterns gives step-dependent bits
    plain = cache.prefill(PATTERNS[0], vllm_op=True)
    assert any(not torch.equal(cache.prefill(steps, vllm_op=True), plain)
               for steps in PATTERNS[1:]), "vLLM's CPU attention was split-invariant here"
    # and both compute the same attention up to rounding
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(base.float(), plain.float(), atol=tol)


def test_it_is_causal_attention():
    """Against float32 scaled-dot-product attention of the same rows, with a GQA group."""
    cache = _Cache(torch.float32, 8, 2, 128, 64, [700])
    out = cache.prefill([300, 400])
    q, k, v = cache.q[0], cache.k[0], cache.v[0]
    rep = 4
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
        v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    assert torch.allclose(out, ref, atol=1e-5)
    assert not torch.allclose(out[1:], ref[:-1], atol=1e-3)   # a shifted row is not close


def test_a_request_is_computed_the_same_whatever_shares_its_batch():
    """Requests in one call (decodes and prefills of other lengths) leave a request's rows
    as they are alone."""
    cache = _Cache(torch.bfloat16, 4, 1, 64, 384, [900, 1500, 40], seed=1)
    alone = cache.run([(1, 1024, 1500)])
    batch = cache.run([(0, 899, 900), (1, 1024, 1500), (2, 0, 40), (0, 100, 164)])
    assert torch.equal(batch[1:1 + 476], alone)
    assert torch.equal(batch[:1], cache.run([(0, 899, 900)]))


def test_the_plan_routes_only_vllms_qwen3_next_on_the_vec_layout(monkeypatch, embedded_model):
    """`auto` (the default: in an engine running the connector with the cache on) and `kernel`
    (any engine) run the kernel for vLLM's Qwen3-Next on the CPU platform's `vec` layout; `0`,
    `1` (the pin), the cache off, another model or a block size the kernel does not take keep
    vLLM's attention, each with its reason; an unknown setting is refused."""
    from vllm.config import ModelConfig

    from vllm_hybridcache.compat import cpu_attention as bend
    from vllm_hybridcache.compat import split_attention_plan
    from vllm_hybridcache.config import (
        CONNECTOR_NAME,
        CPU_ATTN_SPLIT_INVARIANT_ENV,
        SettingsError,
    )

    mc = ModelConfig(model=str(embedded_model("qwen3-next-tiny")), max_model_len=512,
                     dtype="bfloat16")
    ktc = SimpleNamespace(kv_connector=CONNECTOR_NAME)
    cfg = SimpleNamespace(model_config=mc, kv_transfer_config=ktc,
                          cache_config=SimpleNamespace(block_size=384, cache_dtype="auto"))
    plain = SimpleNamespace(model_config=mc, kv_transfer_config=None,
                            cache_config=cfg.cache_config)
    monkeypatch.delenv(CPU_ATTN_SPLIT_INVARIANT_ENV, raising=False)
    use, why = split_attention_plan(cfg)
    if torch.cpu._is_amx_tile_supported():
        assert not use and "amx" in why           # vLLM lays bf16 out for AMX there
        return
    assert use, why
    use, why = split_attention_plan(plain)        # installed, not asked for: vLLM's attention
    assert not use and "connector" in why
    off = SimpleNamespace(model_config=mc, cache_config=cfg.cache_config,
                          kv_transfer_config=SimpleNamespace(
                              kv_connector=CONNECTOR_NAME,
                              kv_connector_extra_config={"budget_bytes": 0}))
    use, why = split_attention_plan(off)          # the connector with the cache off: vLLM's
    assert not use and "off" in why
    monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "kernel")
    assert split_attention_plan(cfg)[0] and split_attention_plan(plain)[0]
    assert split_attention_plan(off)[0]
    for setting in ("0", "1"):
        monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, setting)
        use, why = split_attention_plan(cfg)
        assert not use and CPU_ATTN_SPLIT_INVARIANT_ENV in why
    monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "auto")
    odd = SimpleNamespace(model_config=mc, kv_transfer_config=ktc,
                          cache_config=SimpleNamespace(block_size=48, cache_dtype="auto"))
    use, why = split_attention_plan(odd)
    assert not use and "block size 48" in why
    monkeypatch.setattr(bend, "CPU_GDN_INNER_MODELS", ())
    use, why = split_attention_plan(cfg)
    assert not use and "Qwen3NextForCausalLM" in why
    monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "pinned")
    with pytest.raises(SettingsError, match=CPU_ATTN_SPLIT_INVARIANT_ENV):
        split_attention_plan(cfg)


def test_unsupported_shapes_are_named():
    assert cpu_attention.supports(torch.bfloat16, 128, 64, "auto") == ""
    assert "head_dim 80" in cpu_attention.supports(torch.bfloat16, 80, 64, "auto")
    assert "dtype" in cpu_attention.supports(torch.float16, 128, 64, "auto")
    assert "fp8" in cpu_attention.supports(torch.bfloat16, 128, 64, "fp8_e4m3")
