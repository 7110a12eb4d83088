"""The launcher's command line (no Ray started): flags after `--` go to every replica's
`vllm serve`, an embedded model's name becomes its folder, the replicas get the launcher's
vLLM settings but never its own cluster identity."""

from __future__ import annotations

import pytest

from vllm_hybridcache.cluster import launcher


def test_embedded_names_become_folders_served_under_their_name(monkeypatch, tmp_path):
    monkeypatch.setattr("vllm_hybridcache.models.ensure_model", lambda name: tmp_path / name)
    path, args = launcher._model_path("qwen3-next-tiny", ["--seed", "0"])
    assert path == str(tmp_path / "qwen3-next-tiny")
    assert args == ["--seed", "0", "--served-model-name", "qwen3-next-tiny"]
    _, args = launcher._model_path("qwen3-next-tiny", ["--served-model-name", "x"])
    assert args == ["--served-model-name", "x"]
    assert launcher._model_path("/models/m", []) == ("/models/m", [])


def test_replicas_get_vllm_settings_but_not_a_cluster_identity(monkeypatch):
    monkeypatch.setenv("VLLM_HYBRIDCACHE_GRID", "256")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    monkeypatch.setenv("VLLM_HYBRIDCACHE_CLUSTER_ADDRESS", "elsewhere:6379")
    monkeypatch.setenv("VLLM_HYBRIDCACHE_CLUSTER_REPLICA", "me")
    monkeypatch.setenv("HOME_UNRELATED", "x")
    env = launcher.replica_env()
    assert env["VLLM_HYBRIDCACHE_GRID"] == "256" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "VLLM_HYBRIDCACHE_CLUSTER_ADDRESS" not in env
    assert "VLLM_HYBRIDCACHE_CLUSTER_REPLICA" not in env and "HOME_UNRELATED" not in env


def test_the_parser(monkeypatch):
    args = launcher.build_parser().parse_args(["m", "--replicas", "3", "--policy",
                                               "round_robin", "--address", "auto"])
    assert (args.replicas, args.policy, args.address, args.port) == (3, "round_robin",
                                                                     "auto", 8000)
    with pytest.raises(SystemExit):
        launcher.build_parser().parse_args(["m", "--policy", "random"])
