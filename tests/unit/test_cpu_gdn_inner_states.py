"""vLLM's CPU Gated-DeltaNet op with inner states (compat.install_cpu_gdn_inner_states): a
prefilling request with wanted offsets runs piece by piece and hands its states at each
offset to the hook. vLLM's real op (`_cpu_gdn_attention_nonspec`: its conv and chunked
delta-rule kernels) runs on a mixed batch, qwen3-next-tiny's GDN shapes, with and without
pieces: outputs and final states are identical, and each handed state equals the slot after a
step that ends at that offset (docs/split-invariance.md, "vLLM's Qwen3-Next on CPU")."""

from __future__ import annotations

import pytest
import torch

from vllm_hybridcache import compat

KH, VH, DK, DV, W = 2, 4, 64, 64, 4         # qwen3-next-tiny: 2 key / 4 value heads of 64
DIM = 2 * KH * DK + VH * DV                 # conv channels (q, k, v)
SLOTS = 6


class _Conv(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None


class _Layer:
    """The attributes of vLLM's `QwenGatedDeltaNetAttention` that the CPU op reads."""

    def __init__(self, seed: int, ssm_dtype: torch.dtype) -> None:
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            QwenGatedDeltaNetAttention,
        )
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        g = torch.Generator().manual_seed(seed)
        self.prefix = "model.layers.0.linear_attn"
        self.activation = "silu"
        self.key_dim, self.value_dim, self.tp_size = KH * DK, VH * DV, 1
        self.head_k_dim, self.head_v_dim = DK, DV
        self._rearrange = QwenGatedDeltaNetAttention.rearrange_mixed_qkv
        self.conv1d = _Conv((torch.randn(DIM, 1, W, generator=g) * 0.5).bfloat16())
        dispatch_cpu_unquantized_gemm(self.conv1d, remove_weight=False)  # vLLM's packing
        self.A_log = torch.randn(VH, generator=g).float() * 0.1
        self.dt_bias = torch.ones(VH).bfloat16()
        shape = (SLOTS, DIM, W - 1) if is_conv_state_dim_first() else (SLOTS, W - 1, DIM)
        self.dim_first = is_conv_state_dim_first()
        conv = torch.randn(*shape, generator=g).bfloat16()
        ssm = (torch.randn(SLOTS, VH, DV, DK, generator=g) * 0.1).to(ssm_dtype)
        self.kv_cache = (conv, ssm)
        self.inner_capture = None

    def rearrange_mixed_qkv(self, mixed_qkv):
        return self._rearrange(self, mixed_qkv)

    def fresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache[0].clone(), self.kv_cache[1].clone()


class _Hook:
    """An `InnerCapture`: wanted offsets per slot, states received."""

    def __init__(self, want: dict[int, tuple[int, ...]]) -> None:
        self.want, self.got = want, {}

    def offsets(self, slot: int) -> tuple[int, ...]:
        return self.want.get(slot, ())

    def put(self, layer: str, slot: int, offset: int, index: int, value: torch.Tensor) -> None:
        self.got[(layer, slot, offset, index)] = value.detach().clone()


# (slot, tokens, has an initial state): one decode, then three prefills
BATCH = [(1, 1, True), (2, 300, False), (3, 200, True), (4, 100, True)]
WANT = {2: (64, 192), 3: (128,)}


def _metadata(batch):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    lens = [n for _, n, _ in batch]
    decodes = sum(1 for _, n, _ in batch if n == 1)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return GDNAttentionMetadata(
        num_prefills=len(batch) - decodes, num_prefill_tokens=sum(lens[decodes:]),
        num_decodes=decodes, num_decode_tokens=sum(lens[:decodes]), num_spec_decodes=0,
        num_spec_decode_tokens=0, num_actual_tokens=sum(lens),
        has_initial_state=torch.tensor([h for _, _, h in batch]),
        non_spec_query_start_loc=qsl,
        non_spec_state_indices_tensor=torch.tensor([s for s, _, _ in batch], dtype=torch.int32))


def _inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, DIM, generator=g).bfloat16(),
            torch.randn(n, VH, generator=g).bfloat16(),
            torch.randn(n, VH, generator=g).bfloat16())


