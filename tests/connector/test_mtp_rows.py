"""The draft head's rows without an engine: what makes a rebuilt boundary row exact.

A restore on the MTP route rebuilds each link's boundary row (the draft row at a step's last
position) from the kept target hidden row and the new prompt's token (adapter/draft_rows.py),
running `MTPModule.draft_rows` on the step's shape with those inputs repeated. That is exact
because a row's bits may depend on the shape of the pass (on this box's float32 GEMMs one row
alone rounds differently from the same row among 7 to 256) but never on the other rows'
values. Both halves are checked here on
flash-next-tiny's draft head with random weights, in float32 and in bf16 (vLLM's CPU GEMMs);
the engine test (test_mtp_route.py) checks the whole restore.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hybridcache.flash_next.mtp import DRAFT_HEAD, MTPModule


def _head(model_path, dtype: torch.dtype) -> MTPModule:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    text = getattr(cfg, "text_config", cfg)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=text, dtype=dtype),
        compilation_config=SimpleNamespace(static_forward_context={}),
        cache_config=SimpleNamespace(block_size=128))
    torch.manual_seed(0)
    head = MTPModule(vllm_config)
    assert vllm_config.compilation_config.static_forward_context[DRAFT_HEAD] is head
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(std=0.05)
    head.to(dtype)
    head.ops.prepare_model(head)        # bf16: vLLM's CPU GEMMs, as after loading weights
    return head


def _forward_rows(head: MTPModule, ids, pos, hidden) -> torch.Tensor:
    """The rows a forward pass computes (the attention layer's projections, as it writes)."""
    attn = head.layers[0].self_attn
    seen = {}
    project = attn._project

    def spy(x, cos, sin):
        seen["out"] = project(x, cos, sin)
        return seen["out"]

    attn._project = spy
    try:
        with torch.inference_mode():
            head(ids, pos, hidden)
    finally:
        attn._project = project
    _, raw_k, _, _, k, v = seen["out"]
    t = ids.shape[0]
    return torch.cat([k.reshape(t, -1), v.reshape(t, -1), raw_k], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_boundary_row_rebuilt_on_the_step_shape_equals_the_forward(embedded_model, dtype):
    head = _head(embedded_model("flash-next-tiny"), dtype)
    prefix = head.layers[0].self_attn.prefix
    for m in (7, 64, 256):
        ids = torch.randint(0, 1000, (m,), dtype=torch.int32)   # the drafter's int32 ids
        pos = torch.arange(300, 300 + m)
        hidden = torch.randn(m, head.hidden).to(dtype)
        cold = _forward_rows(head, ids, pos, hidden)[-1]
        rebuilt = head.draft_rows(torch.full((m,), int(ids[-1])), pos,
                                  hidden[-1:].expand(m, -1).contiguous())[prefix][-1]
        assert torch.equal(rebuilt, cold), m
        # negative control: another token at the boundary gives another row
        other = head.draft_rows(torch.full((m,), int(ids[-1]) + 1), pos,
                                hidden[-1:].expand(m, -1).contiguous())[prefix][-1]
        assert not torch.equal(other, cold)
