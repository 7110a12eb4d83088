"""The plugin loads through vLLM's entry point in a fresh process, idempotently and cheaply."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_entry_point_loads_twice_in_a_fresh_process():
    code = textwrap.dedent("""
        import sys, time
        from importlib.metadata import entry_points
        eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "hybridcache"]
        assert len(eps) == 1, eps
        fn = eps[0].load()
        t0 = time.perf_counter(); fn(); first = time.perf_counter() - t0
        fn()
        from vllm_hybridcache import registrations
        regs = list(registrations.REGISTERED)
        fn()
        assert registrations.REGISTERED == regs, "second call registered again"
        from vllm import ModelRegistry
        assert "Qwen4ExpForCausalLM" in ModelRegistry.get_supported_archs()
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        assert "HybridSnapshotConnector" in KVConnectorFactory._registry
        import importlib.metadata as md
        assert md.version("vllm").startswith("0.32")
        print("OK", len(regs), round(first, 3))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout


def test_vllm_loads_our_plugin_through_its_own_loader():
    code = textwrap.dedent("""
        from vllm.plugins import load_general_plugins
        load_general_plugins(); load_general_plugins()
        from vllm_hybridcache import plugin
        assert plugin._registered
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout


def test_vllm_cli_reports_its_version():
    out = subprocess.run([sys.executable, "-m", "vllm_hybridcache.cli.vllm_entry", "--version"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().startswith("0.32.0")
