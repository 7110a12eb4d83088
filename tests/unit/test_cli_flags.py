"""`vllm serve --plugin hybridcache`: the flags it stands for."""

from __future__ import annotations

import json

import pytest

from vllm_hybridcache.cli.vllm_entry import split_plugin_args
from vllm_hybridcache.serving import flags


def test_split_plugin_args():
    plugins, rest = split_plugin_args(["serve", "m", "--plugin", "hybridcache", "--port", "1"])
    assert plugins == ["hybridcache"] and rest == ["serve", "m", "--port", "1"]
    plugins, rest = split_plugin_args(["serve", "m", "--plugin=hybridcache"])
    assert plugins == ["hybridcache"] and rest == ["serve", "m"]


def test_unknown_plugin_is_an_error():
    with pytest.raises(SystemExit, match="unknown plugin 'nope'"):
        split_plugin_args(["serve", "m", "--plugin", "nope"])
    with pytest.raises(SystemExit, match="needs a name"):
        split_plugin_args(["serve", "m", "--plugin"])


def test_hybrid_model_gets_connector_scheduler_and_no_native_prefix_cache(
        embedded_model, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    path = str(embedded_model("qwen3-next-tiny"))
    out = flags.apply_plugin(["hybridcache"], ["serve", path, "--port", "9"])
    cfg = json.loads(out[out.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "HybridSnapshotConnector"
    assert cfg["kv_load_failure_policy"] == "recompute"
    assert out[out.index("--scheduler-cls") + 1] == flags.SCHEDULER_CLS
    assert "--no-enable-prefix-caching" in out
    import os

    plugins = os.environ["VLLM_PLUGINS"].split(",")
    assert "hybridcache" in plugins and "hybridcache_http" in plugins


def test_user_flags_win(embedded_model, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    path = str(embedded_model("qwen3-next-tiny"))
    out = flags.apply_plugin(["hybridcache"], ["serve", path, "--scheduler-cls", "x.Y"])
    assert out.count("--scheduler-cls") == 1 and "x.Y" in out
    with pytest.raises(SystemExit, match="cannot be combined"):
        flags.apply_plugin(["hybridcache"], ["serve", path, "--kv-transfer-config",
                                             '{"kv_connector": "LMCacheConnectorV1"}'])


def test_non_hybrid_model_passes_through(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                num_attention_heads=2, vocab_size=100).save_pretrained(tmp_path)
    args = ["serve", str(tmp_path), "--port", "9"]
    assert flags.apply_plugin(["hybridcache"], args) == args
    assert "not a hybrid model" in capsys.readouterr().out


def test_hybrid_detection(embedded_model):
    assert flags.is_hybrid_model(str(embedded_model("qwen3-next-tiny")))
    assert flags.is_hybrid_model(str(embedded_model("flash-next-tiny")))


def test_disk_tier_with_spill_gets_a_graceful_shutdown(embedded_model, monkeypatch):
    """With session spill on, SIGTERM must leave the worker time to write end anchors: vLLM's
    default --shutdown-timeout 0 kills the engine at once."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv(flags.WORKER_SHUTDOWN_ENV, raising=False)
    path = str(embedded_model("qwen3-next-tiny"))
    monkeypatch.setenv("VLLM_HYBRIDCACHE_DISK_DIR", "/tmp/hc-flags-test")
    monkeypatch.setenv("VLLM_HYBRIDCACHE_SPILL_TIMEOUT_S", "9")
    out = flags.apply_plugin(["hybridcache"], ["serve", path])
    assert out[out.index("--shutdown-timeout") + 1] == str(9 + flags.SPILL_GRACE_MARGIN_S)
    import os

    assert os.environ[flags.WORKER_SHUTDOWN_ENV] == "10"
    # the user's own grace wins
    out = flags.apply_plugin(["hybridcache"], ["serve", path, "--shutdown-timeout=3"])
    assert out.count("--shutdown-timeout=3") == 1
    assert not any(a == "--shutdown-timeout" for a in out)
    # spill off, or no disk tier: vLLM's default stays
    monkeypatch.setenv("VLLM_HYBRIDCACHE_SESSION_SPILL", "0")
    assert "--shutdown-timeout" not in flags.apply_plugin(["hybridcache"], ["serve", path])
    monkeypatch.delenv("VLLM_HYBRIDCACHE_DISK_DIR")
    monkeypatch.delenv("VLLM_HYBRIDCACHE_SESSION_SPILL")
    assert "--shutdown-timeout" not in flags.apply_plugin(["hybridcache"], ["serve", path])
