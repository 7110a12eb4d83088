"""Engine fingerprints: weights by content (not path), every field changes the digest."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from vllm_hybridcache.adapter import fingerprint
from vllm_hybridcache.adapter.fingerprint import (
    cpu_isa,
    make_fingerprint,
    weights_digest,
)


def _checkpoint(path, payload: bytes = b"weights-1"):
    path.mkdir()
    (path / "model.safetensors").write_bytes(payload)
    (path / "config.json").write_text('{"hidden_size": 8}')
    (path / "tokenizer.json").write_text("{}")  # not part of the state: ignored
    return path


def test_same_content_under_another_path_agrees(tmp_path):
    a = _checkpoint(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert weights_digest(a) == weights_digest(b)


def test_new_weights_under_the_old_path_differ(tmp_path):
    a = _checkpoint(tmp_path / "a")
    before = weights_digest(a)
    (a / "model.safetensors").write_bytes(b"weights-2")
    assert weights_digest(a) != before
    (a / "model.safetensors").write_bytes(b"weights-1")
    assert weights_digest(a) == before
    (a / "config.json").write_text('{"hidden_size": 16}')
    assert weights_digest(a) != before
    (a / "config.json").write_text('{"hidden_size": 8}')
    (a / "tokenizer.json").write_text('{"x": 1}')
    assert weights_digest(a) == before


def test_memo_skips_rehashing_but_never_hides_a_change(tmp_path):
    a = _checkpoint(tmp_path / "a")
    memo = tmp_path / "memo.json"
    first = weights_digest(a, memo)
    data = json.loads(memo.read_text())
    assert len(data) == 2
    # a memo with a wrong digest for an unchanged stamp is what a hit looks like: it is used
    key = next(k for k in data if k.endswith("model.safetensors"))
    data[key]["sha256"] = "0" * 64
    memo.write_text(json.dumps(data))
    fingerprint._PROCESS_MEMO.clear()  # a new process: only the memo file remembers
    assert weights_digest(a, memo) != first  # proves the memo was read
    # a changed file (new size/mtime) is hashed again whatever the memo says
    (a / "model.safetensors").write_bytes(b"weights-1 but longer")
    st = (a / "model.safetensors").stat()
    os.utime(a / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    fresh = weights_digest(a)
    assert weights_digest(a, memo) == fresh
    memo.write_text("not json")
    assert weights_digest(a, memo) == fresh


def test_a_folder_without_weights_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        weights_digest(tmp_path / "empty")


def test_every_field_changes_the_digest():
    base = {"weights": "sha256:x", "dtype": "bfloat16", "device": "x86_64:AVX512:avx2",
            "segmentation": "grid=2048"}
    fp = make_fingerprint(base)
    assert make_fingerprint(dict(base)).digest == fp.digest
    for k in base:
        other = make_fingerprint({**base, k: base[k] + "!"})
        assert other.digest != fp.digest
        assert fp.differences(other) == [k]


def test_cpu_isa_names_the_machine():
    isa = cpu_isa()
    assert isa.split(":")[0]  # architecture
    assert isa == cpu_isa()


def test_engine_fingerprint_from_a_vllm_config(tmp_path):
    from types import SimpleNamespace

    from vllm_hybridcache.adapter.fingerprint import engine_fingerprint

    a = _checkpoint(tmp_path / "a")

    def config(model: str, dtype: str = "bfloat16"):
        return SimpleNamespace(
            model_config=SimpleNamespace(model=model, revision=None, dtype=dtype),
            cache_config=SimpleNamespace(cache_dtype="auto", mamba_ssm_cache_dtype="auto"))

    fp = engine_fingerprint(config(str(a)), "layout1", "grid=2048", "cpu")
    assert fp.fields["weights"].startswith("sha256:")
    shutil.copytree(a, tmp_path / "b")
    assert engine_fingerprint(config(str(tmp_path / "b")), "layout1", "grid=2048",
                              "cpu").digest == fp.digest
    assert engine_fingerprint(config(str(a), "float32"), "layout1", "grid=2048",
                              "cpu").differences(fp) == ["dtype"]
    assert engine_fingerprint(config(str(a)), "layout1", "grid=512",
                              "cpu").differences(fp) == ["segmentation"]
    # a checkpoint that cannot be found has no fingerprint, never one by its name
    with pytest.raises(fingerprint.FingerprintUnavailable, match="no/such-model"):
        engine_fingerprint(config("no/such-model"), "layout1", "grid=2048", "cpu")


def test_engines_with_other_draft_settings_share_no_files(tmp_path):
    """The number of draft tokens (and the drafter path) shapes the draft head's and the verify
    step's batches: an engine with k=1 must not read the files of one with k=2."""
    from types import SimpleNamespace

    from vllm_hybridcache.adapter.fingerprint import engine_fingerprint

    a = _checkpoint(tmp_path / "a")

    def config(k: int | None, padded: bool = True):
        spec = None if k is None else SimpleNamespace(
            method="mtp", num_speculative_tokens=k, disable_padded_drafter_batch=not padded)
        return SimpleNamespace(
            model_config=SimpleNamespace(model=str(a), revision=None, dtype="float32"),
            cache_config=SimpleNamespace(cache_dtype="auto", mamba_ssm_cache_dtype="auto"),
            speculative_config=spec)

    fps = [engine_fingerprint(config(k, p), "l", "grid=2048", "cpu")
           for k, p in ((None, True), (1, True), (2, True), (2, False))]
    assert fps[0].fields["speculative"] == ""
    assert len({fp.digest for fp in fps}) == 4
    assert fps[1].differences(fps[2]) == ["speculative"]
    assert engine_fingerprint(config(2), "l", "grid=2048", "cpu").digest == fps[2].digest


