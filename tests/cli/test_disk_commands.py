"""`vllm-hybridcache disk ls|stats|verify|prune|clear` on folders LinkDirectory really wrote
(no engine, no vLLM): what each command shows, what verify catches (a flipped byte in a part
and in a header, a file of another key, a cut file, a missing parent, a planted symlink), that
prune honours the budget and the TTL through LinkDirectory and leaves a sound folder, and the
refusals (a folder others may write or another user owns, a symlink, a missing folder or key,
an engine holding the folder for clear). Every check has its clean counterpart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.keys import KEY_FILE, TEST_KEY, other_key, write_key_file
from vllm_hybridcache.cli.tools import main
from vllm_hybridcache.core.disk.directory import LinkDirectory
from vllm_hybridcache.core.keys import PromptKeys
from vllm_hybridcache.core.linkformat.linkfile import ALIGN

ROOT = Path(__file__).resolve().parents[2]
FP = bytes(range(32))
FP_B = bytes(range(7, 39))
DOM_A = b"A" * 32
DOM_B = b"B" * 32
TOKEN_BASE = 4242424242420000  # 16 digits: never found by accident in sizes, ends or times
PROMPT = np.arange(TOKEN_BASE, TOKEN_BASE + 400, dtype=np.int64)
CUTS = [64, 128, 256]
DAY = 86400.0


def _parts(end: int, rows: int) -> dict[str, torch.Tensor]:
    return {"state": torch.full((16, 16), float(end)),
            "kv": torch.full((rows, 64), end % 251, dtype=torch.uint8)}


def _write_chain(d: LinkDirectory, domain: bytes, prompt=PROMPT, cuts=CUTS,
                 kind: str = "tree") -> None:
    keys = PromptKeys(prompt)
    start = 0
    for end in cuts:
        parts = _parts(end, (end - start) // 16)
        nbytes = sum(t.numel() * t.element_size() for t in parts.values())
        assert d.write(domain=domain, digest=keys.digest(end),
                       parent_digest=keys.digest(start) if start else b"", start=start,
                       end=end, tokens=keys.tokens[start:end], rows=(end - start) // 16,
                       parts=parts, nbytes=nbytes, kind=kind)
        if kind == "tree":
            start = end


def _engine(root: Path, fp: bytes = FP, key=TEST_KEY) -> LinkDirectory:
    """An engine's directory: open() holds the folder's .in-use lock until close()."""
    d = LinkDirectory(root, fp, 1 << 30, key=key)
    d.open()
    return d


@pytest.fixture
def cache(tmp_path) -> Path:
    """A folder with one fingerprint: two domains' chains of 3 tree links and an anchor."""
    root = tmp_path / "links"
    d = _engine(root)
    _write_chain(d, DOM_A)
    _write_chain(d, DOM_B, PROMPT + 1)
    _write_chain(d, DOM_A, PROMPT, [300], kind="anchor")
    d.sanity_check()
    d.close()
    return root


def run(capsys, *argv: str, key: bool = True) -> tuple[int, str, str]:
    args = ["disk", *argv] + (["--key-file", str(KEY_FILE)] if key else [])
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    rc, out, _err = run(capsys, *argv, "--json")
    return rc, json.loads(out)


