"""The disk tier on the MTP route (flash-next-tiny, k = 1 and 2 draft tokens, float32).

On this route every tree link keeps the target's hidden row at its boundary (one more section,
adapter/draft_rows.py) and carries a draft tag (the first position of the prefill step that
ended at its cut); a restore rebuilds the boundary draft rows for the new prompt. A link file
carries both: the tag in its header, the hidden row as a checksummed part. Here a prompt's
links are written to disk, RAM is cleared, and prompts that extend it or branch from it with
another last token are served from the files (a disk hit, then promoted into RAM); they equal
their cold runs bit for bit: tokens, logprobs and every state part, the draft head's rows
included.

Negative controls (on the k = 2 engine only: they are parametrized over it, not skipped on
k = 1): a file whose tag is wrong ends the chain before it
(a counted `draft_tag` miss, the output cold-equal; one without a tag serves nothing on this
route, tests/core/test_core_disk_tags.py); a
flipped bit in the hidden-row part fails its CRC (a counted `checksum` miss, the load
recomputed cold, the file deleted with the longer links); and the same one-ulp change written
with a valid CRC is restored and leaves draft-head rows that differ from the cold run, so the
state comparison catches a bad hidden row and the CRC is what keeps it out.

End anchors (session spill, on by default on this route too): an anchor keeps the target's
hidden row at its end and the geometry of the draft pass that wrote its boundary row, and its
tag (`RebuiltAnchor`) says a restore rebuilds that row for the next turn's token. The worker's
shutdown drain (the connector's shutdown hook, as at a SIGTERM) writes a live anchor's file
(tag in the header, the hidden row and the geometry as checksummed parts); with every tier
empty and the file named to the disk anchor tier as a restart's scan names it, the
conversation's next turn is served from it: it equals the same turn resumed from the RAM
anchor bit for bit (tokens, logprobs, every state part: session-exact) and passes the greedy
gate against a cold run of its prompt. Negative controls (k = 2): an anchor file whose tag
does not fit the prompt is a counted `draft_tag` miss (the turn runs cold, equal to the cold
run); the hidden row one ulp off with a valid CRC is restored and the draft head's rows then
differ from the RAM-anchor run.
The restart of the real server with MTP on is not run here (see docs/disk-tier.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.connector.conftest import connector_engine, engine_parts
from tests.connector.test_end_anchors import greedy_gate
from tests.connector.test_exactness import GRID, A, clear, run
from tests.connector.test_mtp_route import NEW_TEXT, PROMPTS, SESSION
from tests.keys import KEY_FILE, TEST_KEY
from vllm_hybridcache.adapter.draft_rows import DRAFT_INPUT, DRAFT_PASS
from vllm_hybridcache.adapter.draft_tags import DraftStep, NextToken, RebuiltAnchor
from vllm_hybridcache.core.linkformat.linkfile import read_header, read_parts, write_link_file
from vllm_hybridcache.testing.instrumentation import instrument

pytestmark = pytest.mark.slow

EXT = PROMPTS["ext_other_last"]        # A + 200 tokens, another last token: A's 3-link chain
BRANCH = PROMPTS["branch_other_last"]  # parts from A one token after its 2nd cut


@pytest.fixture(scope="module")
def model_path(embedded_model):
    return embedded_model("flash-next-tiny")


def _ks(*ks: int):
    """Parametrizes a test over the engines with these numbers of draft tokens (the `llm`
    fixture, one engine per k for the module: pytest groups the tests by k)."""
    return pytest.mark.parametrize("llm", ks, indirect=True, ids=lambda k: f"k{k}")


EVERY_K = _ks(1, 2)
CONTROLS_K = _ks(2)  # the negative controls: the k = 2 engine


@pytest.fixture(scope="module")
def llm(request, inproc, model_path, tmp_path_factory):
    spec = {"method": "mtp", "num_speculative_tokens": request.param}
    disk = tmp_path_factory.mktemp(f"mtp-disk-k{request.param}")
    # every committed link is written (no admission), so one run of A puts its chain on disk
    extra = {"grid": GRID, "disk_dir": str(disk), "disk_key_file": str(KEY_FILE),
             "disk_write_first_tokens": 0}
    with connector_engine(model_path, extra=extra, dtype="float32", speculative_config=spec,
                          disable_log_stats=False) as engine:
        instrument(engine)
        engine.k = request.param
        yield engine


def settle(llm) -> None:
    """Wait until the worker's disk writer has written (or skipped) everything handed to it."""
    _, worker = engine_parts(llm)
    deadline = time.monotonic() + 120
    # the worker's disk handler starts with the first plan that carries disk operations
    handler = worker.handlers.get("disk")
    while (handler is not None and handler.writer is not None
           and not handler.writer.idle()):
        assert time.monotonic() < deadline, "the disk writer did not finish"
        time.sleep(0.02)