def test_kernel_backend_names_the_split_invariant_forward(monkeypatch):
    """Flash-Next's split-invariant forward changes the arithmetic: engines that differ only in
    that switch must not share link files."""
    from types import SimpleNamespace

    from vllm_hybridcache.adapter.fingerprint import kernel_backend
    from vllm_hybridcache.config import FLASH_NEXT_SPLIT_INVARIANT_ENV

    cfg = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))
    monkeypatch.delenv(FLASH_NEXT_SPLIT_INVARIANT_ENV, raising=False)
    off = kernel_backend(cfg)
    monkeypatch.setenv(FLASH_NEXT_SPLIT_INVARIANT_ENV, "1")
    on = kernel_backend(cfg)
    monkeypatch.setenv(FLASH_NEXT_SPLIT_INVARIANT_ENV, "true")
    assert on != off and kernel_backend(cfg) == on


def test_kernel_backend_names_the_split_invariant_form(monkeypatch):
    """The split-invariant forward's two CPU forms (the row-invariant kernel, 64-row tiles)
    give other bits: engines that differ only in the form must not share link files."""
    from types import SimpleNamespace

    from vllm_hybridcache.adapter.fingerprint import kernel_backend
    from vllm_hybridcache.config import FLASH_NEXT_SPLIT_INVARIANT_ENV
    from vllm_hybridcache.flash_next.ops import split_invariant

    cfg = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))
    monkeypatch.setenv(FLASH_NEXT_SPLIT_INVARIANT_ENV, "1")
    monkeypatch.setattr(split_invariant, "rowwise_available", lambda: True)
    rowwise = kernel_backend(cfg)
    monkeypatch.setattr(split_invariant, "rowwise_available", lambda: False)
    tiles = kernel_backend(cfg)
    assert "flash_next_invariant_form=rowwise" in rowwise
    assert "flash_next_invariant_form=tiles" in tiles


def test_kernel_backend_names_the_rowwise_arithmetic(monkeypatch):
    """The row-invariant kernel's sums differ by build (lane count, bf16 pairs on an
    AVX512-BF16 host): two engines whose kernels add differently must not share link files
    (negative control: the same arithmetic gives the same fingerprint)."""
    from types import SimpleNamespace

    from vllm_hybridcache.adapter.fingerprint import kernel_backend
    from vllm_hybridcache.config import FLASH_NEXT_SPLIT_INVARIANT_ENV
    from vllm_hybridcache.flash_next.ops import split_invariant
    from vllm_hybridcache.ops import rowwise_linear

    cfg = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))
    monkeypatch.setenv(FLASH_NEXT_SPLIT_INVARIANT_ENV, "1")
    monkeypatch.setattr(split_invariant, "rowwise_available", lambda: True)
    monkeypatch.setattr(rowwise_linear, "available", lambda: True)
    monkeypatch.setattr(rowwise_linear, "arithmetic", lambda: "float32:fma16;bfloat16:fma16")
    fma = kernel_backend(cfg)
    assert kernel_backend(cfg) == fma
    monkeypatch.setattr(rowwise_linear, "arithmetic",
                        lambda: "float32:fma16;bfloat16:dpbf16x16")
    pairs = kernel_backend(cfg)
    assert pairs != fma and "rowwise_arithmetic=float32:fma16;bfloat16:dpbf16x16" in pairs