def _links(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.link") if not p.name.startswith(".tmp-"))


def _path(root: Path, domain: bytes, prompt: np.ndarray, end: int, kind: str = "tree") -> Path:
    """Where LinkDirectory keeps the link of `prompt` at `end` (names are keyed digests)."""
    namer = LinkDirectory(root, FP, 1, key=TEST_KEY)
    return namer.path_for(domain, end, PromptKeys(prompt).digest(end), kind)


def _chain_b(root: Path) -> list[Path]:
    return [_path(root, DOM_B, PROMPT + 1, end) for end in CUTS]


def _by_end(root: Path, end: int, kind: str = "tree") -> list[Path]:
    return [p for p in _links(root) if p.name.endswith(f"-{end}.link")
            and p.parent.name.startswith("a-") == (kind == "anchor")]


# ---------------------------------------------------------------------------- ls and stats


def test_ls_shows_every_file_by_its_name_never_a_token_id(cache, capsys):
    files = _links(cache)
    assert len(files) == 7
    rc, out, _ = run(capsys, "ls", str(cache), key=False)  # ls reads names: no key needed
    assert rc == 0
    folder = files[0].parent.parent.name
    assert f"{folder}  7 files" in out and "idle" in out
    for p in files:  # the folder's name is <tenant digest>-<domain digest>
        tenant, domain = p.parent.name.removeprefix("a-").split("-")
        assert f"{tenant} {domain}" in out
    assert out.count("anchor ") == 1 and out.count("tree ") == 6
    assert "300" in out and "s ago" in out
    rc, doc = run_json(capsys, "ls", str(cache))
    (f,) = doc["folders"]
    assert {(e["kind"], e["end"]) for e in f["files"]} == {
        ("tree", 64), ("tree", 128), ("tree", 256), ("anchor", 300)}
    assert sum(e["nbytes"] for e in f["files"]) == sum(p.stat().st_size for p in files)
    assert f["fingerprint"] is None  # not known without reading headers
    # --tokens: each file's first position and token count, from its verified header
    rc, out, _ = run(capsys, "ls", str(cache), "--tokens")
    assert rc == 0 and FP.hex() in out
    rc, doc = run_json(capsys, "ls", str(cache), "--tokens")
    got = sorted((e["kind"], e["start"], e["tokens"]) for e in doc["folders"][0]["files"])
    assert got == sorted([("tree", 0, 64), ("tree", 64, 64), ("tree", 128, 128)] * 2
                         + [("anchor", 0, 300)])
    # never a token id, in any output of any command
    for argv in (("ls", str(cache), "--tokens"), ("ls", str(cache), "--tokens", "--json"),
                 ("stats", str(cache)), ("verify", str(cache), "--json")):
        _, text, _ = run(capsys, *argv)
        assert str(TOKEN_BASE)[:10] not in text, argv
    # the control: the token ids are in the files, so the check above could see them
    assert any(PROMPT[:1].tobytes() in p.read_bytes() for p in files)


def test_stats_totals_per_fingerprint_folder(tmp_path, capsys):
    root = tmp_path / "links"
    a = _engine(root)
    _write_chain(a, DOM_A)
    b = _engine(root, FP_B)  # a holds its folder: b's start-up sweep keeps it
    _write_chain(b, DOM_A, cuts=[64])
    _write_chain(b, DOM_B, cuts=[64])
    b.close()
    rc, doc = run_json(capsys, "stats", str(root))
    assert rc == 0
    rows = {r["folder"]: r for r in doc["folders"]}
    assert rows[a.dir.name]["files"] == 3 and rows[a.dir.name]["in_use"] is True
    assert rows[b.dir.name]["files"] == 2 and rows[b.dir.name]["in_use"] is False
    assert rows[b.dir.name]["domains"] == 2 and rows[a.dir.name]["domains"] == 1
    for d in (a, b):
        assert rows[d.dir.name]["bytes"] == sum(p.stat().st_size for p in _links(d.dir))
    assert doc["total"]["files"] == 5
    rc, out, _ = run(capsys, "stats", str(root))
    assert f"{a.dir.name} (in use)" in out and f"{b.dir.name} (idle)" in out
    rc, doc = run_json(capsys, "stats", str(root), "--fingerprint", b.dir.name)
    assert [r["folder"] for r in doc["folders"]] == [b.dir.name]
    # a full fingerprint (64 hex, as the engine logs it) names its folder through the key
    rc, doc = run_json(capsys, "stats", str(root), "--fingerprint", FP_B.hex())
    assert rc == 0 and [r["folder"] for r in doc["folders"]] == [b.dir.name]
    a.close()


# ---------------------------------------------------------------------------- verify


def test_verify_passes_a_sound_folder(cache, capsys):
    rc, out, _ = run(capsys, "verify", str(cache))
    assert rc == 0, out
    assert f"fingerprint {FP.hex()}" in out and "  7 ok" in out
    assert "verify: 0 problem(s)" in out


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


def test_verify_catches_a_flipped_byte_in_a_part_and_in_a_header(cache, capsys):
    part_file = _by_end(cache, 256)[0]
    _flip(part_file, part_file.stat().st_size - 1)  # the last part's last byte
    header_file = _by_end(cache, 300, "anchor")[0]
    _flip(header_file, 60)  # inside the header (the prelude is 48 bytes)
    rc, doc = run_json(capsys, "verify", str(cache))
    assert rc == 1
    found = {(p["rel"].rsplit("/", 1)[1], p["problem"]) for p in doc["folders"][0]["problems"]}
    assert found == {(part_file.name, "checksum"), (header_file.name, "checksum")}
    assert doc["problems"] == 2 and doc["folders"][0]["counts"]["ok"] == 5
    # verify only reports: the files are still there (an engine or prune deletes them)
    assert part_file.exists() and header_file.exists()
    rc, out, _ = run(capsys, "verify", str(cache))
    assert rc == 1 and "checksum" in out and part_file.name in out and "part kv" in out
    # --delete: what an engine does with each one it meets
    rc, doc = run_json(capsys, "verify", str(cache), "--delete")
    assert rc == 1 and doc["folders"][0]["deleted"] == 2
    assert not part_file.exists() and not header_file.exists() and len(_links(cache)) == 5
    rc, _, _ = run(capsys, "verify", str(cache))
    assert rc == 0


def test_verify_catches_a_part_altered_with_its_crc_kept(cache, capsys):
    """What anyone can do to a CRC-checked file: XOR the CRC-32 polynomial into a part (its
    CRC stays the same). Only the part's MAC, which needs the disk key, can tell."""
    from vllm_hybridcache.core.linkformat.crc import crc32
    from vllm_hybridcache.core.linkformat.linkfile import read_header

    path = _by_end(cache, 128)[0]
    header, base = read_header(path, FP, TEST_KEY)
    kv = next(e for e in header.parts if e.name == "kv")
    raw = bytearray(path.read_bytes())
    at = base + kv.offset + 8
    before = crc32(raw[base + kv.offset:base + kv.offset + kv.nbytes])
    for i, b in enumerate((0x1DB710641).to_bytes(5, "little")):
        raw[at + i] ^= b
    assert crc32(raw[base + kv.offset:base + kv.offset + kv.nbytes]) == before  # CRC kept
    path.write_bytes(bytes(raw))
    rc, doc = run_json(capsys, "verify", str(cache))
    assert rc == 1
    (bad,) = [p for p in doc["folders"][0]["problems"] if p["problem"] != "orphan"]
    assert bad["problem"] == "unauthenticated" and bad["detail"] == "part kv"
    assert bad["rel"].endswith(path.name)


def test_verify_catches_a_file_of_another_key(cache, tmp_path, capsys):
    # another installation's file, copied over one of ours under our name: its CRCs hold,
    # its MACs do not
    theirs = tmp_path / "theirs"
    d = _engine(theirs, key=other_key())
    _write_chain(d, DOM_A)
    d.close()
    ours = _by_end(cache, 64)[0]
    ours.write_bytes(_by_end(theirs, 64)[0].read_bytes())
    rc, doc = run_json(capsys, "verify", str(cache))
    assert rc == 1
    problems = {(p["rel"].rsplit("/", 1)[1], p["problem"]) for p in doc["folders"][0]["problems"]}
    # its children (the chain above it) can no longer serve: orphans
    assert (ours.name, "unauthenticated") in problems
    assert {pr for _, pr in problems} == {"unauthenticated", "orphan"}
    assert sum(1 for _, pr in problems if pr == "orphan") == 2
    # the other installation's whole folder, verified with our key: nothing is ours
    rc, doc = run_json(capsys, "verify", str(theirs))
    assert rc == 1 and doc["folders"][0]["fingerprint"] is None
    assert {p["problem"] for p in doc["folders"][0]["problems"]} == {"unauthenticated"}


def test_verify_catches_truncated_files_orphans_and_symlinks(cache, tmp_path, capsys):
    cut = _by_end(cache, 300, "anchor")[0]
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size - ALIGN)
    root_of_b = _chain_b(cache)[0]
    root_of_b.unlink()  # B's chain loses its root: its two links above are orphans
    secret = tmp_path / "outside.link"
    secret.write_bytes(b"not to be read")
    os.symlink(secret, _by_end(cache, 128)[0].parent / "planted.link")
    rc, doc = run_json(capsys, "verify", str(cache))
    assert rc == 1
    counts = doc["folders"][0]["counts"]
    assert counts == {"ok": 3, "truncated": 1, "orphan": 2, "symlink": 1}, counts
    assert secret.read_bytes() == b"not to be read" and secret.exists()


