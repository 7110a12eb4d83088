"""compat: the version guard, and every vLLM-bending function exercised on the installed vLLM.

These run in the test process without an engine: each function is called on the real vLLM
classes it reaches into, so a vLLM upgrade that moves one of them fails here first.
"""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from vllm_hybridcache import compat
from vllm_hybridcache.config import ALLOW_UNSUPPORTED_VLLM_ENV


@pytest.fixture(autouse=True)
def _plugins_env(monkeypatch):
    """`enable_endpoint_plugin` sets VLLM_PLUGINS in this process's environment: undo it after
    each test (a `delenv` of an absent name alone records nothing to restore)."""
    monkeypatch.setenv("VLLM_PLUGINS", "")
    monkeypatch.delenv("VLLM_PLUGINS")


@pytest.fixture
def fake_vllm_version(monkeypatch):
    """Pretend the installed vLLM is `version` (and forget any version already accepted)."""

    def set_version(version: str | None) -> None:
        monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)
        monkeypatch.setattr(compat, "_version_ok", None)

    monkeypatch.delenv(ALLOW_UNSUPPORTED_VLLM_ENV, raising=False)
    yield set_version


# --------------------------------------------------------------------- version guard


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.32.1", "0.33.0rc1", "0.32.0rc1"])
def test_guard_refuses_an_unsupported_version_naming_the_supported_ones(version):
    with pytest.raises(compat.UnsupportedVllmError) as e:
        compat.check_vllm_version(version, environ={})
    msg = str(e.value)
    assert f"found vLLM {version}" in msg
    assert "supports vLLM 0.32.0, 0.33.0" in msg and ALLOW_UNSUPPORTED_VLLM_ENV in msg


def test_guard_refuses_a_missing_vllm():
    with pytest.raises(compat.UnsupportedVllmError, match="found no vLLM"):
        compat.check_vllm_version(None, environ={})


def test_guard_accepts_supported_builds_with_a_local_suffix():
    assert compat.check_vllm_version("0.32.0+cpu", environ={}) == "0.32.0+cpu"
    assert compat.check_vllm_version("0.32.0", environ={}) == "0.32.0"


def test_override_starts_an_unsupported_version_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_hybridcache"):
        assert compat.check_vllm_version(
            "0.99.0", environ={ALLOW_UNSUPPORTED_VLLM_ENV: "1"}) == "0.99.0"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "0.99.0" in warnings[0].getMessage()
    assert "install_prefill_split" in warnings[0].getMessage()  # names what may break
    with pytest.raises(compat.UnsupportedVllmError):  # only "1" forces it
        compat.check_vllm_version("0.99.0", environ={ALLOW_UNSUPPORTED_VLLM_ENV: "yes"})


def test_installed_vllm_is_supported():
    assert compat.installed_vllm_version().split("+")[0] in compat.SUPPORTED_VLLM
    assert compat.require_supported_vllm()


def test_the_general_plugin_stays_inactive_on_an_unsupported_vllm(fake_vllm_version,
                                                                  monkeypatch, caplog):
    """Defect: the plugin raised on any vLLM but 0.32.0, and vLLM calls general plugins without
    catching their errors, in every process: `pip install -U vllm` broke every `vllm serve`.
    Now it registers only what is safe on any vLLM, says so once, and does not raise."""
    from vllm_hybridcache import plugin, registrations

    calls: list[str] = []
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "active", None)
    monkeypatch.setattr(registrations, "register_all", lambda: calls.append("all"))
    monkeypatch.setattr(registrations, "register_safe",
                        lambda strict: calls.append(f"safe:{strict}"))
    fake_vllm_version("0.31.0")
    with caplog.at_level(logging.DEBUG, logger="vllm_hybridcache"):
        plugin.register()
        plugin.register()  # once per process
    assert calls == ["safe:False"] and plugin._registered and plugin.active is False
    said = [r.getMessage() for r in caplog.records if "not a version this plugin" in
            r.getMessage()]
    assert len(said) == 1 and "vLLM 0.31.0" in said[0] and "0.32.0" in said[0]
    # negative control: a supported vLLM gets everything, and its errors raise
    monkeypatch.setattr(plugin, "_registered", False)
    fake_vllm_version("0.32.0")
    plugin.register()
    assert calls[1:] == ["safe:True", "all"] and plugin.active is True
    # forced on: everything too (the guard warns)
    monkeypatch.setattr(plugin, "_registered", False)
    fake_vllm_version("0.31.0")
    monkeypatch.setenv(ALLOW_UNSUPPORTED_VLLM_ENV, "1")
    monkeypatch.setattr(compat, "route_logs_through_vllm", lambda: False)
    plugin.register()
    assert calls[3:] == ["safe:True", "all"]


