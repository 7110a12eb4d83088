"""The pin of vLLM's CPU attention (compat.pin_cpu_attention_split): with it, a query's output
does not depend on the prefill step it is computed in; without it, it does (the negative
control). vLLM's real metadata builder and C++ attention op run on one request's KV cache,
prefilled under several step patterns whose steps start at multiples of 64
(docs/split-invariance.md, "vLLM's Qwen3-Next on CPU")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hybridcache import compat

H, KVH, D, BS = 4, 1, 64, 64     # qwen3-next-tiny's full-attention layer; a 64-token block
N = 6144                          # long enough for several KV tiles of the unpinned kernel


def _builder_classes():
    """(vLLM's builder, the pinned one), both on vLLM's own `build`: an earlier engine of
    this process may have pinned vLLM's class (the pin on for it; the wrapper keeps the build
    it wrapped)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    raw = getattr(CPUAttentionMetadataBuilder.build, "_hybridcache_original",
                  CPUAttentionMetadataBuilder.build)
    assert not getattr(raw, "_hybridcache_pinned", False)

    class Vllm(CPUAttentionMetadataBuilder):
        build = raw

    class Pinned(CPUAttentionMetadataBuilder):
        build = raw

    assert compat.pin_cpu_attention_split(Pinned)
    assert not compat.pin_cpu_attention_split(Pinned)       # idempotent
    return Vllm, Pinned


class _Request:
    """One request's KV cache (every row written once) and queries, in vLLM's CPU layout."""

    def __init__(self, dtype: torch.dtype) -> None:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.dtype, self.isa = dtype, _get_attn_isa(dtype, BS, D)
        if self.isa == "amx":
            torch.cpu._init_amx()  # the kernel's AMX tiles need the process's permission
        g = torch.Generator().manual_seed(0)
        nb = N // BS + 1
        kv = torch.zeros(nb, KVH, BS, 2 * D, dtype=dtype).view(nb, KVH, 2 * BS, D)
        self.kc, self.vc = kv.chunk(2, dim=2)
        self.q = torch.randn(N, H, D, generator=g).to(dtype)
        k, v = (torch.randn(N, KVH, D, generator=g).to(dtype) for _ in range(2))
        ops.cpu_attn_reshape_and_cache(k, v, self.kc, self.vc, torch.arange(N), self.isa)
        self.block_table = torch.arange(nb, dtype=torch.int32)[None, :]
        self.builder = SimpleNamespace(
            is_cross_attention=False, is_encoder_only_attention=False, num_heads=H,
            num_kv_heads=KVH, head_dim=D, dtype=dtype, window_size=-1, isa=self.isa,
            kv_cache_dtype="auto", block_size=BS)

    def prefill(self, build, steps: list[int]) -> torch.Tensor:
        """Every query's attention output, the prompt prefilled in steps of these lengths."""
        from vllm import _custom_ops as ops

        out, s = torch.empty_like(self.q), 0
        for n in steps:
            e = s + n
            common = SimpleNamespace(
                num_reqs=1, num_actual_tokens=n, max_query_len=n, max_seq_len=e,
                query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                seq_lens=torch.tensor([e], dtype=torch.int32),
                block_table_tensor=self.block_table, slot_mapping=torch.arange(s, e),
                causal=True, positions=torch.arange(s, e))
            md = build(self.builder, 0, common)
            ops.cpu_attention_with_kv_cache(
                query=self.q[s:e], key_cache=self.kc, value_cache=self.vc, output=out[s:e],
                query_start_loc=md.query_start_loc, seq_lens=md.seq_lens, scale=D ** -0.5,
                causal=True, alibi_slopes=None, sliding_window=-1, block_table=md.block_table,
                softcap=0.0, scheduler_metadata=md.scheduler_metadata, s_aux=None)
            s = e
        return out


def _steps(n: int, first: int | None = None) -> list[int]:
    steps = [] if first is None else [first]
    while sum(steps) < N:
        steps.append(min(n, N - sum(steps)))
    return steps


