"""The fingerprint never guesses: weights hashed where vLLM loads them, every arithmetic setting
in, and no fingerprint at all (`FingerprintUnavailable`) where the weights cannot be hashed.

Engine-free: the fingerprint functions take a vLLM config, faked here with SimpleNamespace
(and one real `EngineArgs` config). Hugging Face cache folders are built in tmp_path in the
hub's own layout: `models--org--name/{blobs/<etag>, snapshots/<commit>/<file> -> blob,
refs/main}`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_hybridcache.adapter import fingerprint
from vllm_hybridcache.adapter.fingerprint import (
    FingerprintUnavailable,
    engine_fingerprint,
    weights_digest,
)

REPO = "org/hybrid-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, files: dict[str, bytes], repo: str = REPO, commit: str = COMMIT,
               blob_names: dict[str, str] | None = None) -> Path:
    """A hub cache under `root` holding `files` at `commit` (refs/main points there). Weight
    files are LFS blobs named by their sha256, others git blobs (a sha1); `blob_names` gives a
    file another blob name (a blob whose content does not match its name)."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for name, content in files.items():
        lfs = name.endswith(fingerprint.WEIGHT_SUFFIXES)
        blob = (blob_names or {}).get(name) or (
            hashlib.sha256(content).hexdigest() if lfs
            else hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest())
        (repo_dir / "blobs" / blob).write_bytes(content)
        link = snap / name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(repo_dir / "blobs" / blob, snap))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return snap


CHECKPOINT = {"config.json": b'{"hidden_size": 8}', "model.safetensors": b"weights v1"}


def _config(model: str, *, download_dir: str | None = None, load_format: str = "auto",
            **model_fields):
    mc = {"model": model, "revision": None, "dtype": "bfloat16", **model_fields}
    return SimpleNamespace(
        model_config=SimpleNamespace(**mc),
        cache_config=SimpleNamespace(cache_dtype="auto", mamba_ssm_cache_dtype="auto"),
        load_config=SimpleNamespace(load_format=load_format, download_dir=download_dir))


def _fp(cfg, memo=None):
    return engine_fingerprint(cfg, "layout", "grid=64", "cpu", memo_file=memo)


@pytest.fixture(autouse=True)
def _fresh_process_memo(monkeypatch):
    monkeypatch.setattr(fingerprint, "_PROCESS_MEMO", {})


def test_a_download_dir_checkpoint_is_hashed_and_new_weights_under_its_name_differ(tmp_path):
    """`--download-dir`: vLLM loads `models--org--name` under that folder. The same name with
    new weights (a new commit that refs/main now points to) is another fingerprint; the old
    code fingerprinted this checkpoint as `name:org/hybrid-model@` both times."""
    cache = tmp_path / "downloads"
    _hub_cache(cache, CHECKPOINT)
    old = _fp(_config(REPO, download_dir=str(cache)))
    assert old.fields["weights"].startswith("sha256:")
    assert _fp(_config(REPO, download_dir=str(cache))).digest == old.digest
    _hub_cache(cache, {**CHECKPOINT, "model.safetensors": b"weights v2"},
               commit="f" * 40)
    new = _fp(_config(REPO, download_dir=str(cache)))
    assert new.digest != old.digest and new.differences(old) == ["weights"]
    # the config next to the weights counts too
    _hub_cache(cache, {**CHECKPOINT, "config.json": b'{"hidden_size": 16}'}, commit="e" * 40)
    assert _fp(_config(REPO, download_dir=str(cache))).differences(old) == ["weights"]


