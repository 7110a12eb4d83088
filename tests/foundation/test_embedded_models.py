"""Embedded models: deterministic bytes, loadable by transformers, safe against bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_hybridcache.models import ModelStoreError, ensure_model
from vllm_hybridcache.models.catalog import CATALOG
from vllm_hybridcache.models.store import FINGERPRINT_FILE, fingerprint


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_hybridcache.cli.tools", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_same_name_and_versions_give_identical_bytes(tmp_path):
    out = _cli("make-model", "qwen3-next-tiny", env={"VLLM_HYBRIDCACHE_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    fresh = out.stdout.strip().splitlines()[-1]
    meta = json.loads((tmp_path / "models" / os.path.basename(fresh) / FINGERPRINT_FILE)
                      .read_text())
    from vllm_hybridcache.models import model_dir

    user = ensure_model("qwen3-next-tiny")  # the shared user-cache copy the tests use
    assert os.path.basename(fresh) == model_dir("qwen3-next-tiny").name
    assert meta["fingerprint"] == json.loads((user / FINGERPRINT_FILE).read_text())["fingerprint"]
    assert meta["fingerprint"] == fingerprint(tmp_path / "models" / os.path.basename(fresh))


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "flash-next-tiny"])
def test_transformers_loads_and_generates_deterministically(embedded_model, name):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_model(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "List the files."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=8, do_sample=False)
        b = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b) and a.shape[1] == ids.shape[1] + 8
    logits = model(ids).logits[0, -1].float()
    # raised initializer_range: logits must not be flat
    assert (logits.max() - logits.median()).item() > 1.0


def test_tokenizer_has_the_chat_vocabulary(embedded_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model("qwen3-next-tiny"))
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
              "<tool_call>", "</tool_call>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, (t, ids)
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "reasoning_content": "think",
         "tool_calls": [{"type": "function", "function": {"name": "ls",
                                                            "arguments": {"path": "."}}}]},
        {"role": "tool", "content": "a.py"},
    ]
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in text and '<tool_call>\n{"name": "ls"' in text
    assert "<tool_response>\na.py\n</tool_response>" in text
    assert "<think>\nthink\n</think>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_unknown_model_is_a_clear_error(tmp_path):
    out = _cli("make-model", "no-such-model", env={"VLLM_HYBRIDCACHE_HOME": str(tmp_path)})
    assert out.returncode != 0
    assert "unknown embedded model 'no-such-model'" in out.stderr
    assert not list((tmp_path / "models").glob("*")) if (tmp_path / "models").exists() else True


def test_unwritable_cache_dir_is_a_clear_error_and_leaves_nothing(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o500)
    try:
        if os.access(target, os.W_OK):  # running as root: permissions do not bind
            blocker = tmp_path / "file"
            blocker.write_text("not a folder")
            home = blocker
        else:
            home = target
        out = _cli("make-model", "qwen3-next-tiny", env={"VLLM_HYBRIDCACHE_HOME": str(home)})
        assert out.returncode != 0
        assert "cannot write embedded models" in out.stderr
        assert "VLLM_HYBRIDCACHE_HOME" in out.stderr
        assert not any(p.name.startswith(".tmp-") for p in tmp_path.rglob("*"))
    finally:
        target.chmod(0o700)


def test_failed_build_leaves_no_half_written_model(tmp_path, monkeypatch):
    from vllm_hybridcache.models import build

    monkeypatch.setenv("VLLM_HYBRIDCACHE_HOME", str(tmp_path))

    def broken(spec, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(build, "build_checkpoint", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_model("qwen3-next-tiny")
    assert list((tmp_path / "models").iterdir()) == []


def test_catalog_names():
    assert {"qwen3-next-tiny", "qwen3-next-small", "flash-next-tiny", "flash-next-small",
            "flash-next-vl-tiny", "qwen3.5-vl-tiny"} <= set(CATALOG)
    with pytest.raises(ModelStoreError):
        ensure_model("nope")
