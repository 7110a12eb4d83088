"""A plain vLLM config of a Flash-Next checkpoint: block prefix caching off, so the engine starts.

vLLM 0.32 turns its block prefix caching (`mamba_cache_mode="align"`) on for every generative
hybrid model; our Flash-Next keeps one state block per request and refuses it at model
construction. The registration extends vLLM's per-architecture config hook so the config comes
out with prefix caching off. These tests build the real `VllmConfig` (no engine) with vLLM's
own defaults, and, as the negative control, with vLLM's original hook back in place.
"""

from __future__ import annotations

import pytest

from vllm_hybridcache import compat
from vllm_hybridcache.flash_next import registration


def _engine_config(model_dir, **overrides):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), max_model_len=4096, **overrides)
    return args.create_engine_config()


@pytest.fixture
def flash_next_dir(embedded_model):
    registration.register()
    return embedded_model("flash-next-tiny")


def test_default_config_turns_block_prefix_caching_off(flash_next_dir, caplog):
    with caplog.at_level("WARNING", logger="vllm_hybridcache"):
        cfg = _engine_config(flash_next_dir)
    assert cfg.cache_config.enable_prefix_caching is False
    assert cfg.cache_config.mamba_cache_mode == "none"
    assert "does not support vLLM's block prefix caching" in caplog.text


def test_vllm_own_hook_still_runs_first(flash_next_dir):
    """vLLM's Qwen4Exp hook (ssm dtype from the HF config, its checks) is kept, not replaced."""
    from vllm.model_executor.models import config as model_configs

    hook = model_configs.MODELS_CONFIG_MAP["Qwen4ExpForCausalLM"]
    assert hook.__mro__[1].__name__ == "Qwen4ExpForCausalLMConfig"
    assert compat.extend_config_hook("Qwen4ExpForCausalLM",
                                     registration.block_prefix_caching_off) is False


def test_without_the_extension_vllm_asks_for_align_mode(flash_next_dir, monkeypatch):
    """Negative control: with vLLM's original hook, the same config asks for what the model
    refuses, so the first test really depends on the extension."""
    from vllm.model_executor.models import config as model_configs

    for arch in registration.SERVING_ARCHITECTURES:
        ours = model_configs.MODELS_CONFIG_MAP[arch]
        monkeypatch.setitem(model_configs.MODELS_CONFIG_MAP, arch, ours.__mro__[1])
    cfg = _engine_config(flash_next_dir)
    assert cfg.cache_config.enable_prefix_caching is True
    assert cfg.cache_config.mamba_cache_mode == "align"


def test_expert_parallel_is_refused_on_the_cpu_platform_at_config_time(flash_next_dir):
    """vLLM's CPU fused-MoE kernels ignore the expert map (a TP = 2 engine with expert
    parallelism crashed its worker at the first request): the config is refused, saying why."""
    with pytest.raises(ValueError, match="--enable-expert-parallel is not supported on the CPU"):
        _engine_config(flash_next_dir, enable_expert_parallel=True)


def test_expert_parallel_passes_the_check_off_the_cpu_platform():
    """Negative control: the same request on another platform (the rule, without an engine)
    passes, and so does the CPU platform without expert parallelism."""
    from types import SimpleNamespace

    from vllm_hybridcache.flash_next.parallel import refuse_cpu_expert_parallel

    config = SimpleNamespace(parallel_config=SimpleNamespace(enable_expert_parallel=True))
    refuse_cpu_expert_parallel(config, is_cpu=False)
    with pytest.raises(ValueError):
        refuse_cpu_expert_parallel(config, is_cpu=True)
    config.parallel_config.enable_expert_parallel = False
    refuse_cpu_expert_parallel(config, is_cpu=True)


def test_both_extensions_share_one_class_and_are_added_once(flash_next_dir):
    """The registration adds two extensions per architecture, in one class right above
    vLLM's; registering again adds neither."""
    from vllm.model_executor.models import config as model_configs

    before = model_configs.MODELS_CONFIG_MAP["Qwen4ExpForCausalLM"]
    assert before._hybridcache_after == (registration.no_cpu_expert_parallel,
                                         registration.block_prefix_caching_off)
    registration.register()
    assert model_configs.MODELS_CONFIG_MAP["Qwen4ExpForCausalLM"] is before
    for after in (registration.no_cpu_expert_parallel, registration.block_prefix_caching_off):
        assert compat.extend_config_hook("Qwen4ExpForCausalLM", after) is False
