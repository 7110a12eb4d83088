"""Seeded synthetic text: prose, source files, shell and test logs, search hits.

Why synthetic: a benchmark must be reproducible on any machine and offline, and its size must be
set in tokens. Real corpora would tie the trace to a download; random bytes would tokenize far
worse than real text and inflate prompt sizes. This module mixes a fixed word bank into the
shapes agents actually send (code with docstrings, pytest logs, grep hits, JSON), so the token
statistics look like a coding session's, and every byte depends only on the seed.

Sizes are asked for in *approximate* tokens: each generator appends units until its character
count reaches `tokens * CHARS_PER_TOKEN[kind]`. The ratios were measured on the embedded
models' byte-level BPE (prose about 3.3 characters a token, logs full of digits and paths about
2); a real Qwen tokenizer packs English a little tighter, so the same trace is somewhat fewer
tokens there. The generator never needs a tokenizer, so a trace is the same for every model.
"""

from __future__ import annotations

import json
import random

CHARS_PER_TOKEN: dict[str, float] = {
    "prose": 3.3, "rules": 3.1, "source": 3.0, "grep": 2.2, "tests": 2.1, "shell": 1.9,
    "json": 2.3, "message": 2.9,
}

_WORDS = (
    "account action active adapter address agent alias allocate anchor answer append apply "
    "argument array assign async attempt attribute backend balance batch before block branch "
    "buffer build bundle byte cache call cancel capture cell chain change channel check child "
    "chunk claim class clear client close cluster code collect column commit compare compile "
    "config connect context convert copy count create cursor data debug decode default delete "
    "depth detect device digest direct disk domain driver dump edge element empty encode engine "
    "entry error event evict exact export extend factor field file filter final flag flush "
    "format frame function gather graph group guard handle hash header heap index input insert "
    "instance interval item job join kernel key label layer layout leaf length level limit line "
    "link list load local lock log lookup loop manager map match memory merge message method "
    "metric mode model module node number object offset option order output owner packet page "
    "parent parse part patch path payload peer plan pointer policy pool port prefix prepare "
    "process profile prompt proxy queue range rank read record reduce region register release "
    "remote render replay report request reset resolve resource restore result retry return "
    "route row rule runner sample save scale schedule schema scope score search section segment "
    "select send server session setting shape shard signal size slot snapshot socket source "
    "span split stack stage state status step storage stream string struct suffix summary "
    "switch table target task tensor test thread tier timer token trace track tree trigger type "
    "update user value vector verify version view volume wait window worker write"
).split()

_ADJECTIVES = (
    "stale fresh cold warm shared private pending partial stable hidden idle busy local remote "
    "small large empty full valid broken slow fast exact lazy eager nested sorted"
).split()

_VERBS = (
    "load save parse build check update resolve fetch merge split apply render collect compute "
    "encode decode flush evict restore verify schedule dispatch register release"
).split()


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def identifier(rng: random.Random, parts: int = 2) -> str:
    """A snake_case identifier such as `load_cache_entry`."""
    return "_".join([rng.choice(_VERBS)] + [_word(rng) for _ in range(parts - 1)])


def sentence(rng: random.Random, lo: int = 6, hi: int = 16) -> str:
    """One sentence of 6-16 words with a capital and a full stop."""
    words = []
    for _ in range(rng.randint(lo, hi)):
        words.append(rng.choice(_ADJECTIVES) if rng.random() < 0.2 else _word(rng))
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


def _fill(rng: random.Random, tokens: int, unit, joiner: str, kind: str) -> str:
    """Append `unit(rng)` pieces until the text reaches about `tokens` tokens."""
    target = max(1, int(tokens * CHARS_PER_TOKEN[kind]))
    parts: list[str] = []
    size = 0
    while size < target:
        piece = unit(rng)
        parts.append(piece)
        size += len(piece) + len(joiner)
    return joiner.join(parts)


def prose(rng: random.Random, tokens: int) -> str:
    """Paragraphs of plain sentences (user questions, answers, documentation)."""

    def paragraph(r: random.Random) -> str:
        return " ".join(sentence(r) for _ in range(r.randint(2, 5)))

    return _fill(rng, tokens, paragraph, "\n\n", "prose")