def test_verify_reports_an_unknown_fingerprint_and_a_misplaced_file(cache, capsys):
    # an authentic file moved into a folder not named for its fingerprint
    folder = _links(cache)[0].parent.parent
    other = cache / "0123456789abcdef"
    (other / "dd").mkdir(parents=True, mode=0o700)
    (other / ".in-use").touch(mode=0o600)
    moved = _by_end(cache, 64)[0]
    (other / "dd" / moved.name).write_bytes(moved.read_bytes())
    rc, doc = run_json(capsys, "verify", str(cache))
    rows = {r["folder"]: r for r in doc["folders"]}
    assert rc == 1 and rows[folder.name]["problems"] == []
    assert rows[other.name]["fingerprint"] is None
    assert [p["problem"] for p in rows[other.name]["problems"]] == ["mismatch"]


# ---------------------------------------------------------------------------- prune


def _age(paths: list[Path], days: float) -> None:
    t = os.stat(paths[0]).st_mtime - days * DAY
    for p in paths:
        os.utime(p, (t, t))


def test_prune_applies_the_ttl_to_unused_files_and_their_chains(cache, capsys):
    old_b = _chain_b(cache)
    assert all(p.exists() for p in old_b)
    _age(old_b, 10)
    # the control: a TTL longer than their age keeps everything
    rc, doc = run_json(capsys, "prune", str(cache), "--ttl", "30d")
    assert rc == 0 and doc["folders"][0]["expired"] == 0 and len(_links(cache)) == 7
    rc, doc = run_json(capsys, "prune", str(cache), "--ttl", "7d")
    assert rc == 0
    row = doc["folders"][0]
    assert row["expired"] == 3 and row["files_after"] == 4 and row["in_use"] is False
    assert not any(p.exists() for p in old_b)
    assert len(_links(cache)) == 4
    rc, _, _ = run(capsys, "verify", str(cache))
    assert rc == 0