def test_the_inactive_line_is_info_where_vllm_logs_already(fake_vllm_version, monkeypatch,
                                                           caplog):
    """vLLM's CLI process sets its logging up only after parsing (dropping what came before);
    its engine and worker processes have it when plugins load: the line is info there."""
    from vllm_hybridcache import plugin

    fake_vllm_version("0.31.0")
    vllm_logger = logging.getLogger("vllm")
    for handlers, level in (([], logging.DEBUG), ([logging.NullHandler()], logging.INFO)):
        monkeypatch.setattr(vllm_logger, "handlers", handlers)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="vllm_hybridcache"):
            plugin._say_inactive()
        assert [r.levelno for r in caplog.records] == [level]


def test_register_safe_installs_exactly_the_safe_bends(monkeypatch):
    from vllm_hybridcache import registrations

    called: list[str] = []
    for name in compat.SAFE_ON_ANY_VLLM:
        assert name in compat.BENDS, name
        monkeypatch.setattr(compat, name, lambda *a, name=name, **k: called.append(name))
    registrations.register_safe(strict=True)
    assert called == list(compat.SAFE_ON_ANY_VLLM)


def test_a_failing_safe_bend_stops_only_a_supported_vllm(monkeypatch):
    """On an unsupported vLLM nothing of ours may stop vLLM; on a supported one errors show."""
    from vllm_hybridcache import registrations

    def broken(*args, **kwargs):
        raise RuntimeError("FlexibleArgumentParser changed")

    monkeypatch.setattr(compat, "extend_vllm_serve", broken)
    monkeypatch.setattr(registrations, "REGISTERED", [])
    registrations.register_safe(strict=False)
    assert "serve-flag:--plugin" not in registrations.REGISTERED
    assert "metadata-alias" in registrations.REGISTERED  # the others still went in
    with pytest.raises(RuntimeError, match="FlexibleArgumentParser changed"):
        registrations.register_safe(strict=True)


def test_asking_for_the_cache_refuses_an_unsupported_vllm(fake_vllm_version, tmp_path, capsys):
    """`vllm serve --plugin hybridcache` on an unsupported vLLM: the guard's message, status 2,
    before anything starts."""
    from transformers import LlamaConfig

    from vllm_hybridcache.serving import flags

    LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                num_attention_heads=2, vocab_size=100).save_pretrained(tmp_path)
    argv = ["serve", str(tmp_path), "--plugin", "hybridcache"]
    fake_vllm_version("0.40.0")
    with pytest.raises(SystemExit) as e:
        flags.on_serve(compat.parse_vllm_serve(argv, flags.TRACKED))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert ("vllm serve: error: vllm-hybridcache supports vLLM 0.32.0, 0.33.0; found vLLM "
            "0.40.0") in err
    # negative control: on a supported vLLM the same command line goes on (a non-hybrid model)
    fake_vllm_version("0.32.0")
    flags.on_serve(compat.parse_vllm_serve(argv, flags.TRACKED))
    assert "not a hybrid model" in capsys.readouterr().out


