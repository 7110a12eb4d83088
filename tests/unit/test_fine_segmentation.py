"""Fine segmentation's pure parts: where a step captures inside itself, where a prompt parts
from a recent one (junction), and the worker's hook that receives the model's inner states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hybridcache.adapter.inner_states import InnerStates
from vllm_hybridcache.adapter.plans import CaptureJob, StepPlan
from vllm_hybridcache.core import LinkAddr
from vllm_hybridcache.segmentation import RecentPrompts, floor_aligned, inner_positions


def test_inner_positions_only_inside_steps_that_start_aligned():
    cuts = frozenset({2048})
    assert inner_positions(0, 2048, [64, 130, 576, 2048, 3000], cuts) == [64, 576]
    assert inner_positions(2048, 3100, [576, 2112, 3072, 3100], cuts) == [2112, 3072]
    # a step starting after a message-end cut (not 64-aligned): nothing inside it is exact
    assert inner_positions(700, 1500, [768, 1024], cuts) == []
    assert inner_positions(0, 600, [192, 192, 128], cuts) == [128, 192]
    assert floor_aligned(599) == 576 and floor_aligned(64) == 64


def test_junction_is_where_a_prompt_parts_from_a_recent_one():
    rp = RecentPrompts(max_tokens=1000)
    a = np.arange(10, 310, dtype=np.int64)
    dom, other = b"d", b"e"
    assert rp.junction(dom, a) == 0
    rp.remember(dom, a)
    assert rp.junction(dom, a) == 0                       # identical: no divergence
    assert rp.junction(dom, a[:200]) == 0                 # a prefix: it never parts
    b = np.concatenate([a[:150], np.arange(5000, 5100)])
    assert rp.junction(dom, b) == 150
    assert rp.junction(other, b) == 0                     # another domain never compares
    longer = np.concatenate([a, [1, 2, 3]])
    assert rp.junction(dom, longer) == 300                # extends it: parts at its end
    for i in range(4):                                    # bounded: the oldest goes first
        rp.remember(dom, np.full(300, 1000 + i, dtype=np.int64))
    assert rp.junction(dom, b) == 0


def _job(link_id: int, slot: int, offset: int) -> CaptureJob:
    return CaptureJob(addr=LinkAddr("ram", "tree", link_id), req_id="r", row_start=0,
                      row_end=offset, block_ids=[[slot], [slot + 10], [1, 2]],
                      inner_offset=offset)


def test_inner_states_hook_arms_per_group_slot_and_fails_on_a_missing_state():
    inner = InnerStates({"a#0": (0, "la", 0), "a#1": (0, "la", 1), "b#0": (1, "lb", 0)})
    ha, hb = inner.hook(0), inner.hook(1)
    assert ha.offsets(3) == ()
    inner.arm(StepPlan(captures=[_job(1, 3, 128), _job(2, 3, 64)]))
    assert ha.offsets(3) == (64, 128) and hb.offsets(13) == (64, 128)
    assert ha.offsets(13) == () and hb.offsets(3) == ()
    value = torch.ones(2)
    ha.put("la", 3, 64, 0, value)
    value.add_(1)                         # the layer goes on writing: the hook kept a copy
    ha.put("la", 3, 64, 1, torch.zeros(2))
    hb.put("lb", 13, 64, 0, torch.full((2,), 5.0))
    got = inner.sections(_job(2, 3, 64))
    assert torch.equal(got["a#0"], torch.ones(2)) and torch.equal(got["b#0"], torch.full((2,), 5.0))
    with pytest.raises(KeyError, match="offset 128"):
        inner.sections(_job(1, 3, 128))   # never handed over: the capture fails
    inner.clear()
    assert ha.offsets(3) == ()
    with pytest.raises(KeyError):
        inner.sections(_job(2, 3, 64))


def test_stats_name_each_engines_segmentation_mode():
    from vllm_hybridcache.adapter.stats import encode
    from vllm_hybridcache.core import CacheStats
    from vllm_hybridcache.serving.http import aggregate

    fine = encode({("ram", "tree"): CacheStats(hits=1)}, 1, "e", segmentation="fine")
    step = encode({("ram", "tree"): CacheStats(hits=2)}, 1, "f", segmentation="step")
    out = aggregate({0: fine, 1: step})
    assert out["segmentation"] == {"0": "fine", "1": "step"}
    assert out["tiers"]["ram"]["hits"] == 3


def test_mode_is_fine_only_where_the_model_says_its_forward_is_split_invariant(
        monkeypatch, embedded_model):
    from types import SimpleNamespace

    from vllm.config import ModelConfig

    from vllm_hybridcache.adapter.segmentation_mode import segmentation_mode
    from vllm_hybridcache.flash_next import registration
    from vllm_hybridcache.flash_next.ops.split_invariant import ENV_VAR

    registration.register()

    def config(name: str, speculative=None, quant=None, tp: int = 1):
        mc = ModelConfig(model=str(embedded_model(name)), max_model_len=512)
        return SimpleNamespace(model_config=mc, speculative_config=speculative,
                               quant_config=quant,
                               parallel_config=SimpleNamespace(tensor_parallel_size=tp))

    monkeypatch.setenv(ENV_VAR, "1")
    assert segmentation_mode(config("flash-next-tiny"))[0] == "fine"
    assert segmentation_mode(config("flash-next-tiny", speculative=object()))[0] == "step"
    # vLLM's linear layers (a quantized checkpoint, TP > 1) are not tiled by the switch
    assert segmentation_mode(config("flash-next-tiny", quant=object()))[0] == "step"
    assert segmentation_mode(config("flash-next-tiny", tp=2))[0] == "step"
    monkeypatch.setenv(ENV_VAR, "0")
    assert segmentation_mode(config("flash-next-tiny"))[0] == "step"


def test_qwen3_next_is_fine_only_with_split_invariant_attention_and_the_gdn_bend(
        monkeypatch, embedded_model):
    """vLLM's Qwen3-Next on CPU: fine needs its attention split-invariant (our kernel by
    default, in an engine running the connector, where vLLM lays its KV cache out for `vec`;
    or the pin) and vLLM's CPU GDN op handing over inner states
    (compat.install_cpu_gdn_inner_states) in this process; step otherwise, with a why that
    names what is missing."""
    from types import SimpleNamespace

    import torch
    from vllm.config import ModelConfig

    import vllm_hybridcache.adapter.segmentation_mode as modes
    from vllm_hybridcache.config import CONNECTOR_NAME, CPU_ATTN_SPLIT_INVARIANT_ENV
    from vllm_hybridcache.ops import cpu_attention

    mc = ModelConfig(model=str(embedded_model("qwen3-next-tiny")), max_model_len=512,
                     dtype="bfloat16")
    cache = SimpleNamespace(block_size=384, cache_dtype="auto")
    ktc = SimpleNamespace(kv_connector=CONNECTOR_NAME)
    config = SimpleNamespace(model_config=mc, speculative_config=None, cache_config=cache,
                             kv_transfer_config=ktc)
    monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "0")
    monkeypatch.setattr(modes, "cpu_gdn_inner_states_installed", lambda: True)
    mode, why = modes.segmentation_mode(config)
    assert mode == "step" and CPU_ATTN_SPLIT_INVARIANT_ENV in why
    monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "1")
    assert modes.segmentation_mode(config) == (
        "fine", "Qwen3NextForCausalLM with the CPU attention pin: split-invariant at "
        "64-aligned positions")
    monkeypatch.delenv(CPU_ATTN_SPLIT_INVARIANT_ENV)            # the default: our kernel
    mode, why = modes.segmentation_mode(config)
    if cpu_attention.available() and not torch.cpu._is_amx_tile_supported():
        assert (mode, "kernel" in why) == ("fine", True)
    else:                                                       # vLLM's AMX layout, no build
        assert mode == "step" and CPU_ATTN_SPLIT_INVARIANT_ENV in why
    # an engine without the connector computes as without the package
    no_connector = SimpleNamespace(model_config=mc, speculative_config=None,
                                   cache_config=cache, kv_transfer_config=None)
    mode, why = modes.segmentation_mode(no_connector)
    assert mode == "step" and "connector" in why
    monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "1")
    assert modes.segmentation_mode(config, inner_captures=False)[0] == "step"
    assert modes.segmentation_mode(
        SimpleNamespace(model_config=mc, speculative_config=object()))[0] == "step"
    monkeypatch.setattr(modes, "cpu_gdn_inner_states_installed", lambda: False)
    mode, why = modes.segmentation_mode(config)
    assert mode == "step" and "inside a step" in why


def test_a_resume_floor_only_for_vllm_gdn_models_in_fine_mode(embedded_model):
    """vLLM's Qwen3-Next in fine mode: a tree hit inside a step must leave its resumed step
    MIN_INNER_RESUME tokens (vLLM's GEMMs pick kernels by the step's rows); Flash-Next's
    split-invariant forward computes fixed row tiles, so no floor; step mode never needs one."""
    from types import SimpleNamespace

    from vllm.config import ModelConfig

    from vllm_hybridcache.adapter.segmentation_mode import MIN_INNER_RESUME, inner_resume_floor
    from vllm_hybridcache.flash_next import registration

    registration.register()

    def config(name: str):
        mc = ModelConfig(model=str(embedded_model(name)), max_model_len=512)
        return SimpleNamespace(model_config=mc, speculative_config=None)

    assert MIN_INNER_RESUME == 64
    assert inner_resume_floor(config("qwen3-next-tiny"), "fine") == MIN_INNER_RESUME
    assert inner_resume_floor(config("qwen3-next-tiny"), "step") == 0
    assert inner_resume_floor(config("flash-next-tiny"), "fine") == 0