def test_prune_honours_the_budget_leaf_first(cache, capsys):
    total = sum(p.stat().st_size for p in _links(cache))
    rc, doc = run_json(capsys, "prune", str(cache), "--budget", str(total))
    assert rc == 0 and doc["folders"][0]["evicted"] == 0 and len(_links(cache)) == 7
    budget = total // 2
    budget -= budget % 1024
    rc, out, _ = run(capsys, "prune", str(cache), "--budget", f"{budget // 1024}KiB")
    assert rc == 0 and "evicted (budget)" in out
    left = _links(cache)
    assert 0 < sum(p.stat().st_size for p in left) <= budget
    # leaves went first: what is left is whole chains (verify finds no orphan)
    rc, doc = run_json(capsys, "verify", str(cache))
    assert rc == 0 and doc["folders"][0]["counts"] == {"ok": len(left)}


def test_prune_deletes_what_an_engine_start_would(cache, capsys):
    part_file = _by_end(cache, 128)[0]
    _flip(part_file, 60)  # a damaged header: prune (scan) deletes it and the link above it
    rc, doc = run_json(capsys, "prune", str(cache))
    row = doc["folders"][0]
    assert rc == 0 and row["refused"] == {"checksum": 1} and row["orphans"] == 1
    assert row["files_after"] == 5
    rc, _, _ = run(capsys, "verify", str(cache))
    assert rc == 0