def test_the_vllm_cli_on_an_unsupported_vllm(tmp_path):
    """In a fresh process, through vLLM's own CLI and plugin loading: an unsupported vLLM's
    `vllm` works and the plugin registers nothing version-sensitive; `--plugin hybridcache`
    and an import of the scheduler class (vLLM's `--scheduler-cls`) or of the connector
    refuse it with the guard's message."""
    code = textwrap.dedent("""
        from vllm_hybridcache import compat
        compat.installed_vllm_version = lambda: "0.40.0"
        from vllm_hybridcache.cli.vllm_entry import main
        print("VERSION", main(["vllm", "--version"]))
        print("PLUGIN", main(["vllm", "serve", "some-model", "--plugin", "hybridcache"]))
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.model_executor.models import config
        from vllm_hybridcache import plugin, registrations
        hooks = [a for a, c in config.MODELS_CONFIG_MAP.items()
                 if hasattr(c, "_hybridcache_after")]
        print("STATE", plugin.active, "HybridSnapshotConnector" in KVConnectorFactory._registry,
              hooks, ",".join(registrations.REGISTERED))
        for module in ("vllm_hybridcache.adapter.scheduler", "vllm_hybridcache.adapter.connector"):
            try:
                __import__(module)
            except compat.UnsupportedVllmError as e:
                print("REFUSED", module, e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert out.stdout.lstrip().startswith("0.32.0") and "VERSION 0" in out.stdout
    assert "PLUGIN 2" in out.stdout
    assert ("vllm serve: error: vllm-hybridcache supports vLLM 0.32.0, 0.33.0; found vLLM "
            "0.40.0") in text
    assert "STATE False False [] metadata-alias,logs,serve-flag:--plugin" in out.stdout
    for module in ("scheduler", "connector"):
        assert f"REFUSED vllm_hybridcache.adapter.{module} vllm-hybridcache supports" in text


def test_every_entry_that_loads_settings_refuses_an_unsupported_vllm(fake_vllm_version):
    """`llm_kwargs` refuses before it loads settings (the connector module and the serve
    flag hook refuse at import and parse, tested above); the settings loader itself is a pure
    parse that never looks at vLLM, so config stays below compat (issue 31: no import cycle)."""
    from vllm_hybridcache.config import load_settings
    from vllm_hybridcache.serving.python_api import llm_kwargs

    fake_vllm_version("0.30.0")
    with pytest.raises(compat.UnsupportedVllmError):
        llm_kwargs()
    load_settings()  # reads the real environment, asks nothing of vLLM
    load_settings(environ={})


def test_every_bend_was_checked_on_the_supported_versions():
    assert compat.BENDS, "compat records nothing"
    for name, versions in compat.BENDS.items():
        assert callable(getattr(compat, name)), name
        assert set(compat.SUPPORTED_VLLM) <= set(versions), (name, versions)


def test_every_bend_is_exercised_by_a_test():
    """A new compat function comes with a test that calls it on the installed vLLM."""
    from pathlib import Path

    tests = Path(__file__).parents[1]
    text = "\n".join(p.read_text(encoding="utf-8") for p in tests.rglob("test_*.py"))
    untested = [name for name in compat.BENDS if f"{name}(" not in text]
    assert not untested, f"compat functions no test calls: {untested}"


# --------------------------------------------------------------------- registration


def test_connector_registration_passes_only_when_already_registered(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    assert compat.register_kv_connector("HybridTestConnector", "x.y", "Z") is True
    assert "HybridTestConnector" in KVConnectorFactory._registry
    assert compat.register_kv_connector("HybridTestConnector", "x.y", "Z") is False


def test_other_connector_registration_errors_surface(monkeypatch):
    """Defect: registrations swallowed every ValueError of vLLM's factory."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_hybridcache import registrations

    def broken(cls, name, module_path, class_name):
        raise ValueError("connector name must be a valid identifier")

    monkeypatch.setattr(KVConnectorFactory, "_registry", {})
    monkeypatch.setattr(KVConnectorFactory, "register_connector", classmethod(broken))
    with pytest.raises(ValueError, match="valid identifier"):
        registrations._register_connector()


def test_a_failed_registration_is_not_remembered_as_done(monkeypatch):
    """Defect: `_registered` was set before registering, so a retry silently did nothing."""
    from vllm_hybridcache import plugin, registrations

    def boom() -> None:
        raise ValueError("bad registration")

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(compat, "route_logs_through_vllm", lambda: False)
    monkeypatch.setattr(registrations, "register_all", boom)
    for _ in range(2):
        with pytest.raises(ValueError, match="bad registration"):
            plugin.register()


# --------------------------------------------------------------------- scheduler hook


def test_vllm_scheduler_still_consults_the_split_hook_in_both_paths():
    from vllm.v1.core.sched.scheduler import Scheduler

    src = inspect.getsource(Scheduler.schedule)
    assert src.count("if self.need_mamba_block_aligned_split:") == 2
    assert src.count("self._mamba_block_aligned_split(") == 2
    params = list(inspect.signature(Scheduler._mamba_block_aligned_split).parameters)
    assert params == ["self", "request", "num_new_tokens", "num_new_local_computed_tokens",
                      "num_external_computed_tokens"]


def test_install_prefill_split_wraps_the_real_scheduler_hook():
    from vllm.v1.core.sched.scheduler import Scheduler

    sched = Scheduler.__new__(Scheduler)  # the hook's class, without an engine
    sched.need_mamba_block_aligned_split = False
    seen: list[tuple] = []

    def split(request, n, local, external):
        seen.append((n, local, external))
        return None if request.fallback else 3

    compat.install_prefill_split(sched, split)
    assert sched.need_mamba_block_aligned_split is True
    assert sched._mamba_block_aligned_split(SimpleNamespace(fallback=False), 100, 1, 2) == 3
    # None: vLLM's own clipping, which returns the tokens unchanged once the prefill is done
    done = SimpleNamespace(fallback=True, num_computed_tokens=10, num_prompt_tokens=5,
                           num_tokens=6)
    assert sched._mamba_block_aligned_split(done, 7) == 7
    assert seen == [(100, 1, 2), (7, 0, 0)]


def test_install_prefill_split_fails_loudly_without_the_hook():
    with pytest.raises(RuntimeError, match="_mamba_block_aligned_split"):
        compat.install_prefill_split(SimpleNamespace(), lambda *a: None)


def test_scheduler_has_recurrent_layers():
    assert compat.scheduler_has_recurrent_layers(SimpleNamespace(has_mamba_layers=True))
    assert not compat.scheduler_has_recurrent_layers(SimpleNamespace(has_mamba_layers=False))


# --------------------------------------------------------------------- model layers


def test_forward_layer_registration_on_a_real_compilation_config():
    from vllm.config import CompilationConfig

    cfg = SimpleNamespace(compilation_config=CompilationConfig())
    layer = object()
    compat.register_forward_layer(cfg, "model.layers.0.mixer", layer)
    assert compat.forward_layers(cfg)["model.layers.0.mixer"] is layer
    with pytest.raises(ValueError, match="Duplicate layer name"):
        compat.register_forward_layer(cfg, "model.layers.0.mixer", object())


def test_layer_attn_metadata_inside_and_outside_a_forward():
    from vllm.forward_context import ForwardContext, override_forward_context

    assert compat.layer_attn_metadata("l0") is None  # no forward running
    meta = object()
    ctx = ForwardContext(no_compile_layers={}, attn_metadata={"l0": meta}, slot_mapping={})
    with override_forward_context(ctx):
        assert compat.layer_attn_metadata("l0") is meta
        assert compat.layer_attn_metadata("l1") is None
    micro = ForwardContext(no_compile_layers={}, attn_metadata=[{"l0": meta}], slot_mapping=[])
    with override_forward_context(micro):
        assert compat.layer_attn_metadata("l0") is None


def _cpu_build() -> bool:
    """vLLM's CPU build is in use (by platform: once the plugin's metadata alias is installed,
    the distribution answers to the name `vllm` as well, so its name cannot tell)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def test_vllm_cpu_gdn_prefill_is_found_on_the_cpu_build():
    kernel = compat.vllm_cpu_gdn_prefill()
    if _cpu_build():
        assert callable(kernel)  # tests/flash_next/test_ops.py checks its numbers
    else:
        pytest.skip("not the vllm-cpu build")


def test_vllm_cpu_linear_matches_torch():
    import torch

    if not _cpu_build():
        pytest.skip("vLLM's CPU GEMM dispatch needs the vllm-cpu build")
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    forward = compat.vllm_cpu_linear(layer)
    torch.testing.assert_close(forward(x).float(), expected.float(), atol=3e-2, rtol=3e-2)


# --------------------------------------------------------------------- engine reaches


def test_inproc_scheduler_connector_reaches_the_scheduler():
    connector = object()
    scheduler = SimpleNamespace(get_kv_connector=lambda: connector)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(
        engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler))))
    assert compat.inproc_scheduler_connector(llm) is connector
    remote = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace()))
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        compat.inproc_scheduler_connector(remote)


def test_vllm_in_process_client_holds_the_engine_core():
    """The attribute `inproc_scheduler_connector` follows exists on vLLM's in-process client."""
    from vllm.v1.core.sched.interface import SchedulerInterface
    from vllm.v1.engine.core_client import InprocClient

    assert "self.engine_core = EngineCore(" in inspect.getsource(InprocClient.__init__)
    assert hasattr(SchedulerInterface, "get_kv_connector")


def test_worker_connector_is_the_kv_transfer_group(monkeypatch):
    from vllm.distributed.kv_transfer import kv_transfer_state

    agent = object()
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", agent)
    assert compat.worker_connector() is agent


def test_call_connector_utility_uses_the_clients_call_all_path():
    import asyncio

    from vllm.v1.engine.core_client import AsyncMPClient

    assert inspect.iscoroutinefunction(AsyncMPClient.call_utility_all_async)
    calls: list[tuple] = []

    async def call_all(name, *args):
        calls.append((name, *args))
        return [{"cleared": 1}, {"cleared": 2}]

    client = SimpleNamespace(engine_core=SimpleNamespace(call_utility_all_async=call_all))
    got = asyncio.run(compat.call_connector_utility(client, "hc_clear", {"tier": "ram"}))
    assert got == [{"cleared": 1}, {"cleared": 2}] and calls == [("hc_clear", {"tier": "ram"})]
    with pytest.raises(NotImplementedError):
        asyncio.run(compat.call_connector_utility(SimpleNamespace(), "hc_clear", {}))


# --------------------------------------------------------------------- process set-up


def test_metadata_alias_answers_for_vllm():
    from importlib import metadata

    compat.install_vllm_metadata_alias()
    assert compat.install_vllm_metadata_alias() in (True, False)  # idempotent
    version = metadata.version("vllm")
    assert version.split("+")[0] in compat.SUPPORTED_VLLM
    if compat.vllm_distribution_name() == "vllm-cpu":
        assert version.endswith("+cpu")  # keeps vLLM's platform detection on CPU


def test_run_vllm_cli_hands_argv_to_vllm(monkeypatch, capsys):
    import sys

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    compat.install_vllm_metadata_alias()
    try:
        rc = compat.run_vllm_cli(["vllm", "--version"])
    except SystemExit as e:  # argparse's version action
        rc = int(e.code or 0)
    assert rc == 0
    assert capsys.readouterr().out.strip().startswith("0.32.0")
    assert sys.argv == ["vllm", "--version"]


def test_enable_endpoint_plugin_keeps_every_installed_plugin(monkeypatch):
    from importlib import metadata

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    value = compat.enable_endpoint_plugin("hybridcache_http", always=("hybridcache",))
    names = set(value.split(","))
    installed = {ep.name for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert installed <= names and {"hybridcache", "hybridcache_http"} <= names
    monkeypatch.setenv("VLLM_PLUGINS", "other, hybridcache")
    assert compat.enable_endpoint_plugin("hybridcache_http") == "hybridcache,hybridcache_http,other"


def test_vllm_plugins_is_what_gates_endpoint_plugins():
    """The behaviour `enable_endpoint_plugin` relies on: no VLLM_PLUGINS, no endpoint plugin."""
    from vllm.plugins import load_endpoint_plugins

    src = inspect.getsource(load_endpoint_plugins)
    assert "VLLM_PLUGINS" in src


def test_plugin_logs_print_through_vllms_handlers(monkeypatch):
    """Routed records reach vLLM's handlers, whenever vLLM configures them."""
    name = "vllm_hybridcache.test_route"
    ours = logging.getLogger(name)
    got: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [])
    root_handlers = list(logging.getLogger().handlers)  # pytest's capture: absent in a server
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    try:
        assert compat.route_logs_through_vllm(name) is True
        assert compat.route_logs_through_vllm(name) is False  # idempotent
        assert ours.level == logging.INFO
        ours.info("before vLLM configured logging")  # dropped, as without the plugin
        vllm_logger.handlers = [Collect(level=logging.INFO)]  # vLLM's dictConfig, later
        ours.info("settings read")
        ours.debug("too detailed")
        assert got == ["settings read"]
        child = logging.getLogger(name + ".child")  # a routed parent does not print it twice
        compat.route_logs_through_vllm(child.name)
        child.info("once")
        assert got == ["settings read", "once"]
        logging.getLogger().handlers = root_handlers  # the root prints it: we stay out
        ours.info("printed by the root's handlers")
        assert got == ["settings read", "once"]
    finally:
        for logger in (ours, logging.getLogger(name + ".child")):
            logger.handlers.clear()
            logger.setLevel(logging.NOTSET)


def test_enable_endpoint_plugin_keeps_platform_and_io_processor_plugins(monkeypatch):
    """Defect: only general and stat-logger plugins were listed, so once VLLM_PLUGINS was set an
    out-of-tree platform plugin stopped loading in the engine processes vLLM spawns."""
    from importlib.metadata import EntryPoint

    real = compat.metadata.entry_points
    extra = {"vllm.platform_plugins": [EntryPoint("oot_platform", "x:y", "vllm.platform_plugins")],
             "vllm.io_processor_plugins": [EntryPoint("oot_io", "x:z",
                                                      "vllm.io_processor_plugins")]}

    def entry_points(group: str):
        return [*real(group=group), *extra.get(group, [])]

    monkeypatch.setattr(compat.metadata, "entry_points", entry_points)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    names = set(compat.enable_endpoint_plugin("hybridcache_http").split(","))
    assert {"oot_platform", "oot_io", "hybridcache_http"} <= names
    monkeypatch.setenv("VLLM_PLUGINS", "mine")  # a list the user set is kept as it is
    assert compat.enable_endpoint_plugin("hybridcache_http") == "hybridcache_http,mine"


def test_vllm_filters_exactly_these_plugin_groups_by_vllm_plugins():
    """The groups `enable_endpoint_plugin` lists are every group vLLM loads through its
    VLLM_PLUGINS filter (`load_plugins_by_group`), the endpoint group aside."""
    import re
    from pathlib import Path

    import vllm
    import vllm.plugins as plugins

    root = Path(vllm.__file__).parent
    used = set()
    for path in root.rglob("*.py"):
        for const in re.findall(r"load_plugins_by_group\(\s*(?:group=)?([A-Z_]+)",
                                path.read_text(encoding="utf-8", errors="replace")):
            used.add(getattr(plugins, const))
    assert used - {plugins.ENDPOINT_PLUGINS_GROUP} == set(compat.VLLM_PLUGINS_FILTERED_GROUPS)


def test_the_platform_probe_installs_the_alias_and_never_claims_a_platform(monkeypatch):
    """`plugin.probe_platform` (vllm.platform_plugins) runs before vLLM's CLI reads the `vllm`
    metadata; it must return None (no platform) and never raise, even when the alias fails."""
    from vllm_hybridcache import plugin

    called: list[bool] = []
    monkeypatch.setattr(compat, "install_vllm_metadata_alias", lambda: called.append(True))
    assert plugin.probe_platform() is None and called == [True]

    def broken() -> bool:
        raise RuntimeError("importlib.metadata changed")

    monkeypatch.setattr(compat, "install_vllm_metadata_alias", broken)
    assert plugin.probe_platform() is None


def test_vllm_reads_platform_plugins_before_its_cli_reads_the_vllm_metadata():
    """Why the alias is installed by a platform probe: vLLM's `main()` resolves the platform
    (importing its sub-commands) before `importlib.metadata.version("vllm")`, and catches a
    probe's errors. Checked in the installed vLLM's own process."""
    code = textwrap.dedent("""
        import vllm.platforms as platforms
        from vllm.entrypoints.cli import main  # noqa: F401
        import vllm.entrypoints.cli.serve  # noqa: F401  (what main() imports first)
        import vllm.plugins as plugins
        print("RESOLVED", platforms._current_platform is not None, plugins.plugins_loaded)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESOLVED True False" in out.stdout  # platform resolved, no general plugin yet
