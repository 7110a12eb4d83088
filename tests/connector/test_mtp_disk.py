"""The disk tier on the MTP route (flash-next-tiny, k = 1 and 2 draft tokens, float32).

On this route every tree link keeps the target's hidden row at its boundary (one more section,
adapter/draft_rows.py) and carries a draft tag (the first position of the prefill step that
ended at its cut); a restore rebuilds the boundary draft rows for the new prompt. A link file
carries both: the tag in its header, the hidden row as a checksummed part. Here a prompt's
links are written to disk, RAM is cleared, and prompts that extend it or branch from it with
another last token are served from the files (a disk hit, then promoted into RAM); they equal
their cold runs bit for bit: tokens, logprobs and every state part, the draft head's rows
included.

Negative controls (on the k = 2 engine): a file whose tag is wrong ends the chain before it
(a counted `draft_tag` miss, the output cold-equal; one without a tag serves nothing on this
route, tests/core/test_core_disk_tags.py); a
flipped bit in the hidden-row part fails its CRC (a counted `checksum` miss, the load
recomputed cold, the file deleted with the longer links); and the same one-ulp change written
with a valid CRC is restored and leaves draft-head rows that differ from the cold run, so the
state comparison catches a bad hidden row and the CRC is what keeps it out. End anchors stay
in RAM on this route (session spill off): no anchor file is ever written.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.connector.conftest import connector_engine, engine_parts
from tests.connector.test_exactness import GRID, A, clear, run
from tests.connector.test_mtp_route import PROMPTS
from vllm_hybridcache.adapter.draft_rows import DRAFT_INPUT
from vllm_hybridcache.adapter.scheduler_side import DraftStep
from vllm_hybridcache.core.disk.linkfile import read_header, read_parts, write_link_file
from vllm_hybridcache.instrumentation import instrument

pytestmark = pytest.mark.slow

EXT = PROMPTS["ext_other_last"]        # A + 200 tokens, another last token: A's 3-link chain
BRANCH = PROMPTS["branch_other_last"]  # parts from A one token after its 2nd cut


@pytest.fixture(scope="module")
def model_path(embedded_model):
    return embedded_model("flash-next-tiny")


@pytest.fixture(scope="module", params=[1, 2], ids=lambda k: f"k{k}")
def llm(request, inproc, model_path, tmp_path_factory):
    spec = {"method": "mtp", "num_speculative_tokens": request.param}
    disk = tmp_path_factory.mktemp(f"mtp-disk-k{request.param}")
    # every committed link is written (no admission), so one run of A puts its chain on disk
    extra = {"grid": GRID, "disk_dir": str(disk), "disk_write_first_tokens": 0}
    with connector_engine(model_path, extra=extra, dtype="float32", speculative_config=spec,
                          disable_log_stats=False) as engine:
        instrument(engine)
        engine.k = request.param
        yield engine


def settle(llm) -> None:
    """Wait until the worker's disk writer has written (or skipped) everything handed to it."""
    _, worker = engine_parts(llm)
    deadline = time.monotonic() + 120
    while worker._writer is not None and not worker._writer.idle():
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
    return {int(p.stem.rsplit("-", 1)[1]): p for p in sched.disk.dir.dir.glob("*/*.link")
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
    h, base = read_header(path, fp)
    parts = {e.name: torch.empty(e.nbytes, dtype=torch.uint8) for e in h.parts}
    read_parts(path, h, base, parts)
    if hidden is not None and crc_ok:
        row = parts[DRAFT_INPUT].view(torch.float32)
        row.copy_(hidden(row))
    write_link_file(path, fingerprint=h.fingerprint, domain=h.domain, digest=h.digest,
                    parent_digest=h.parent_digest, start=h.start, end=h.end,
                    tokens=h.token_ids(), rows=h.rows, parts=parts, created=h.created,
                    kind=h.kind, tag=h.tag if tag == "keep" else tag)
    if hidden is not None and not crc_ok:
        entry = next(e for e in h.parts if e.name == DRAFT_INPUT)
        _, base2 = read_header(path, fp)
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


def test_links_written_on_the_mtp_route_restore_from_disk_equal_cold(llm, colds, a_files):
    sched, _ = engine_parts(llm)
    assert sched.base_domain["route"] == "mtp" and sched._draft_reads == "rebuild"
    assert sched.spill is None and sched.disk_anchors is None  # anchors stay off disk
    fp = sched.disk.dir.fingerprint
    for end, (path, _) in a_files.items():
        h, _ = read_header(path, fp)
        assert sched.disk.tags.decode(h.tag) == DraftStep(end - GRID)
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
    assert not list(sched.disk.dir.dir.glob("a-*/*.link"))  # no end anchor on disk
    assert sched.tree.stats().shortened == 0 and "draft_tag" not in disk_stats(llm).misses


def test_a_file_with_a_wrong_tag_is_a_counted_miss(llm, colds, a_files):
    if llm.k != 2:
        pytest.skip("negative controls: the k = 2 engine")
    sched, _ = engine_parts(llm)
    fp = sched.disk.dir.fingerprint
    got = put_a(llm, a_files)
    rewrite(got[2 * GRID], fp, tag=sched.disk.tags.encode(DraftStep(1)))
    misfit = disk_stats(llm).misses.get("draft_tag", 0)
    warm = run(llm, EXT)
    assert warm["cached"] == GRID                      # the chain ends before the 512 file
    assert disk_stats(llm).misses.get("draft_tag", 0) > misfit
    _same(warm, colds["ext"], "ext with a misfit file")
    # (a file without a tag serves nothing on this route: tests/core/test_core_disk_tags.py)


def test_a_corrupted_hidden_row_is_a_counted_miss_and_would_be_caught(llm, colds, a_files):
    if llm.k != 2:
        pytest.skip("negative controls: the k = 2 engine")
    sched, _ = engine_parts(llm)
    fp = sched.disk.dir.fingerprint
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