def test_the_default_hub_cache_is_where_a_name_is_found(tmp_path, monkeypatch):
    """Without --download-dir vLLM loads from huggingface_hub's cache (HF_HUB_CACHE, or
    HF_HOME/hub), as huggingface_hub read it at import."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _hub_cache(tmp_path / "hub", CHECKPOINT)
    fp = _fp(_config(REPO))
    local = tmp_path / "local"
    local.mkdir()
    for name, content in CHECKPOINT.items():
        (local / name).write_bytes(content)
    # the same files by content: the hub copy and a local folder agree
    assert _fp(_config(str(local))).digest == fp.digest
    # another download dir without the checkpoint is not the default cache: unavailable
    with pytest.raises(FingerprintUnavailable, match="--download-dir"):
        _fp(_config(REPO, download_dir=str(tmp_path / "empty")))


@pytest.mark.parametrize("case", ["unknown_name", "no_weights", "dummy", "tensorizer",
                                  "streamed", "modelscope"])
def test_weights_that_cannot_be_hashed_give_no_fingerprint(tmp_path, monkeypatch, case):
    """Never a fingerprint by name: each of these engines raises FingerprintUnavailable."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    if case != "no_weights":
        (folder / "model.safetensors").write_bytes(b"w")
    cfg = {
        "unknown_name": _config("org/not-downloaded"),
        "no_weights": _config(str(folder)),
        "dummy": _config(str(folder), load_format="dummy"),
        "tensorizer": _config(str(folder), load_format="tensorizer"),
        "streamed": _config(str(folder), model_weights="s3://bucket/model"),
        "modelscope": _config("org/not-local"),
    }[case]
    if case == "modelscope":
        monkeypatch.setattr(fingerprint, "_modelscope", lambda: True)
        _hub_cache(tmp_path / "hub", CHECKPOINT, repo="org/not-local")  # HF's copy: not it
    with pytest.raises(FingerprintUnavailable) as err:
        _fp(cfg)
    assert err.value.reason