def wipe(llm) -> None:
    """Every tier empty and no write or deletion in flight: the scheduler deletes the files at
    once, the writer with the next plan (a three-token request carries it)."""
    settle(llm)
    clear(llm)
    run(llm, [1, 2, 3])
    settle(llm)
    assert not files(llm)


def ram_only(llm) -> None:
    """Forget RAM (tree links and end anchors); the files stay: the next hit is a disk hit."""
    settle(llm)
    sched, _ = engine_parts(llm)
    sched.clear(tier="ram")


def files(llm) -> dict[int, Path]:
    """The tree link files of this engine, by end."""
    sched, _ = engine_parts(llm)
    folder = sched.cache.lower("disk").disk.dir.dir
    return {int(p.stem.rsplit("-", 1)[1]): p for p in folder.glob("*/*.link")
            if not p.parent.name.startswith("a-")}


def disk_stats(llm):
    sched, _ = engine_parts(llm)
    return sched.cache.stats()[("disk", "tree")]


@pytest.fixture(scope="module")
def colds(llm) -> dict[str, dict]:
    """Cold runs of the prompts served from disk below, each with every tier empty."""
    out = {}
    for name, p in (("ext", EXT), ("branch", BRANCH)):
        wipe(llm)
        out[name] = run(llm, p)
        assert out[name]["cached"] == 0 and out[name]["state"]
    return out


@pytest.fixture(scope="module")
def a_files(llm) -> dict[int, tuple[Path, bytes]]:
    """A's chain as this engine's writer wrote it after one run (links at 256, 512, 768):
    path and bytes of each file, so a test can put them back without running A again."""
    wipe(llm)
    run(llm, A)
    settle(llm)
    got = files(llm)
    assert sorted(got) == [GRID, 2 * GRID, 3 * GRID]
    return {end: (p, p.read_bytes()) for end, p in got.items()}


def put_a(llm, a_files) -> dict[int, Path]:
    """Every tier empty, then A's files back on disk (the next lookup finds them by name)."""
    wipe(llm)
    for path, raw in a_files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    return {end: path for end, (path, _) in a_files.items()}


def rewrite(path: Path, fp: bytes, tag="keep", hidden=None, crc_ok: bool = True) -> None:
    """Write a link file again with another tag and/or a changed hidden-row part (`hidden`:
    tensor -> tensor). crc_ok=False flips a bit of that part after the write instead (its CRC
    then fails)."""
    h, base = read_header(path, fp, TEST_KEY)
    parts = {e.name: torch.empty(e.nbytes, dtype=torch.uint8) for e in h.parts}
    read_parts(path, h, base, parts, TEST_KEY)
    if hidden is not None and crc_ok:
        row = parts[DRAFT_INPUT].view(torch.float32)
        row.copy_(hidden(row))
    write_link_file(path, fingerprint=h.fingerprint, domain=h.domain, digest=h.digest,
                    parent_digest=h.parent_digest, start=h.start, end=h.end,
                    tokens=h.token_ids(), rows=h.rows, parts=parts, created=h.created,
                    kind=h.kind, tag=h.tag if tag == "keep" else tag, key=TEST_KEY)
    if hidden is not None and not crc_ok:
        entry = next(e for e in h.parts if e.name == DRAFT_INPUT)
        _, base2 = read_header(path, fp, TEST_KEY)
        with open(path, "r+b") as f:
            f.seek(base2 + entry.offset)
            b = f.read(1)
            f.seek(base2 + entry.offset)
            f.write(bytes([b[0] ^ 0x01]))


def _same(warm, cold, name):
    assert warm["tokens"] == cold["tokens"], name
    assert warm["logprobs"] == cold["logprobs"], name
    assert warm["state"] == cold["state"], name          # the draft head's rows included