def test_prune_runs_beside_an_engine_and_clear_waits_for_it(cache, capsys):
    engine = _engine(cache)  # holds the folder shared, like a running server
    try:
        total = sum(p.stat().st_size for p in _links(cache))
        rc, doc = run_json(capsys, "prune", str(cache), "--budget", str(total // 2))
        assert rc == 0 and doc["folders"][0]["in_use"] is True
        assert doc["folders"][0]["evicted"] > 0
        kept = _links(cache)
        rc, _out, err = run(capsys, "clear", str(cache))
        assert rc == 2 and "an engine holds" in err and "cache clear URL --tier disk" in err
        assert _links(cache) == kept  # nothing deleted
        rc, doc = run_json(capsys, "clear", str(cache), "--force")
        assert rc == 0 and doc["folders"][0]["removed"] is False
        assert doc["folders"][0]["files"] == len(kept) and _links(cache) == []
        assert engine.dir.is_dir() and (engine.dir / ".in-use").exists()  # the engine's own
        # the engine keeps working on its folder
        _write_chain(engine, DOM_A, cuts=[64])
        assert len(_links(cache)) == 1
    finally:
        engine.close()
    rc, doc = run_json(capsys, "clear", str(cache))
    assert rc == 0 and doc["folders"][0]["removed"] is True
    assert not engine.dir.exists()


def test_clear_one_fingerprint_or_one_kind(tmp_path, capsys):
    root = tmp_path / "links"
    a = _engine(root)
    _write_chain(a, DOM_A)
    _write_chain(a, DOM_A, cuts=[300], kind="anchor")
    b = _engine(root, FP_B)
    _write_chain(b, DOM_B, cuts=[64])
    a.close()
    b.close()
    rc, doc = run_json(capsys, "clear", str(root), "--kind", "anchor")
    assert rc == 0 and sorted(r["files"] for r in doc["folders"]) == [0, 1]
    assert len(_links(a.dir)) == 3 and len(_links(b.dir)) == 1
    rc, _ = run_json(capsys, "clear", str(root), "--fingerprint", b.dir.name)
    assert rc == 0 and not b.dir.exists() and len(_links(a.dir)) == 3
    rc, _out, err = run(capsys, "clear", str(root), "--fingerprint", "feedfacefeedface")
    assert rc == 2 and "no fingerprint folder" in err and a.dir.name in err
    # a folder without .in-use is no engine's: left alone
    stray = root / "notacachefolder"
    stray.mkdir()
    rc, doc = run_json(capsys, "clear", str(root))
    assert rc == 0 and stray.is_dir() and not a.dir.exists()


def test_clear_needs_no_key_for_a_whole_folder(cache, tmp_path, capsys):
    """A lost key is when a clear is needed most: every file is then refused anyway."""
    missing = tmp_path / "no.key"
    rc = main(["disk", "clear", str(cache), "--key-file", str(missing)])
    capsys.readouterr()
    assert rc == 0 and _links(cache) == [] and not missing.exists()


# ---------------------------------------------------------------------------- refusals


def test_a_folder_others_may_write_or_another_user_owns_is_refused(cache, capsys,
                                                                   monkeypatch):
    before = _links(cache)
    os.chmod(cache, 0o770)
    for cmd in ("ls", "verify", "prune", "clear"):
        rc, _, err = run(capsys, cmd, str(cache))
        assert rc == 2 and "writable by group or others" in err and "chmod 700" in err, cmd
    assert _links(cache) == before
    os.chmod(cache, 0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    rc, _, err = run(capsys, "clear", str(cache))
    assert rc == 2 and "owned by uid" in err and _links(cache) == before
    monkeypatch.undo()
    rc, _, _ = run(capsys, "verify", str(cache))  # the control: the same folder, accepted
    assert rc == 0


def test_a_symlinked_missing_or_keyless_folder_is_refused(cache, tmp_path, capsys):
    link = tmp_path / "link-to-cache"
    os.symlink(cache, link)
    rc, _, err = run(capsys, "clear", str(link))
    assert rc == 2 and "symlink" in err and len(_links(cache)) == 7
    missing = tmp_path / "nothing-here"
    rc, _, err = run(capsys, "ls", str(missing))
    assert rc == 2 and "no such folder" in err and not missing.exists()
    no_key = tmp_path / "keys" / "disk.key"
    rc = main(["disk", "verify", str(cache), "--key-file", str(no_key)])
    err = capsys.readouterr().err
    assert rc == 2 and "no disk key" in err and not no_key.exists()
    inside = write_key_file(cache / "disk.key")
    rc = main(["disk", "verify", str(cache), "--key-file", str(inside)])
    assert rc == 2 and "inside disk_dir" in capsys.readouterr().err
    inside.unlink()
    loose = write_key_file(tmp_path / "loose.key")
    os.chmod(loose, 0o622)
    rc = main(["disk", "verify", str(cache), "--key-file", str(loose)])
    assert rc == 2 and "writable by group or others" in capsys.readouterr().err


def test_dir_and_key_default_to_the_engine_settings(cache, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_HYBRIDCACHE_DISK_DIR", str(cache))
    monkeypatch.setenv("VLLM_HYBRIDCACHE_DISK_KEY_FILE", str(KEY_FILE))
    rc = main(["disk", "verify"])
    assert rc == 0 and "0 problem(s)" in capsys.readouterr().out
    monkeypatch.delenv("VLLM_HYBRIDCACHE_DISK_DIR")
    rc = main(["disk", "verify"])
    assert rc == 2 and "VLLM_HYBRIDCACHE_DISK_DIR" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["prune", "--budget", "12XB"], "unknown unit 'XB'"),
    (["prune", "--budget", "12G"], "ambiguous"),
    (["prune", "--ttl", "soon"], "must be a duration"),
    (["clear", "--kind", "leaf"], "invalid choice"),
    (["defrag"], "invalid choice"),
])
def test_argument_errors(argv, message, cache, capsys):
    with pytest.raises(SystemExit) as e:
        main(["disk", *argv[:1], str(cache), *argv[1:]])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert len(_links(cache)) == 7


def test_the_disk_commands_import_no_vllm(cache):
    code = ("import sys\nfrom vllm_hybridcache.cli.tools import main\n"
            f"rc = main(['disk', 'verify', {str(cache)!r}, '--key-file', {str(KEY_FILE)!r}])\n"
            "assert 'vllm' not in sys.modules, 'vllm imported'\nsys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "0 problem(s)" in r.stdout


def _sharded(root: Path, world: int = 2) -> list[LinkDirectory]:
    """A TP = `world` engine's folders: each rank wrote its own file of every link."""
    from vllm_hybridcache.core.linkformat.shard import Shard

    out = []
    for rank in range(world):
        d = LinkDirectory(root, FP, 1 << 30, key=TEST_KEY, shard=Shard(rank, world))
        d.open()
        _write_chain(d, DOM_A)
        d.close()
        out.append(d)
    return out


def test_a_tensor_parallel_engine_s_rank_folders_are_listed_verified_and_cleared(tmp_path,
                                                                                    capsys):
    """TP > 1 (core/disk/sharded.py): each rank's folder below the fingerprint's is a folder
    of its own for ls, verify and prune; a rank's file moved into another rank's folder is
    refused as foreign (its header names its rank); clear takes the fingerprint folder whole."""
    root = tmp_path / "links"
    ranks = _sharded(root)
    rc, out = run_json(capsys, "ls", str(root))
    assert rc == 0
    labels = [f["folder"] for f in out["folders"]]
    assert labels == [f"{ranks[0].home.name}/shard-0-of-2", f"{ranks[0].home.name}/shard-1-of-2"]
    assert [len(f["files"]) for f in out["folders"]] == [3, 3]
    rc, out = run_json(capsys, "verify", str(root))
    assert rc == 0 and out["problems"] == 0
    assert {f["fingerprint"] for f in out["folders"]} == {FP.hex()}
    rc, out = run_json(capsys, "prune", str(root), "--budget", "1GiB")
    assert rc == 0 and all(f["files_after"] == 3 for f in out["folders"])
    # negative control: rank 0's root link copied over rank 1's
    keys = PromptKeys(PROMPT)
    mine = ranks[0].path_for(DOM_A, 64, keys.digest(64))
    theirs = ranks[1].path_for(DOM_A, 64, keys.digest(64))
    theirs.write_bytes(mine.read_bytes())
    rc, out = run_json(capsys, "verify", str(root))
    assert rc != 0
    problems = {(f["folder"].rsplit("/", 1)[1], p["problem"])
                for f in out["folders"] for p in f["problems"]}
    assert ("shard-1-of-2", "foreign") in problems
    assert not any(s == "shard-0-of-2" for s, _ in problems)
    rc, _, _ = run(capsys, "clear", str(root))
    assert rc == 0 and not ranks[0].home.exists()