def test_a_hub_blob_is_named_by_its_file_name_not_read(tmp_path, monkeypatch):
    """An LFS blob's name is the sha256 of its content: used as the file's digest, the blob is
    never opened. Shown with a blob whose bytes do not match its name: the digest is the one
    of the content the name says (a local folder with that content agrees), and no blob is
    read (counted)."""
    true_weights = b"the real weights"
    local = tmp_path / "local"
    local.mkdir()
    (local / "model.safetensors").write_bytes(true_weights)
    (local / "config.json").write_bytes(CHECKPOINT["config.json"])
    snap = _hub_cache(tmp_path / "cache", {"config.json": CHECKPOINT["config.json"],
                                           "model.safetensors": b"other bytes"},
                      blob_names={"model.safetensors":
                                  hashlib.sha256(true_weights).hexdigest()})
    reads: list[str] = []
    real_open = open

    def counting_open(path, *a, **kw):
        reads.append(str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr("builtins.open", counting_open)
    assert weights_digest(snap) == weights_digest(local)
    blob = (snap / "model.safetensors").resolve()
    assert blob.read_bytes() == b"other bytes"  # the name lies about the bytes...
    assert all(Path(r).resolve() != blob for r in reads)  # ...which were never read
    assert (local / "model.safetensors") in {Path(r) for r in reads}  # the local copy was


@pytest.mark.parametrize("field,a,b", [
    ("quantization", None, "fp8"),
    ("quantization_config", None, {"quant_method": "fp8", "activation_scheme": "dynamic"}),
    ("hf_overrides", {"rope_theta": 10000}, {"rope_theta": 20000}),
    ("model_impl", "vllm", "transformers"),
])
def test_settings_that_change_the_arithmetic_change_the_fingerprint(tmp_path, field, a, b):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name, content in CHECKPOINT.items():
        (folder / name).write_bytes(content)
    fa, fb = _fp(_config(str(folder), **{field: a})), _fp(_config(str(folder), **{field: b}))
    assert fa.digest != fb.digest and fb.differences(fa) == [field]


def test_the_checkpoints_quantization_config_and_hf_config_count(tmp_path):
    """A quantized load of one checkpoint: vLLM's method, and the hf_config's own
    `quantization_config` as loaded; any hf_config change (what --hf-overrides does to it) is
    another fingerprint, the path it was read from (`_name_or_path`) is not."""
    from transformers import PretrainedConfig

    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name, content in CHECKPOINT.items():
        (folder / name).write_bytes(content)

    def cfg(**kw):
        return _config(str(folder), hf_config=PretrainedConfig(**kw))

    base = _fp(cfg(hidden_size=8))
    quant = _fp(cfg(hidden_size=8, quantization_config={"quant_method": "gptq", "bits": 4}))
    assert set(quant.differences(base)) == {"hf_config", "quantization_config"}
    assert _fp(cfg(hidden_size=16)).differences(base) == ["hf_config"]
    moved = PretrainedConfig(hidden_size=8)
    moved._name_or_path = "/another/path"
    assert _fp(_config(str(folder), hf_config=moved)).digest == base.digest


def test_the_preprocessor_and_mm_settings_count(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name, content in CHECKPOINT.items():
        (folder / name).write_bytes(content)
    plain = _fp(_config(str(folder)))
    assert plain.fields["processor"] == "none" and plain.fields["multimodal"] == "none"
    (folder / "preprocessor_config.json").write_text('{"patch_size": 14}')
    with_pre = _fp(_config(str(folder)))
    assert with_pre.differences(plain) == ["processor"]
    (folder / "preprocessor_config.json").write_text('{"patch_size": 16}')
    assert _fp(_config(str(folder))).differences(with_pre) == ["processor"]

    class MM:
        def __init__(self, kwargs, backend):
            self.mm_processor_kwargs, self.backend, self.language_model_only = kwargs, backend, 0

        def compute_hash(self):
            return f"encoder-{self.backend}"

    a = _fp(_config(str(folder), multimodal_config=MM({"max_pixels": 1024}, "sdpa")))
    b = _fp(_config(str(folder), multimodal_config=MM({"max_pixels": 2048}, "sdpa")))
    c = _fp(_config(str(folder), multimodal_config=MM({"max_pixels": 1024}, "flash")))
    assert len({a.digest, b.digest, c.digest}) == 3
    assert b.differences(a) == ["multimodal"] == c.differences(a)


def test_triton_cuda_and_rocm_versions_are_fields(tmp_path, monkeypatch):
    import torch

    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name, content in CHECKPOINT.items():
        (folder / name).write_bytes(content)
    fp = _fp(_config(str(folder)))
    assert {"triton", "torch_cuda", "torch_hip", "compilation", "lora", "load_format"} <= set(
        fp.fields)
    monkeypatch.setattr(torch.version, "hip", "6.4.1")
    assert _fp(_config(str(folder))).differences(fp) == ["torch_hip"]
    monkeypatch.setattr(fingerprint, "triton_version", lambda: "triton==9.9.9")
    assert set(_fp(_config(str(folder))).differences(fp)) == {"torch_hip", "triton"}


def test_a_setting_without_a_canonical_form_is_unavailable_not_skipped(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name, content in CHECKPOINT.items():
        (folder / name).write_bytes(content)
    with pytest.raises(FingerprintUnavailable, match="hf_overrides"):
        _fp(_config(str(folder), hf_overrides={"x": object()}))


_REAL = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm_hybridcache.adapter.fingerprint import engine_fingerprint
cfg = EngineArgs(model=sys.argv[1], max_model_len=2048,
                 hf_overrides=json.loads(sys.argv[2])).create_engine_config()
fp = engine_fingerprint(cfg, "layout", "grid=64", "cpu")
print(json.dumps({"hex": fp.hex, "fields": fp.fields}))
"""


@pytest.mark.timeout(300)
def test_a_real_vllm_config_is_stable_across_processes_and_sees_hf_overrides(embedded_model):
    """vLLM's own config objects: two processes (two engine starts) with the same arguments
    agree (every field is canonical, none carries an address or a path), and --hf-overrides
    changes both the overrides field and the loaded hf_config."""
    import json

    model = str(embedded_model("qwen3-next-tiny"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def run(overrides: dict) -> dict:
        out = subprocess.run([sys.executable, "-c", _REAL, model, json.dumps(overrides)],
                             env=env, capture_output=True, text=True, timeout=240, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    a, b = run({}), run({})
    assert a["hex"] == b["hex"]
    c = run({"rms_norm_eps": 1e-5})
    assert c["hex"] != a["hex"]
    changed = {k for k in a["fields"] if a["fields"][k] != c["fields"][k]}
    assert changed == {"hf_overrides", "hf_config"}
