"""Which implementation serves Qwen4Exp* (issue 30): ours on CPU and on ROCm RDNA, vLLM's
elsewhere unless asked, never changed by merely installing the package; logged once."""

from __future__ import annotations

import logging

import pytest

from vllm_hybridcache.flash_next import registration
from vllm_hybridcache.flash_next.registration import IMPL_ENV, choose, is_rdna


@pytest.mark.parametrize(("choice", "platform", "arch", "ours"), [
    ("", "cpu", "", True),                    # vLLM's does not run on the CPU platform
    ("vllm", "cpu", "", True),                # ... not even when asked for
    ("", "rocm", "gfx1201", True),            # R9700 (RDNA 4)
    ("auto", "rocm", "gfx1151", True),        # Strix Halo (RDNA 3.5)
    ("", "rocm", "gfx1100", True),            # RDNA 3
    ("", "rocm", "gfx942", False),            # MI300: vLLM's in-tree model runs there
    ("", "rocm", "gfx1250", False),           # a CDNA part despite its name
    ("", "cuda", "", False),                  # datacenter CUDA: vLLM's
    ("hybridcache", "cuda", "", True),        # unless the user asks for ours
    ("vllm", "rocm", "gfx1201", False),       # or for vLLM's
    ("HybridCache ", "rocm", "gfx942", True),  # case and spaces as env values come
])
def test_the_choice_by_platform_and_setting(choice, platform, arch, ours):
    impl = choose(choice, platform, arch)
    assert impl.ours is ours and impl.reason


def test_an_unknown_choice_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="auto, hybridcache, vllm"):
        choose("ours", "cuda", "")


def test_rdna_names():
    assert [a for a in ("gfx1100", "gfx1151", "gfx1200", "gfx1201", "gfx1250", "gfx942",
                        "gfx90a", "")
            if is_rdna(a)] == ["gfx1100", "gfx1151", "gfx1200", "gfx1201"]


def test_this_process_logs_its_choice_once(monkeypatch, caplog):
    """On the installed vLLM (the CPU platform here) ours serves, whatever the setting, and
    the reason is in the log, once per process. The ROCm architecture bend answers "" off
    ROCm."""
    from vllm_hybridcache.compat import rocm_gcn_arch

    assert rocm_gcn_arch() == ""
    monkeypatch.setenv(IMPL_ENV, "vllm")
    registration.implementation.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="vllm_hybridcache"):
            assert registration.use_ours() and registration.use_ours()
        lines = [r.getMessage() for r in caplog.records if "Qwen4Exp" in r.getMessage()]
        assert len(lines) == 1 and "CPU platform" in lines[0] and "cannot apply" in lines[0]
    finally:
        registration.implementation.cache_clear()
