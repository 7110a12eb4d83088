"""Images in the replayer's token accounting: the ideal prefix must know which picture is which.

An image sits in the server's prompt ids as a run of identical pad tokens (vLLM expands the
chat template's single `<|image_pad|>` into one per row the tower returns), the same run for
every picture of that size. The ideal cached prefix (`benchmarks.ideal`) compares token ids,
so on raw ids two different screenshots would look shareable. The replayer therefore compares
*ideal ids*: the server's ids with the k-th pad run replaced by ids naming the k-th image of the
request's messages (its `uuid` when the client sent one, as vLLM then keys on it, else its
URL: a trace sends each picture as one data URL), the same rule the cache keys follow.

The locally rendered prompt has one pad per image; it matches the server's prompt once the
server's runs are collapsed to one pad each.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

PAD_TOKEN = "<|image_pad|>"


def image_refs(messages: Sequence[dict[str, Any]]) -> list[str]:
    """What names each image part of the messages, in prompt order (uuid, else URL)."""
    refs = []
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                refs.append(str(part.get("uuid") or part["image_url"]["url"]))
    return refs


def pad_id(tokenizer) -> int | None:
    """The image pad's id in a `PromptTokenizer`'s vocabulary; None for text-only models."""
    tok = tokenizer.tok
    value = tok.convert_tokens_to_ids(PAD_TOKEN)
    return None if value is None or value == tok.unk_token_id else int(value)


def pad_runs(ids: Sequence[int], pad: int) -> list[tuple[int, int]]:
    """[start, end) of every run of pads."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == pad:
            j = i
            while j < len(ids) and ids[j] == pad:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def collapse(ids: Sequence[int], pad: int) -> list[int]:
    """The ids with every pad run reduced to one pad (what the local template renders)."""
    out: list[int] = []
    for t in ids:
        if not (t == pad and out and out[-1] == pad):
            out.append(t)
    return out


def ideal_ids(ids: Sequence[int], pad: int, refs: Sequence[str]) -> list[int]:
    """The ids with the k-th pad run replaced by negative ids derived from `refs[k]`.

    Raises ValueError when the runs and the images do not pair up (a template drift the
    report must not hide)."""
    runs = pad_runs(ids, pad)
    if len(runs) != len(refs):
        raise ValueError(f"{len(runs)} image pad runs in the prompt for {len(refs)} images")
    out = list(ids)
    for (start, end), ref in zip(runs, refs, strict=True):
        digest = hashlib.sha256(ref.encode()).digest()
        for i in range(start, end):
            k = (i - start) % 4
            out[i] = -1 - int.from_bytes(digest[8 * k: 8 * k + 8], "little") % (1 << 62)
    return out