def _ulp(h: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(h, torch.full_like(h, float("inf")))


@EVERY_K
def test_links_written_on_the_mtp_route_restore_from_disk_equal_cold(llm, colds, a_files):
    sched, _ = engine_parts(llm)
    assert sched.base_domain["route"] == "mtp" and sched._draft_reads == "rebuild"
    disk = sched.cache.lower("disk")
    assert disk.spill is not None and disk.anchors is not None  # session spill on
    fp = sched.cache.lower("disk").disk.dir.fingerprint
    for end, (path, _) in a_files.items():
        h, _ = read_header(path, fp, TEST_KEY)
        assert sched.cache.lower("disk").disk.tags.decode(h.tag) == DraftStep(end - GRID)
        assert DRAFT_INPUT in {e.name for e in h.parts}
    put_a(llm, a_files)
    before = disk_stats(llm)
    promoted = sched.tree.stats().promoted
    warm = run(llm, EXT)                                  # from disk: A's 3 files
    assert warm["cached"] == 3 * GRID
    after = disk_stats(llm)
    assert after.restores == before.restores + 1 and after.restores_failed == 0
    assert sched.tree.stats().promoted == promoted + 3    # into RAM, tags kept:
    ram = run(llm, BRANCH)                                # RAM serves the branch now
    assert ram["cached"] == 2 * GRID and disk_stats(llm).restores == after.restores
    _same(warm, colds["ext"], "ext from disk")
    _same(ram, colds["branch"], "branch from the promoted links")
    ram_only(llm)
    branch = run(llm, BRANCH)                             # from disk again: 2 files
    assert branch["cached"] == 2 * GRID and disk_stats(llm).restores == after.restores + 1
    _same(branch, colds["branch"], "branch from disk")
    assert sched.tree.stats().shortened == 0 and "draft_tag" not in disk_stats(llm).misses


@CONTROLS_K
def test_a_file_with_a_wrong_tag_is_a_counted_miss(llm, colds, a_files):
    sched, _ = engine_parts(llm)
    fp = sched.cache.lower("disk").disk.dir.fingerprint
    got = put_a(llm, a_files)
    rewrite(got[2 * GRID], fp, tag=sched.cache.lower("disk").disk.tags.encode(DraftStep(1)))
    misfit = disk_stats(llm).misses.get("draft_tag", 0)
    warm = run(llm, EXT)
    assert warm["cached"] == GRID                      # the chain ends before the 512 file
    assert disk_stats(llm).misses.get("draft_tag", 0) > misfit
    _same(warm, colds["ext"], "ext with a misfit file")
    # (a file without a tag serves nothing on this route: tests/core/test_core_disk_tags.py)


@CONTROLS_K
def test_a_corrupted_hidden_row_is_a_counted_miss_and_would_be_caught(llm, colds, a_files):
    sched, _ = engine_parts(llm)
    fp = sched.cache.lower("disk").disk.dir.fingerprint
    got = put_a(llm, a_files)
    rewrite(got[2 * GRID], fp, hidden=_ulp, crc_ok=False)   # a flipped bit, CRC stale
    before = disk_stats(llm)
    out = run(llm, EXT)
    settle(llm)
    run(llm, [1, 2, 3])          # the next step's report carries the writer's stats
    after = disk_stats(llm)
    assert after.misses.get("checksum", 0) == before.misses.get("checksum", 0) + 1
    assert after.restores_failed == before.restores_failed + 1
    assert after.restores == before.restores
    assert after.invalidated == before.invalidated + 2   # the file and the longer link
    _same(out, colds["ext"], "ext after a checksum failure")      # recomputed cold

    # Negative control: the same change with a valid CRC is restored, and the state
    # comparison sees the draft head's rows differ from the cold run.
    got = put_a(llm, a_files)
    rewrite(got[2 * GRID], fp, hidden=_ulp)
    bad = run(llm, EXT)
    assert bad["cached"] == 3 * GRID
    names = [v.name for v in sched.parts.layout.views if v.name.startswith("mtp.")]
    assert any(bad["state"][n] != colds["ext"]["state"][n] for n in names)
    wipe(llm)


# ---------------------------------------------------------------- end anchors (session spill)
def anchor_stats(llm):
    sched, _ = engine_parts(llm)
    return sched.cache.stats()[("disk", "anchor")]


@pytest.fixture(scope="module")
def spilled(llm) -> dict:
    """A conversation's first turn (SESSION) leaves its end anchor; the worker's shutdown
    drain (the connector's shutdown hook, what a SIGTERM runs) writes it to disk; its next
    turn (prompt + answer + new text) resumed from the RAM anchor, and its cold run (every tier
    empty); the anchor's file (path, bytes, header)."""
    sched, worker = engine_parts(llm)
    wipe(llm)
    first = run(llm, SESSION)
    run(llm, [1, 2, 3])                      # one more step commits the anchor
    n = len(SESSION) + len(first["tokens"]) - 1
    worker.shutdown()                        # the drain; the next plan starts a new writer
    (path,) = [p for p in sched.cache.lower("disk").disk.dir.dir.glob("a-*/*.link")
               if int(p.stem.rsplit("-", 1)[1]) == n]
    header, _ = read_header(path, sched.cache.lower("disk").disk.dir.fingerprint, TEST_KEY)
    raw = path.read_bytes()
    nxt = SESSION + first["tokens"] + NEW_TEXT
    ram = run(llm, nxt)  # the RAM anchor (the disk anchor tier learns of files at a start)
    assert ram["cached"] == n and ram["state"]
    wipe(llm)
    cold = run(llm, nxt)
    assert cold["cached"] == 0
    return {"nxt": nxt, "n": n, "ram": ram, "cold": cold, "path": path,
            "raw": raw, "header": header}


def put_anchor(llm, spilled) -> Path:
    """Every tier empty, then the anchor's file back on disk, named to the disk anchor tier as
    a restart's start-up scan names the files it finds."""
    sched, _ = engine_parts(llm)
    wipe(llm)
    h, path = spilled["header"], spilled["path"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(spilled["raw"])
    sched.cache.lower("disk").anchors.note_spilled(h.domain, h.end, h.digest)
    return path


@EVERY_K
def test_an_end_anchor_spilled_on_the_mtp_route_resumes_from_disk(llm, spilled):
    sched, _ = engine_parts(llm)
    h = spilled["header"]
    assert h.kind == "anchor" and (h.start, h.end) == (0, spilled["n"])
    assert sched.cache.lower("disk").anchors.tags.decode(h.tag) == RebuiltAnchor()
    assert {DRAFT_INPUT, DRAFT_PASS} <= {e.name for e in h.parts}
    put_anchor(llm, spilled)
    before = anchor_stats(llm)
    out = run(llm, spilled["nxt"])
    after = anchor_stats(llm)
    assert out["cached"] == spilled["n"]
    assert (after.restores, after.restores_failed) == (before.restores + 1,
                                                       before.restores_failed)
    _same(out, spilled["ram"], "next turn from the disk anchor vs the RAM anchor")
    cold = spilled["cold"]
    assert greedy_gate(out, cold) == len(cold["tokens"])


@CONTROLS_K
def test_an_anchor_file_whose_tag_does_not_fit_is_a_counted_miss(llm, spilled):
    """The file says its boundary row read another token than the next turn has (NextToken):
    the disk anchor tier refuses it (a counted `draft_tag` miss, the file kept), and the turn
    runs cold, equal to its cold run."""
    sched, _ = engine_parts(llm)
    path = put_anchor(llm, spilled)
    nxt, n = spilled["nxt"], spilled["n"]
    rewrite(path, sched.cache.lower("disk").disk.dir.fingerprint,
            tag=sched.cache.lower("disk").anchors.tags.encode(NextToken(nxt[n] + 1)))
    misfit = anchor_stats(llm).misses.get("draft_tag", 0)
    out = run(llm, nxt)
    assert out["cached"] == 0 and anchor_stats(llm).misses.get("draft_tag", 0) == misfit + 1
    assert path.exists()
    _same(out, spilled["cold"], "next turn with a misfit anchor file")


@CONTROLS_K
def test_a_wrong_hidden_row_in_an_anchor_file_is_caught(llm, spilled):
    """Negative control: the anchor's hidden row one ulp off, written with a valid CRC (a
    flipped bit with a stale one is a checksum miss like any part: the tree link case above),
    is restored, and the draft head's rows then differ from the run resumed from the RAM
    anchor: the state comparison catches a wrong hidden row."""
    sched, _ = engine_parts(llm)
    path = put_anchor(llm, spilled)
    rewrite(path, sched.cache.lower("disk").disk.dir.fingerprint, hidden=_ulp)
    bad = run(llm, spilled["nxt"])
    assert bad["cached"] == spilled["n"]
    names = [v.name for v in sched.parts.layout.views if v.name.startswith("mtp.")]
    assert any(bad["state"][v] != spilled["ram"]["state"][v] for v in names)
    wipe(llm)
