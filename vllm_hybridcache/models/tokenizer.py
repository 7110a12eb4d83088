"""A byte-level BPE tokenizer trained on text that ships with Python.

Why: tests, the demo and CI may download nothing, yet the chat template, special tokens and
token statistics must look like a real Qwen tokenizer's. Training on the interpreter's own
sources and docstrings gives code, prose and JSON-ish text, and is identical on every machine
with the same Python and `tokenizers` versions.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS: tuple[str, ...] = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# Vision-language checkpoints only: appended after the trained vocabulary (ids VOCAB_SIZE + i),
# so the text checkpoints' tokenizer and ids stay as they are.
VISION_TOKENS: tuple[str, ...] = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                  "<|video_pad|>")

# Fixed, ordered corpus: stdlib modules whose source is text (code, docstrings, JSON-like literals).
_CORPUS_MODULES: tuple[str, ...] = (
    "json.decoder", "json.encoder", "argparse", "textwrap", "string", "collections",
    "logging", "pathlib", "typing", "dataclasses", "functools", "inspect", "subprocess",
    "http.client", "email.message", "unittest.case", "shutil", "tempfile", "csv", "random",
)


def corpus() -> Iterator[str]:
    """Yield the training text in a fixed order."""
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        source = Path(inspect.getsourcefile(module) or "").read_text(encoding="utf-8")
        yield from source.split("\n\n")


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE tokenizer; single-threaded so the merges are reproducible."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS) + list(ADDED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok
