"""Settings: config keys, environment variables, defaults, validation with clear errors."""

from __future__ import annotations

import pytest

from vllm_hybridcache.config import CacheSettings, SettingsError, load_settings


def test_defaults_are_valid_and_documented():
    s = load_settings({}, environ={})
    assert s == CacheSettings()
    assert s.grid % 64 == 0 and s.active
    assert "grid" in CacheSettings.__doc__ and "budget_bytes" in CacheSettings.__doc__


def test_config_key_beats_environment():
    env = {"VLLM_HYBRIDCACHE_GRID": "256", "VLLM_HYBRIDCACHE_BUDGET_BYTES": "1000000"}
    s = load_settings({"grid": 1024}, environ=env)
    assert s.grid == 1024 and s.budget_bytes == 1000000


@pytest.mark.parametrize("env,value", [
    ({"VLLM_HYBRIDCACHE_ENABLED": "off"}, False),
    ({"VLLM_HYBRIDCACHE_ENABLED": "1"}, True),
])
def test_enabled_switch_from_environment(env, value):
    assert load_settings(environ=env).enabled is value


def test_budget_zero_turns_the_cache_off():
    assert not load_settings({"budget_bytes": 0}, environ={}).active


@pytest.mark.parametrize("extra,message", [
    ({"grid": 100}, "multiple of 64"),
    ({"grid": 0}, "multiple of 64"),
    ({"budget_bytes": -1}, "budget_bytes must be >= 0"),
    ({"max_link_bytes": -5}, "max_link_bytes"),
    ({"memory_floor_bytes": -5}, "memory_floor_bytes"),
    ({"policy": "fifo"}, "policy"),
    ({"grdi": 512}, "unknown hybridcache setting 'grdi'"),
    ({"grid": "large"}, "Expected `int`"),
])
def test_bad_settings_are_clear_errors(extra, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(extra, environ={})


@pytest.mark.parametrize("env,message", [
    ({"VLLM_HYBRIDCACHE_GRID": "abc"}, "VLLM_HYBRIDCACHE_GRID must be an integer"),
    ({"VLLM_HYBRIDCACHE_ENABLED": "maybe"}, "must be a boolean"),
    ({"VLLM_HYBRIDCACHE_MESSAGE_END_IDS": "1,x"}, "must be integers"),
])
def test_bad_environment_is_a_clear_error(env, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(environ=env)


def test_message_end_ids_from_environment():
    s = load_settings(environ={"VLLM_HYBRIDCACHE_MESSAGE_END_IDS": "7, 9"})
    assert s.message_end_ids == (7, 9)


def test_memory_headroom_warning_names_the_fix():
    from vllm_hybridcache.adapter.scheduler_side import memory_headroom_warning

    gib = 1 << 30
    s = CacheSettings(memory_floor_bytes=4 * gib, budget_bytes=8 * gib)
    assert memory_headroom_warning(20 * gib, s) is None
    msg = memory_headroom_warning(4 * gib + gib // 2, s)
    assert msg is not None and "VLLM_CPU_KVCACHE_SPACE" in msg and "0.5 GiB" in msg
    assert "memory_guard" in (memory_headroom_warning(gib, s) or "")
    # a small budget needs only itself above the floor
    assert memory_headroom_warning(4 * gib + gib // 2, CacheSettings(budget_bytes=gib // 4)) is None
