"""`vllm serve --plugin hybridcache`: the flags it stands for."""

from __future__ import annotations

import json

import pytest

from vllm_hybridcache.cli.vllm_entry import split_plugin_args
from vllm_hybridcache.serving import flags


@pytest.fixture(autouse=True)
def _plugin_env(monkeypatch):
    """`--plugin` sets VLLM_PLUGINS and the worker's shutdown limit in this process's
    environment: each test starts without them, and whatever it set is undone (a plain
    `delenv` of an absent name records nothing to restore, so the value would leak into the
    processes later tests start)."""
    for name in ("VLLM_PLUGINS", flags.WORKER_SHUTDOWN_ENV):
        monkeypatch.setenv(name, "")  # records the value before, or its absence
        monkeypatch.delenv(name)


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
    # (a valid vLLM config: vLLM's own parser refuses a connector without kv_role itself)
    with pytest.raises(SystemExit, match="cannot be combined"):
        flags.apply_plugin(["hybridcache"], ["serve", path, "--kv-transfer-config",
                                             '{"kv_connector": "LMCacheConnectorV1", '
                                             '"kv_role": "kv_both"}'])


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


# --------------------------------------------------------------------- vLLM's own parser


def _kv(out: list[str]):
    """The KVTransferConfig vLLM's parser reads from a command line `apply_plugin` returned."""
    from vllm_hybridcache import compat

    return compat.parse_vllm_serve(out, flags.TRACKED).args.kv_transfer_config


def _llama(folder) -> str:
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                num_attention_heads=2, vocab_size=100).save_pretrained(folder)
    return str(folder)


def test_a_yaml_config_naming_the_model_gets_the_cache(embedded_model, monkeypatch, tmp_path):
    """Defect: with the model named in `--config cfg.yaml` the cache silently stayed off."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model: {embedded_model('qwen3-next-tiny')}\nport: 8123\n"
                   "scheduler_cls: x.Mine\n")
    out = flags.apply_plugin(["hybridcache"], ["serve", "--config", str(cfg)])
    assert _kv(out).kv_connector == "HybridSnapshotConnector"
    assert "--scheduler-cls" not in out  # the YAML's scheduler_cls is the user's: it wins
    # negative control: the same YAML naming a model without recurrent layers adds nothing
    cfg.write_text(f"model: {_llama(tmp_path / 'llama')}\n")
    args = ["serve", "--config", str(cfg)]
    assert flags.apply_plugin(["hybridcache"], args) == args


def test_underscore_spellings_are_the_users_flags(embedded_model, monkeypatch):
    """Defect: `--kv_transfer_config` was not seen, so ours silently replaced it."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    path = str(embedded_model("qwen3-next-tiny"))
    with pytest.raises(SystemExit, match="cannot be combined with --kv-transfer-config naming "
                                         "'LMCacheConnectorV1'"):
        flags.apply_plugin(["hybridcache"], [
            "serve", path, "--kv_transfer_config",
            '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'])
    out = flags.apply_plugin(["hybridcache"], ["serve", path, "--scheduler_cls", "x.Y",
                                               "--no_enable_prefix_caching"])
    assert "--scheduler-cls" not in out and "--no-enable-prefix-caching" not in out
    assert "--kv-transfer-config" in out  # negative control: what was absent is still added


