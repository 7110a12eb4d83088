"""The launcher's command line (no Ray started): flags after `--` go to every replica's
`vllm serve`, an embedded model's name becomes its folder, the replicas get the launcher's
vLLM settings but never its own cluster identity; a local cluster without `--secret-file`
gets a fresh private secret, a cluster of several nodes is refused one."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from vllm_hybridcache.core.auth import MIN_SECRET_BYTES, key_from_file
from vllm_hybridcache.fleet import launcher


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
    monkeypatch.setenv("VLLM_HYBRIDCACHE_CLUSTER_SECRET_FILE", "/elsewhere/secret")
    monkeypatch.setenv("HOME_UNRELATED", "x")
    env = launcher.replica_env()
    assert env["VLLM_HYBRIDCACHE_GRID"] == "256" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "VLLM_HYBRIDCACHE_CLUSTER_ADDRESS" not in env
    assert "VLLM_HYBRIDCACHE_CLUSTER_REPLICA" not in env and "HOME_UNRELATED" not in env
    assert "VLLM_HYBRIDCACHE_CLUSTER_SECRET_FILE" not in env  # the Cluster sets its own


def test_the_parser(monkeypatch):
    args = launcher.build_parser().parse_args(["m", "--replicas", "3", "--policy",
                                               "round_robin", "--address", "auto"])
    assert (args.replicas, args.policy, args.address, args.port) == (3, "round_robin",
                                                                     "auto", 8000)
    with pytest.raises(SystemExit):
        launcher.build_parser().parse_args(["m", "--policy", "random"])


def test_the_secret_file_flag_defaults_to_its_variable(monkeypatch):
    monkeypatch.delenv(launcher.SECRET_ENV, raising=False)
    assert launcher.build_parser().parse_args(["m"]).secret_file is None
    monkeypatch.setenv(launcher.SECRET_ENV, "/run/secrets/hybridcache")
    assert launcher.build_parser().parse_args(["m"]).secret_file == "/run/secrets/hybridcache"
    args = launcher.build_parser().parse_args(["m", "--secret-file", "/etc/hc/secret"])
    assert args.secret_file == "/etc/hc/secret"


def _nodes(*addresses: str, dead: tuple[str, ...] = ()) -> list[dict]:
    return ([{"NodeManagerAddress": a, "Alive": True} for a in addresses]
            + [{"NodeManagerAddress": a, "Alive": False} for a in dead])


def _bare_cluster() -> launcher.Cluster:
    """A Cluster with nothing started (no Ray, no replicas): what `stop` needs to find."""
    c = object.__new__(launcher.Cluster)
    c._secret_dir, c.url, c.actors, c.book = None, None, {}, None
    return c


def test_a_local_cluster_gets_a_fresh_secret_only_its_user_reads(monkeypatch):
    """Without --secret-file, one node: a new secret (random, long enough) in a folder of its
    own, 0700, the file 0600 and this user's, usable as a cluster secret by the replicas'
    own check; another launch gets another secret; `stop` removes it. A dead node does not
    count. Before issue 29 there was no secret to make."""
    monkeypatch.setattr(launcher.ray, "nodes", lambda: _nodes("10.0.0.1", dead=("10.0.0.2",)))
    c = _bare_cluster()
    path = Path(c._local_secret())
    folder = path.parent
    try:
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert sorted(p.name for p in folder.iterdir()) == [path.name]
        secret = path.read_bytes().strip()
        assert len(secret) >= 2 * MIN_SECRET_BYTES
        assert key_from_file(path, "cluster").key_id
        other = Path(_bare_cluster()._local_secret())
        try:
            assert other.parent != folder and other.read_bytes().strip() != secret
        finally:
            shutil.rmtree(other.parent)
    finally:
        c.stop()
    assert not folder.exists()


def test_a_cluster_of_several_nodes_is_refused_a_local_secret(monkeypatch):
    """The launcher cannot hand a secret to other machines: on two nodes without
    --secret-file it stops with the fix in the message, and makes no secret."""
    monkeypatch.setattr(launcher.ray, "nodes", lambda: _nodes("10.0.0.1", "10.0.0.2"))
    made = []
    monkeypatch.setattr(launcher.tempfile, "mkdtemp", lambda **kw: made.append(kw) or "/x")
    with pytest.raises(launcher.LaunchError, match="--secret-file"):
        _bare_cluster()._local_secret()
    assert made == []