PATTERNS = [_steps(2048), _steps(256), _steps(64), _steps(320, first=64), _steps(N)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pinned_cpu_attention_is_split_invariant_and_vllms_is_not(dtype):
    vllm_builder, pinned = _builder_classes()
    req = _Request(dtype)
    base = req.prefill(pinned.build, PATTERNS[0])
    for steps in PATTERNS[1:]:
        assert torch.equal(req.prefill(pinned.build, steps), base), (dtype, steps[:2])
    # the pin changes the attention's blocking, not its result beyond rounding
    plain = req.prefill(vllm_builder.build, PATTERNS[0])
    assert torch.allclose(plain.float(), base.float(), atol=2e-2 if dtype == torch.bfloat16
                          else 1e-5)
    # negative control: vLLM's own metadata, same kernel, gives step-dependent bits
    differ = [not torch.equal(req.prefill(vllm_builder.build, steps), plain)
              for steps in PATTERNS[1:]]
    assert any(differ), f"vLLM's CPU attention was split-invariant here ({dtype})"


def test_pieces_cover_every_query_once_as_causal_requests():
    qsl = torch.tensor([0, 5, 6, 26], dtype=torch.int32)    # 5 queries, 1 (decode), 20
    seq = torch.tensor([105, 7, 20], dtype=torch.int32)     # the third request starts at 0
    new_qsl, new_seq, rows = compat.split_attention_queries(qsl, seq, 8)
    assert new_qsl.tolist() == [0, 5, 6, 14, 22, 26]
    assert new_seq.tolist() == [105, 7, 8, 16, 20]
    assert rows.tolist() == [0, 1, 2, 2, 2]
    assert new_qsl.dtype == qsl.dtype and new_seq.dtype == seq.dtype


def test_piece_size_is_one_register_iteration_of_query_heads():
    assert compat.cpu_attention_piece_tokens("amx", 4, 1) == 8      # 32 heads / 4 per KV head
    assert compat.cpu_attention_piece_tokens("vec", 4, 1) == 2      # 8 heads / 4
    assert compat.cpu_attention_piece_tokens("vec", 12, 1) == 8     # not a multiple: MHA
    assert compat.cpu_attention_piece_tokens("neon", 4, 1) == 1     # unchecked ISA: 1 token


def test_the_pin_is_part_of_the_engine_fingerprint_only_when_on(monkeypatch):
    """Links captured with the pin hold other attention bits: engines that differ in it must
    never read each other's link files; engines with it off keep their former fingerprint."""
    from vllm_hybridcache.adapter.fingerprint import kernel_backend
    from vllm_hybridcache.config import CPU_ATTN_SPLIT_INVARIANT_ENV, cpu_attention_pinned

    cfg = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))
    monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "0")
    off = kernel_backend(cfg)
    assert not cpu_attention_pinned() and "cpu_attention" not in off
    monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "1")
    assert cpu_attention_pinned()
    assert kernel_backend(cfg) == off + ";cpu_attention_split_invariant=1"


def test_the_pin_is_opt_in_and_refuses_other_values(monkeypatch):
    """Unset or 0 = off (it costs a turn after a long context, docs/split-invariance.md), 1 =
    on; a value other than 0/1 is refused, never read as a mode."""
    from vllm_hybridcache.config import (
        CPU_ATTN_SPLIT_INVARIANT_ENV,
        SettingsError,
        cpu_attention_pinned,
    )

    monkeypatch.delenv(CPU_ATTN_SPLIT_INVARIANT_ENV, raising=False)
    assert not cpu_attention_pinned()
    monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "0")
    assert not cpu_attention_pinned()
    monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "1")
    assert cpu_attention_pinned()
    for bad in ("yes", "2", "true"):
        monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, bad)
        with pytest.raises(SettingsError, match=CPU_ATTN_SPLIT_INVARIANT_ENV):
            cpu_attention_pinned()