def bullet_rules(rng: random.Random, tokens: int) -> str:
    """A system prompt's list of rules, grouped under headings."""

    def section(r: random.Random) -> str:
        title = " ".join(_word(r) for _ in range(r.randint(1, 3))).title()
        rules = "\n".join(f"- {sentence(r)}" for _ in range(r.randint(3, 7)))
        return f"## {title}\n\n{rules}"

    return _fill(rng, tokens, section, "\n\n", "rules")


def _function(rng: random.Random) -> str:
    name = identifier(rng, rng.randint(2, 3))
    args = [_word(rng) for _ in range(rng.randint(1, 3))]
    var = _word(rng)
    lines = [
        f"def {name}(self, {', '.join(args)}=None):",
        f'    """{sentence(rng)}"""',
        f"    {var} = self.{_word(rng)}.get({args[0]})",
        f"    if {var} is None:",
        f'        raise ValueError("{sentence(rng, 3, 8)}")',
    ]
    for _ in range(rng.randint(1, 4)):
        lines.append(f"    {_word(rng)} = {identifier(rng)}({var}, {rng.randint(0, 4096)})")
    lines.append(f"    return {var}")
    return "\n".join(lines)


def source_file(rng: random.Random, tokens: int) -> str:
    """A Python module: imports, then functions with docstrings (what `read_file` returns)."""
    head = "\n".join(f"import {_word(rng)}" for _ in range(rng.randint(2, 5)))
    return head + "\n\n\n" + _fill(rng, tokens, _function, "\n\n\n", "source")


def path(rng: random.Random) -> str:
    """A repository path such as `src/cache/restore_tree.py`."""
    return f"src/{_word(rng)}/{identifier(rng)}.py"


def grep_hits(rng: random.Random, tokens: int) -> str:
    """`grep -n` output: path:line: code."""

    def hit(r: random.Random) -> str:
        return f"{path(r)}:{r.randint(1, 900)}:    {_word(r)} = {identifier(r)}({_word(r)})"

    return _fill(rng, tokens, hit, "\n", "grep")


def test_log(rng: random.Random, tokens: int) -> str:
    """A pytest run: a line per test, a failure traceback, a summary."""
    total = max(4, int(tokens * CHARS_PER_TOKEN["tests"] / 60))
    lines = []
    failed = rng.randint(0, 2)
    for i in range(total):
        status = "FAILED" if i < failed else "PASSED"
        lines.append(f"tests/test_{_word(rng)}.py::test_{identifier(rng)} {status} "
                     f"[{100 * (i + 1) // total:3d}%]")
    for _ in range(failed):
        lines.append(f"E   AssertionError: {sentence(rng, 4, 9)}")
    seconds = rng.uniform(0.5, 30)
    lines.append(f"==== {failed} failed, {total - failed} passed in {seconds:.2f}s ====")
    return "\n".join(lines)


def shell_output(rng: random.Random, tokens: int) -> str:
    """Shell output: a listing or a build log."""

    def line(r: random.Random) -> str:
        if r.random() < 0.5:
            return f"-rw-r--r-- 1 dev dev {r.randint(100, 99999):6d} {path(r)}"
        return f"[{r.randint(1, 99):2d}/{r.randint(100, 200)}] Building {path(r)}"

    return _fill(rng, tokens, line, "\n", "shell")


def json_records(rng: random.Random, tokens: int) -> str:
    """A JSON array of records (API and search tool results)."""
    target = max(1, int(tokens * CHARS_PER_TOKEN["json"]))
    records: list[dict[str, object]] = []
    size = 0
    while size < target:
        rec = {"id": rng.randint(1, 10**6), "title": sentence(rng, 3, 7),
               "url": f"https://docs.example.org/{_word(rng)}/{_word(rng)}",
               "snippet": sentence(rng)}
        records.append(rec)
        size += len(json.dumps(rec))
    return json.dumps(records, indent=1)
