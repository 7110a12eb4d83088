"""Flash-Next's split-invariant forward (docs/split-invariance.md).

The same prompt prefilled cold under several step patterns whose steps all start at multiples
of 64 must leave every state part (GDN conv tails and recurrent states, the PLE sections, the
QSA rows) and every prompt logit bit-identical to a single-step prefill. The model runs
in-process (`tools.flash_next_steps`), so a pattern costs seconds, not an engine. The negative
control adds an op whose result depends on where its step starts and shows the comparison
catches it.
"""

from __future__ import annotations

import pytest
import torch

from vllm_hybridcache.flash_next.ops import get_backend
from vllm_hybridcache.flash_next.ops.reference import ReferenceOps
from vllm_hybridcache.flash_next.ops.split_invariant import (
    SplitInvariantOps,
    conv_taps,
    sparse_attention_per_query,
    sparse_attention_rowwise,
)
from vllm_hybridcache.tools.flash_next_steps import FlashNextStepper, steps_of

from .helpers import prompt_ids

N = 344  # crosses the indexer budget (60 tokens), ends in a ragged step (344 = 5 * 64 + 24)
PATTERNS = {
    "256": steps_of(N, 256),  # 256, 88
    "64+192": steps_of(N, 192, first=64),  # 64, 192, 88
    "128+192": [128, 192, 24],
}


def differences(a, b) -> list[str]:
    """Names of the state parts / logits that are not bit-identical."""
    out = [] if torch.equal(a.logits, b.logits) else ["logits"]
    for name, parts in a.sections.items():
        out += [f"{name}[{i}]" for i, (x, y) in enumerate(zip(parts, b.sections[name],
                                                              strict=True))
                if not torch.equal(x, y)]
    out += [name for name, rows in a.rows.items() if not torch.equal(rows, b.rows[name])]
    return out


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def stepper(request, embedded_model):
    return FlashNextStepper(embedded_model("flash-next-tiny"), dtype=request.param, ops="cpu",
                            max_len=512, split_invariant=True)


@pytest.fixture(scope="module")
def one_step(stepper):
    return stepper.prefill(prompt_ids(N, seed=17), [N])


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_prefill_is_split_invariant(pattern, stepper, one_step):
    assert isinstance(stepper.ops, SplitInvariantOps)
    got = stepper.prefill(prompt_ids(N, seed=17), PATTERNS[pattern])
    assert len(got.sections) == 3 and len(got.rows) == 1  # every state layer compared
    assert differences(one_step, got) == []