def test_dotted_keys_are_read_and_conflicts_refused(embedded_model, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    path = str(embedded_model("qwen3-next-tiny"))
    with pytest.raises(SystemExit, match="cannot be combined"):
        flags.apply_plugin(["hybridcache"], [
            "serve", path, "--kv-transfer-config.kv_connector", "LMCacheConnectorV1",
            "--kv-transfer-config.kv_role", "kv_both"])
    # ours, with a role of its own: refused, naming the key (never overridden)
    with pytest.raises(SystemExit, match=r"kv_role='kv_producer' \(it needs 'kv_both'\)"):
        flags.apply_plugin(["hybridcache"], [
            "serve", path, "--kv-transfer-config.kv_connector", "HybridSnapshotConnector",
            "--kv-transfer-config.kv_role", "kv_producer"])
    # an explicit vLLM default is a value too: `fail` is not silently turned into `recompute`
    with pytest.raises(SystemExit, match="kv_load_failure_policy='fail'"):
        flags.apply_plugin(["hybridcache"], [
            "serve", path, "--kv-transfer-config",
            '{"kv_connector": "HybridSnapshotConnector", "kv_role": "kv_both", '
            '"kv_load_failure_policy": "fail"}'])
    # ours, partly given: completed, the user's extra config kept
    out = flags.apply_plugin(["hybridcache"], [
        "serve", path, "--kv-transfer-config.kv_connector", "HybridSnapshotConnector",
        "--kv-transfer-config.kv_role", "kv_both",
        "--kv-transfer-config.kv_connector_extra_config.grid", "256"])
    kv = _kv(out)
    assert {k: getattr(kv, k) for k in flags.CONNECTOR_CONFIG} == flags.CONNECTOR_CONFIG
    assert kv.kv_connector_extra_config == {"grid": 256}
    # ours, complete: nothing to add
    full = ["serve", path, "--kv-transfer-config", json.dumps(flags.CONNECTOR_CONFIG)]
    assert "--kv-transfer-config" not in flags.apply_plugin(["hybridcache"], full)[len(full):]


def test_tracked_serve_options_have_no_string_default():
    """`compat.ServeCommand.given` records assignments; argparse converts a string default by
    assignment, which would count as given."""
    from vllm_hybridcache import compat

    serve = compat.parse_vllm_serve(["serve", "m"], flags.TRACKED).parser
    for dest in flags.TRACKED:
        assert not isinstance(serve.get_default(dest), str), dest


# --------------------------------------------------------------------- the real `vllm serve`


@pytest.fixture
def vllm_cli(monkeypatch):
    """vLLM's top-level `vllm` parser with the general plugin's `--plugin` bend installed."""
    from vllm_hybridcache import compat

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    compat.extend_vllm_serve(flags.on_serve, flags.TRACKED, flags.PLUGIN_HELP)
    return compat.serve_cli._vllm_cli_parser()


def test_vllm_serve_takes_plugin_before_the_model(vllm_cli, embedded_model):
    """The issue's command line, `--plugin` right after `serve` (Docker's ENTRYPOINT): vLLM's
    own parser then sees the model where its checks look for it."""
    from vllm_hybridcache import compat

    path = str(embedded_model("qwen3-next-tiny"))
    args = vllm_cli.parse_args(["serve", "--plugin", "hybridcache", path,
                                "--served-model-name", "tiny"])
    assert args.model_tag == path and args.served_model_name == ["tiny"]
    assert args.kv_transfer_config.kv_connector == "HybridSnapshotConnector"
    assert args.scheduler_cls == flags.SCHEDULER_CLS
    assert args.enable_prefix_caching is False and args.enable_prompt_tokens_details is True
    assert not hasattr(args, "plugin")  # vLLM's namespace, nothing of ours left in it
    # negative control: vLLM's parser alone refuses `--plugin` there
    with pytest.raises(ValueError, match="first positional argument"):
        compat.serve_cli._original_parse_args()(vllm_cli, ["serve", "--plugin", "hybridcache", path,
                                                 "--served-model-name", "tiny"])


def test_vllm_serve_without_plugin_is_parsed_exactly_as_by_vllm(vllm_cli, embedded_model):
    from vllm_hybridcache import compat

    argv = ["serve", str(embedded_model("qwen3-next-tiny")), "--port", "8111",
            "--kv-transfer-config.kv_connector", "LMCacheConnectorV1",
            "--kv-transfer-config.kv_role", "kv_both", "--no-enable-prefix-caching"]
    ours = vars(vllm_cli.parse_args(argv))
    theirs = vars(compat.serve_cli._original_parse_args()(vllm_cli, argv))
    ours_kv, theirs_kv = ours.pop("kv_transfer_config"), theirs.pop("kv_transfer_config")
    assert ours == theirs
    assert ours_kv.kv_connector == theirs_kv.kv_connector == "LMCacheConnectorV1"


def test_vllm_serve_refuses_with_a_message_and_status_2(vllm_cli, embedded_model, capsys):
    path = str(embedded_model("qwen3-next-tiny"))
    for argv, reason in (
            (["serve", path, "--plugin", "nope"], "unknown plugin 'nope'; available: hybridcache"),
            (["serve", path, "--plugin"], "--plugin needs a name"),
            (["serve", path, "--plugin", "hybridcache", "--kv-transfer-config",
              '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'],
             "cannot be combined")):
        with pytest.raises(SystemExit) as e:
            vllm_cli.parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("vllm serve: error: ") and reason in err, err
        assert "usage:" not in err  # one line, not vLLM's hundreds of lines of usage


def test_plugin_in_a_yaml_config(vllm_cli, embedded_model, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model: {embedded_model('qwen3-next-tiny')}\nplugin: hybridcache\n")
    args = vllm_cli.parse_args(["serve", "--config", str(cfg)])
    assert args.kv_transfer_config.kv_connector == "HybridSnapshotConnector"
    assert not hasattr(args, "plugin")


def test_vllm_serve_help_shows_the_plugin_option(vllm_cli, capsys, monkeypatch):
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(FlexibleArgumentParser, "_search_keyword", None)
    with pytest.raises(SystemExit) as e:
        vllm_cli.parse_args(["serve", "--plugin", "hybridcache", "--help=hybridcache"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--plugin NAME" in out and "snapshot prefix cache" in out
