"""The `inner_captures` setting: off puts a split-invariant engine in step mode (links only
where a step ends), which is what the captures' cost benchmark compares fine mode with
(benchmarks/split_invariance_captures_bench.py; docs/split-invariance.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hybridcache.config import SettingsError, load_settings


def test_inner_captures_is_on_by_default_and_parsed_from_the_environment():
    assert load_settings(environ={}).inner_captures
    assert not load_settings(environ={"VLLM_HYBRIDCACHE_INNER_CAPTURES": "off"}).inner_captures
    assert not load_settings({"inner_captures": False}, environ={}).inner_captures
    with pytest.raises(SettingsError, match="INNER_CAPTURES must be a boolean"):
        load_settings(environ={"VLLM_HYBRIDCACHE_INNER_CAPTURES": "sometimes"})


def test_inner_captures_off_gives_step_mode_on_a_split_invariant_engine(monkeypatch,
                                                                        embedded_model):
    from vllm.config import ModelConfig

    from vllm_hybridcache.adapter.segmentation_mode import segmentation_mode
    from vllm_hybridcache.flash_next import registration
    from vllm_hybridcache.flash_next.ops.split_invariant import ENV_VAR

    registration.register()
    monkeypatch.setenv(ENV_VAR, "1")
    mc = ModelConfig(model=str(embedded_model("flash-next-tiny")), max_model_len=512)
    config = SimpleNamespace(model_config=mc, speculative_config=None)
    assert segmentation_mode(config)[0] == "fine"
    assert segmentation_mode(config, inner_captures=True)[0] == "fine"
    assert segmentation_mode(config, inner_captures=False) == ("step", "inner_captures off")
