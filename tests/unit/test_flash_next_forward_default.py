"""Flash-Next's split-invariant forward by default where it is the cheaper one
(`split_invariant.plan`, `auto`): an engine running the connector with the cache on, bfloat16,
the CPU backend, a host without a bf16 GEMM of its own (no AVX512-BF16, no AMX) and the
row-invariant kernel built. Each condition is checked by turning it off alone (the negative
controls: every one of them must be able to say no), and `1` / `0` decide alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hybridcache.config import CONNECTOR_NAME, SettingsError
from vllm_hybridcache.flash_next.ops import split_invariant
from vllm_hybridcache.flash_next.ops.split_invariant import ENV_VAR, plan


def engine(dtype=torch.bfloat16, connector: str = CONNECTOR_NAME, extra=None, speculative=None,
           quant=None, tp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector=connector,
                                           kv_connector_extra_config=extra or {}),
        model_config=SimpleNamespace(dtype=dtype), speculative_config=speculative,
        quant_config=quant, parallel_config=SimpleNamespace(tensor_parallel_size=tp))


@pytest.fixture
def qualifying_host(monkeypatch):
    """The host conditions made true, so that each test turns off exactly one."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(split_invariant, "_host_bf16_gemm", lambda: "")
    monkeypatch.setattr(split_invariant, "rowwise_available", lambda: True)


def test_auto_is_on_for_a_bf16_cpu_engine_with_the_cache_on(qualifying_host):
    on, why = plan(engine())
    assert on and why.startswith("auto:")
    assert plan(engine(dtype="bfloat16"))[0]                 # a dtype named as a string


@pytest.mark.parametrize("change, reason", [
    (dict(dtype=torch.float32), "float32"),
    (dict(dtype=torch.float16), "float16"),
    (dict(connector="SomeOtherConnector"), "does not run the hybridcache connector"),
    (dict(extra={"enabled": False}), "cache is off"),
    (dict(extra={"grid": "wide"}), "refused"),
    (dict(speculative=object()), "speculative"),
    (dict(quant=object()), "quantized"),
    (dict(tp=2), "TP > 1"),
])
def test_auto_is_off_where_one_condition_fails(qualifying_host, change, reason):
    on, why = plan(engine(**change))
    assert not on and why.startswith("auto:") and reason in why


def test_auto_is_off_on_a_host_with_its_own_bf16_gemm_or_without_the_kernel(qualifying_host,
                                                                             monkeypatch):
    monkeypatch.setattr(split_invariant, "_host_bf16_gemm", lambda: "the host has AMX")
    assert plan(engine()) == (False, "auto: the host has AMX (torch's bf16 GEMM uses it; "
                                     "rowwise not measured)")
    monkeypatch.setattr(split_invariant, "_host_bf16_gemm", lambda: "")
    monkeypatch.setattr(split_invariant, "rowwise_available", lambda: False)
    on, why = plan(engine())
    assert not on and "did not build" in why


def test_auto_on_an_avx512_bf16_host_follows_the_kernels_bf16_arithmetic(qualifying_host,
                                                                        monkeypatch):
    """AVX512-BF16 (torch's bf16 GEMM uses it): on where the kernel sums bf16 pairs with it
    (measured the cheaper forward on the trace families), off where the build lacks it (the
    widening form does float32's work: 2.1-2.8x torch's bf16 GEMM); AMX, even with
    AVX512-BF16, off (not measured)."""
    monkeypatch.setattr(split_invariant, "_host_bf16_gemm",
                        lambda: split_invariant.AVX512_BF16_HOST)
    monkeypatch.setattr(split_invariant, "_kernel_sums_bf16_pairs", lambda: True)
    on, why = plan(engine())
    assert on and "AVX512-BF16" in why and "pair" in why
    assert not plan(engine(dtype=torch.float32))[0]
    monkeypatch.setattr(split_invariant, "_kernel_sums_bf16_pairs", lambda: False)
    on, why = plan(engine())
    assert not on and "without its bf16 pair arithmetic" in why
    monkeypatch.setattr(split_invariant, "_host_bf16_gemm", lambda: "the host has AMX")
    monkeypatch.setattr(split_invariant, "_kernel_sums_bf16_pairs", lambda: True)
    assert not plan(engine())[0]


def test_the_pair_check_reads_the_built_kernel():
    from vllm_hybridcache.ops import rowwise_linear

    if not rowwise_linear.available():
        pytest.skip("the kernel needs a C++ compiler (make toolchain)")
    assert split_invariant._kernel_sums_bf16_pairs() == (
        "bfloat16:dpbf16" in rowwise_linear.arithmetic())


def test_auto_is_off_off_the_cpu_backend(qualifying_host, monkeypatch):
    monkeypatch.setenv("VLLM_HYBRIDCACHE_FLASH_NEXT_OPS", "triton")
    on, why = plan(engine())
    assert not on and "triton backend" in why


def test_auto_needs_an_engine(qualifying_host):
    assert plan(None) == (False, "auto without an engine config")


def test_one_and_zero_decide_alone(qualifying_host, monkeypatch):
    for value, on in (("1", True), ("true", True), ("0", False), ("false", False)):
        monkeypatch.setenv(ENV_VAR, value)
        assert plan(engine(dtype=torch.float32))[0] is on
        assert plan(engine())[0] is on
        assert plan(None)[0] is on
    monkeypatch.setenv(ENV_VAR, "auto")
    assert plan(engine())[0] and not plan(engine(dtype=torch.float32))[0]
    for bad in ("yes", "2", "rowwise"):
        monkeypatch.setenv(ENV_VAR, bad)
        with pytest.raises(SettingsError, match=ENV_VAR):
            plan(engine())


def test_this_hosts_answer_follows_torchs_own_probes(monkeypatch):
    """The real probes: on a host where torch reports AVX512-BF16 or AMX the answer names it
    (AMX first: an AMX host has AVX512-BF16 too), elsewhere it is empty."""
    probes = (torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported())
    assert (split_invariant._host_bf16_gemm() == "") == (not any(probes))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert split_invariant._host_bf16_gemm() == "the host has AMX"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert split_invariant._host_bf16_gemm() == split_invariant.AVX512_BF16_HOST
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert "cannot tell" in split_invariant._host_bf16_gemm()