def _run(fn, layer, batch, x, b, a, states, hook=None):
    """`fn` on `batch` from `states`; (outputs, conv state, ssm state) after the call."""
    layer.kv_cache = (states[0].clone(), states[1].clone())
    layer.inner_capture = hook
    out = torch.zeros(len(x), VH, DV, dtype=torch.bfloat16)
    fn(layer, _metadata(batch), x, b, a, out)
    return out, layer.kv_cache[0], layer.kv_cache[1]


@pytest.fixture(scope="module")
def ops():
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn

    before = gdn._cpu_gdn_attention_nonspec
    compat.install_cpu_gdn_inner_states()
    assert not compat.install_cpu_gdn_inner_states()        # idempotent
    wrapped = gdn._cpu_gdn_attention_nonspec
    assert compat.cpu_gdn_inner_states_installed()
    yield wrapped, wrapped._hybridcache_original
    gdn._cpu_gdn_attention_nonspec = before                 # as this process had it


@pytest.mark.parametrize("ssm_dtype", [torch.bfloat16, torch.float32])
def test_pieces_equal_one_call_and_states_equal_a_step_ending_there(ops, ssm_dtype):
    wrapped, original = ops
    layer = _Layer(0, ssm_dtype)
    states = layer.fresh()
    x, b, a = _inputs(sum(n for _, n, _ in BATCH), 1)
    ref = _run(original, layer, BATCH, x, b, a, states)
    hook = _Hook(WANT)
    got = _run(wrapped, layer, BATCH, x, b, a, states, hook)
    for r, g in zip(ref, got, strict=True):
        assert torch.equal(r, g)
    assert sorted(k[1:] for k in hook.got) == [(2, 64, 0), (2, 64, 1), (2, 192, 0),
                                               (2, 192, 1), (3, 128, 0), (3, 128, 1)]
    starts = {2: 1, 3: 301}                   # where each request's tokens begin in the batch
    for (layer_name, slot, off, idx), value in hook.got.items():
        assert layer_name == layer.prefix
        assert value.dtype == layer.kv_cache[idx].dtype
        assert value.shape == layer.kv_cache[idx].shape[1:]
        # a one-request step of `off` tokens from the same slot state writes the same state
        s = starts[slot]
        _, conv, ssm = _run(original, layer, [(slot, off, slot != 2)], x[s:s + off],
                            b[s:s + off], a[s:s + off], states)
        assert torch.equal(value, (conv, ssm)[idx][slot]), (slot, off, idx)
        if idx == 0:    # the conv state: the last width-1 conv inputs, in the cache's layout
            last = x[s + off - (W - 1):s + off]
            assert torch.equal(value, last.t() if layer.dim_first else last)


def test_no_wanted_offset_runs_vllms_op_unchanged(ops):
    wrapped, original = ops
    layer = _Layer(1, torch.bfloat16)
    states = layer.fresh()
    x, b, a = _inputs(sum(n for _, n, _ in BATCH), 2)
    ref = _run(original, layer, BATCH, x, b, a, states)
    hook = _Hook({5: (64,)})                                  # a slot not in this batch
    got = _run(wrapped, layer, BATCH, x, b, a, states, hook)
    assert all(torch.equal(r, g) for r, g in zip(ref, got, strict=True)) and not hook.got


def test_negative_control_a_cut_off_the_64_grid_changes_the_bits(ops):
    """The same comparison sees a split the kernel is not invariant to: pieces cut at 100
    (not a multiple of its 64-token chunk) give other outputs than one call."""
    _, original = ops
    layer = _Layer(2, torch.bfloat16)
    states = layer.fresh()
    x, b, a = _inputs(300, 3)
    one, _, ssm_one = _run(original, layer, [(2, 300, False)], x, b, a, states)
    head, conv, ssm = _run(original, layer, [(2, 100, False)], x[:100], b[:100], a[:100],
                           states)
    tail, _, ssm_two = _run(original, layer, [(2, 200, True)], x[100:], b[100:], a[100:],
                            (conv, ssm))
    assert torch.equal(head, one[:100])                       # the first piece is untouched
    assert not torch.equal(tail, one[100:]) or not torch.equal(ssm_two, ssm_one)


def test_the_worker_hooks_vllms_qwen_gdn_layers_only(ops):
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    bare = QwenGatedDeltaNetAttention.__new__(QwenGatedDeltaNetAttention)
    assert compat.takes_cpu_gdn_inner_capture(bare)
    assert not compat.takes_cpu_gdn_inner_capture(_Layer(3, torch.bfloat16))
