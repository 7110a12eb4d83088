"""Message-end ids from the tokenizer: found, or a warning that says the cuts are off and why."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_hybridcache.adapter.startup import default_message_end_ids


def _config(tokenizer: str) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(
        tokenizer=tokenizer, tokenizer_revision=None, trust_remote_code=False))


def _save_tokenizer(folder, vocab: list[str]) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    return str(folder)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "vllm_hybridcache"]


def test_failing_tokenizer_lookup_warns_that_message_end_cuts_are_off(tmp_path, caplog):
    """Defect: a failed lookup was an info line, so the cuts silently went off."""
    missing = str(tmp_path / "no-such-tokenizer")
    with caplog.at_level(logging.INFO, logger="vllm_hybridcache"):
        assert default_message_end_ids(_config(missing)) == ()
    (msg,) = _warnings(caplog)
    assert "message-end cuts are off" in msg and "could not be loaded" in msg
    assert missing in msg and "VLLM_HYBRIDCACHE_MESSAGE_END_IDS" in msg


def test_tokenizer_without_im_end_warns(tmp_path, caplog):
    path = _save_tokenizer(tmp_path, ["[UNK]", "hello", "world"])
    with caplog.at_level(logging.INFO, logger="vllm_hybridcache"):
        assert default_message_end_ids(_config(path)) == ()
    (msg,) = _warnings(caplog)
    assert "message-end cuts are off" in msg and "has no <|im_end|>" in msg


@pytest.mark.parametrize("position", [1, 3])
def test_im_end_is_found_without_a_warning(tmp_path, caplog, position):
    vocab = ["[UNK]", "a", "b", "c"]
    vocab.insert(position, "<|im_end|>")
    path = _save_tokenizer(tmp_path, vocab)
    with caplog.at_level(logging.INFO, logger="vllm_hybridcache"):
        assert default_message_end_ids(_config(path)) == (position,)
    assert not _warnings(caplog)