def test_kernel_backend_names_the_default_forward_for_flash_next_only(monkeypatch,
                                                                      embedded_model):
    """`auto` (the default) turns the split-invariant forward on in a bf16 Flash-Next engine
    running the connector on a qualifying host: its fingerprint names it, so its links never
    meet those of an engine in step mode (a float32 one here); a Qwen3-Next engine with the
    same settings does not run that forward and is not renamed by it."""
    from types import SimpleNamespace

    from vllm.config import ModelConfig

    from vllm_hybridcache.adapter.fingerprint import kernel_backend
    from vllm_hybridcache.config import CONNECTOR_NAME, FLASH_NEXT_SPLIT_INVARIANT_ENV
    from vllm_hybridcache.flash_next import registration
    from vllm_hybridcache.flash_next.ops import split_invariant

    registration.register()
    monkeypatch.delenv(FLASH_NEXT_SPLIT_INVARIANT_ENV, raising=False)
    monkeypatch.setattr(split_invariant, "_host_bf16_gemm", lambda: "")
    monkeypatch.setattr(split_invariant, "rowwise_available", lambda: True)

    def cfg(name: str, dtype: str) -> SimpleNamespace:
        mc = ModelConfig(model=str(embedded_model(name)), max_model_len=512, dtype=dtype)
        return SimpleNamespace(
            device_config=SimpleNamespace(device_type="cpu"), model_config=mc,
            kv_transfer_config=SimpleNamespace(kv_connector=CONNECTOR_NAME,
                                               kv_connector_extra_config={}),
            speculative_config=None, quant_config=None,
            parallel_config=SimpleNamespace(tensor_parallel_size=1))

    on = kernel_backend(cfg("flash-next-tiny", "bfloat16"))
    step = kernel_backend(cfg("flash-next-tiny", "float32"))
    assert "flash_next_split_invariant=1;flash_next_invariant_form=rowwise" in on
    assert "flash_next_split_invariant=0" in step
    assert "flash_next_split_invariant=0" in kernel_backend(cfg("qwen3-next-tiny", "bfloat16"))


def test_a_memo_in_the_cache_folder_is_used_only_with_its_mac(tmp_path):
    """The memo lives in disk_dir: with the disk key it carries a MAC, and a memo edited to
    give a file another digest (what would give a changed checkpoint its predecessor's
    fingerprint) is ignored, the file hashed again; the same edit without a key is believed
    (the negative control: the unkeyed memo of the test above)."""
    from tests.keys import TEST_KEY, other_key

    a = _checkpoint(tmp_path / "a")
    memo = tmp_path / "memo.json"
    first = weights_digest(a, memo, TEST_KEY)
    stored = json.loads(memo.read_text())
    assert set(stored) == {"files", "alg", "mac"} and (memo.stat().st_mode & 0o777) == 0o600
    key = next(k for k in stored["files"] if k.endswith("model.safetensors"))
    stored["files"][key]["sha256"] = "0" * 64
    memo.write_text(json.dumps(stored))
    fingerprint._PROCESS_MEMO.clear()
    assert weights_digest(a, memo, TEST_KEY) == first  # the edit was not believed
    memo.write_text(json.dumps(stored["files"]))  # the same edit as an unkeyed memo
    fingerprint._PROCESS_MEMO.clear()
    assert weights_digest(a, memo) != first  # believed without a key (control)
    fingerprint._PROCESS_MEMO.clear()
    weights_digest(a, memo, TEST_KEY)
    fingerprint._PROCESS_MEMO.clear()
    assert weights_digest(a, memo, other_key()) == first  # another key: hashed again