class StepStartRounding:
    """An op that is not split-invariant: `hc_inject` moves the first token of its step by a
    few ulps of the activations' dtype, as a reduction whose order follows the step would."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def hc_inject(self, streams, block_out, inject):
        out = self._inner.hc_inject(streams, block_out, inject)
        out[:1] = out[:1] + out[:1].abs() * (4 * torch.finfo(out.dtype).eps)
        return out


def test_negative_control_a_step_dependent_op_is_caught(stepper, one_step):
    ids = prompt_ids(N, seed=17)
    assert differences(one_step, stepper.prefill(ids, PATTERNS["256"])) == []
    invariant = stepper.ops
    stepper.use_ops(StepStartRounding(invariant))
    try:
        one, split = stepper.prefill(ids, [N]), stepper.prefill(ids, PATTERNS["256"])
    finally:
        stepper.use_ops(invariant)
    broken = differences(one, split)
    # the K/V rows and logits from the second step's first token on (the recurrent states
    # forget a 1-ulp change at token 256 within the 88 tokens after it: the tiny model's
    # random gates decay fast)
    assert "logits" in broken and "model.layers.3.self_attn" in broken, broken
    first = (one.logits != split.logits).any(-1).nonzero()[0].item()
    assert first == PATTERNS["256"][0], first


# ---------------------------------------------------------------- the replaced ops


def _attention_case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens, h, hkv, d, width = [40, 70], 4, 2, 16, 11
    k = torch.randn(sum(lens), hkv, d, generator=g).to(dtype)
    v = torch.randn(sum(lens), hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(lens), h, d, generator=g).to(dtype)
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    idx = torch.full((sum(lens), width), -1, dtype=torch.int32)
    for t, p in enumerate(pos.tolist()):
        pick = torch.randperm(p + 1, generator=g)[:width].sort().values
        idx[t, : pick.numel()] = pick.to(torch.int32)
    return q, k, v, torch.tensor([0, lens[0], sum(lens)]), seq, idx


def _rowwise_attention(*args):
    from vllm_hybridcache.ops import rowwise_linear as rl

    if not rl.available():
        pytest.skip("the row-invariant kernel needs a C++ compiler (make toolchain)")
    return sparse_attention_rowwise(*args, rl.rowwise_linear)


# the split-invariant attention of each form: (op, float32 tolerance against the reference)
ATTENTION_FORMS = {"per_query": (sparse_attention_per_query, 1e-6),
                   "rowwise": (_rowwise_attention, 1e-5)}


@pytest.mark.parametrize("form", list(ATTENTION_FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_the_reference(form, dtype):
    op, tol = ATTENTION_FORMS[form]
    tol = tol if dtype == torch.float32 else 2e-2
    q, k, v, cu, seq, idx = _attention_case(dtype)
    got = op(q, k, v, cu, seq, idx, 0.25)
    ref = ReferenceOps().sparse_attention(q, k, v, cu, seq, idx, 0.25)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("form", list(ATTENTION_FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_does_not_depend_on_the_other_queries(form, dtype):
    """A query's output is the same bits in any block of queries (for the rowwise form: blocks
    whose furthest selection, the span, differs), including alone."""
    op, _ = ATTENTION_FORMS[form]
    q, k, v, cu, seq, idx = _attention_case(dtype, seed=1)
    full = op(q, k, v, cu, seq, idx, 0.25)
    for lo, hi in [(0, 1), (3, 40), (40, 41), (45, 110), (100, 101)]:
        part = op(q[lo:hi], k, v, cu, seq[lo:hi], idx[lo:hi], 0.25)
        assert torch.equal(part, full[lo:hi]), (form, lo, hi)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dilation", [1, 3])
def test_conv_taps_match_the_reference_and_split_exactly(dtype, dilation):
    g = torch.Generator().manual_seed(2)
    c, kw, n = 24, 4, 130
    x = torch.randn(n, c, generator=g).to(dtype)
    w = torch.randn(c, kw, generator=g).to(dtype)
    ref = ReferenceOps()
    cu = torch.tensor([0, n])
    full, state = conv_taps(x, w, cu, None, dilation, "silu")
    want = (ref.causal_conv1d_prefill(x, w, cu, None) if dilation == 1
            else ref.ple_conv(x, w, dilation, cu, None))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(full.float(), want[0].float(), atol=tol, rtol=tol)
    assert torch.equal(state, want[1])
    y1, s1 = conv_taps(x[:64], w, torch.tensor([0, 64]), None, dilation, "silu")
    y2, s2 = conv_taps(x[64:], w, torch.tensor([0, n - 64]), s1, dilation, "silu")
    assert torch.equal(torch.cat([y1, y2]), full) and torch.equal(s2, state)


def test_switch_selects_the_wrapped_backend(monkeypatch):
    from vllm_hybridcache.config import PROCESS_ENV
    from vllm_hybridcache.flash_next.ops import split_invariant

    assert split_invariant.ENV_VAR in PROCESS_ENV
    monkeypatch.setenv(split_invariant.ENV_VAR, "1")
    assert isinstance(get_backend("cpu"), SplitInvariantOps)
    monkeypatch.setenv(split_invariant.ENV_VAR, "0")
    assert not isinstance(get_backend("cpu"), SplitInvariantOps)
    monkeypatch.delenv(split_invariant.ENV_VAR)       # auto: decided per engine, none here
    assert not isinstance(get_backend("cpu"), SplitInvariantOps)
    monkeypatch.setenv(split_invariant.ENV_VAR, "yes please")
    with pytest.raises(ValueError, match="must be auto, 1 or 0"):
        get_backend("cpu")


# ---------------------------------------------------------------- inner captures


class DictCapture:
    """An `InnerCapture` hook (inner_capture.py) that keeps every state it is handed."""

    def __init__(self, offsets: tuple[int, ...]) -> None:
        self._offsets = offsets
        self.got: dict[tuple[str, int, int], torch.Tensor] = {}

    def offsets(self, slot: int) -> tuple[int, ...]:
        return self._offsets

    def put(self, layer: str, slot: int, offset: int, index: int, value) -> None:
        self.got[(layer, offset, index)] = value.clone()


def test_inner_states_equal_a_step_ending_there(stepper, one_step):
    """One step of N tokens that hands over its states at 128 and 320 (the GDN and PLE ops
    run piece by piece) leaves the same logits and final states as without the hook, and each
    handed-over state equals the state a prefill of the prefix alone leaves (the engine test,
    tests/connector/test_fine_cuts.py, has the negative control of a bad inner link)."""
    ids = prompt_ids(N, seed=17)
    hook = DictCapture((128, 320))
    gdn, _ = stepper.state_layers()
    for layer in gdn.values():
        layer.inner_capture = hook
    try:
        got = stepper.prefill(ids, [N])
    finally:
        for layer in gdn.values():
            layer.inner_capture = None
    assert differences(one_step, got) == []
    assert len(hook.got) == 2 * (2 * len(gdn) + 2)  # 2 offsets; GDN (2 parts each), PLE (2)
    for q in (128, 320):
        prefix = stepper.prefill(ids[:q], [q])
        for name, parts in prefix.sections.items():
            for i, part in enumerate(parts):
                assert torch.equal(hook.got[(name, q, i)], part), (name, q, i)


def test_every_moe_block_runs_row_invariant_gemms(stepper):
    """The split-invariant backend puts every MoE block's GEMMs in a row-invariant form
    (found by its `row_linear` / `fixed_rows` attributes, not its class: the op does not
    import the model's layers): the row-invariant kernel where it is built, else the
    fixed-row mode; a block left in its default mode would batch a step's rows per expert
    into GEMMs whose shape follows the step. Every `nn.Linear` is routed the same way."""
    from vllm_hybridcache.flash_next.moe import SparseMoE
    from vllm_hybridcache.flash_next.ops.split_invariant import ROW_TILE, invariant_form
    from vllm_hybridcache.ops.rowwise_linear import rowwise_linear

    blocks = [m for m in stepper.model.modules() if isinstance(m, SparseMoE)]
    assert blocks
    if invariant_form(stepper.model) == "rowwise":
        assert all(m.row_linear is rowwise_linear and not m.fixed_rows for m in blocks)
    else:
        assert all(m.fixed_rows == ROW_TILE and m.row_linear is None for m in blocks)
    linears = [m for m in stepper.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(getattr(m, "_row_tiled", False) for m in linears)


def test_tiles_form_is_split_invariant_too(embedded_model, monkeypatch):
    """Without the kernel (no compiler) the forward falls back to 64-row tiles, and that form
    is split-invariant as well (float32, one pattern)."""
    from vllm_hybridcache.flash_next.ops import split_invariant

    monkeypatch.setattr(split_invariant, "rowwise_available", lambda: False)
    assert split_invariant.invariant_form() == "tiles"
    tiles = FlashNextStepper(embedded_model("flash-next-tiny"), dtype="float32", ops="cpu",
                             max_len=512, split_invariant=True)
    ids = prompt_ids(N, seed=17)
    assert differences(tiles.prefill(ids, [N]), tiles.prefill(ids, PATTERNS["64+192"])) == []
