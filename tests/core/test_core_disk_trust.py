"""The disk tier's trust boundary (issue 29): every file is authenticated, the folder is the
engine's own, no symlink is followed, and names reveal nothing without the disk key.

Each forgery here keeps every CRC valid: what the tier refused before the MACs was only
corruption, so each test also checks (a negative control) that the CRC alone would have
accepted the forged bytes.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from tests.keys import TEST_KEY, other_key, write_key_file
from vllm_hybridcache.core.auth import (
    KeyFileError,
    LinkKey,
    MacAlgorithm,
    load_key_file,
    preferred_mac,
)
from vllm_hybridcache.core.disk.directory import LinkDirectory
from vllm_hybridcache.core.disk.folder import UnsafeFolder, own_folder
from vllm_hybridcache.core.keys import PromptKeys
from vllm_hybridcache.core.linkformat import linkfile
from vllm_hybridcache.core.linkformat.crc import crc32
from vllm_hybridcache.core.linkformat.linkfile import (
    LinkFileError,
    LinkFileHeader,
    LinkFileProblem,
    read_header,
    read_parts,
)

FP = bytes(range(32))
DOM = b"D" * 32
OTHER_DOM = b"E" * 32
PROMPT = np.arange(1000, 1400, dtype=np.int64)
CUTS = [64, 128, 256]
_PRE = struct.Struct("<8sII32s")


def _dir(root: Path, key: LinkKey = TEST_KEY, **kw) -> LinkDirectory:
    d = LinkDirectory(root, FP, 1 << 30, key=key, **kw)
    d.open()
    return d


def _parts(end: int, rows: int) -> dict[str, torch.Tensor]:
    return {"state": torch.full((4, 4), float(end)),
            "kv": torch.arange(rows * 32, dtype=torch.int64).to(torch.uint8).reshape(rows, 32)}


def _write_chain(d: LinkDirectory, domain: bytes = DOM) -> list[Path]:
    keys = PromptKeys(PROMPT)
    start, paths = 0, []
    for end in CUTS:
        parts = _parts(end, (end - start) // 16)
        nbytes = sum(t.numel() * t.element_size() for t in parts.values())
        assert d.write(domain=domain, digest=keys.digest(end),
                       parent_digest=keys.digest(start) if start else b"", start=start, end=end,
                       tokens=keys.tokens[start:end], rows=(end - start) // 16, parts=parts,
                       nbytes=nbytes)
        paths.append(d.path_for(domain, end, keys.digest(end)))
        start = end
    return paths


def _lookup(d: LinkDirectory) -> list[int]:
    return [h.end for _, h, _ in d.lookup(PromptKeys(PROMPT), DOM, CUTS, 399)]


def forge_crc(data: bytearray, at: int, want: int) -> None:
    """Change the 4 bytes at `at` so that crc32(data) == want (CRC-32 is affine in the message
    bits: solve for those 32 bits over GF(2)). What anyone can do to a CRC-checked file."""
    data[at:at + 4] = b"\0\0\0\0"
    c0 = crc32(data)
    basis: dict[int, tuple[int, int]] = {}  # top bit -> (column combination, bits flipped)
    for i in range(32):
        t = bytearray(data)
        t[at + i // 8] ^= 1 << (i % 8)
        v, m = crc32(t) ^ c0, 1 << i
        for bit in reversed(range(32)):
            if v >> bit & 1:
                if bit not in basis:
                    basis[bit] = (v, m)
                    break
                v, m = v ^ basis[bit][0], m ^ basis[bit][1]
    target, x = want ^ c0, 0
    for bit in reversed(range(32)):
        if target >> bit & 1:
            target, x = target ^ basis[bit][0], x ^ basis[bit][1]
    for i in range(32):
        if x >> i & 1:
            data[at + i // 8] ^= 1 << (i % 8)
    assert crc32(data) == want


# ------------------------------------------------------------------ keys


def test_purposes_derive_apart_and_a_short_secret_is_refused():
    secret = b"0123456789abcdef0123"
    disk, cluster = LinkKey(secret, "disk"), LinkKey(secret, "cluster")
    assert disk.mac(b"x") == LinkKey(secret, "disk").mac(b"x")
    assert disk.mac(b"x") != cluster.mac(b"x") and disk.name(b"x") != cluster.name(b"x")
    assert disk.directory_key != cluster.directory_key
    assert disk.mac(b"x") != disk.mac(b"x", person=b"hc-other")
    with pytest.raises(KeyFileError):
        LinkKey(b"too short", "disk")


def test_a_missing_key_file_is_created_0600_once(tmp_path):
    path = tmp_path / "conf" / "disk.key"
    secret = load_key_file(path, create=True)
    assert len(secret) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_key_file(path, create=True) == secret  # not replaced
    with pytest.raises(FileNotFoundError):
        load_key_file(tmp_path / "absent.key")  # no create: never made up


def test_key_files_others_could_write_or_that_are_links_are_refused(tmp_path, caplog,
                                                                   monkeypatch):
    path = write_key_file(tmp_path / "k")
    os.chmod(path, 0o620)
    with pytest.raises(KeyFileError, match="writable by group or others"):
        load_key_file(path)
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="vllm_hybridcache"):
        load_key_file(path)  # readable by others: used, with a warning
    assert "readable by group or others" in caplog.text
    os.chmod(path, 0o600)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(KeyFileError, match="symlink"):
        load_key_file(link)
    if os.geteuid() == 0:
        os.chown(path, 12345, -1)
    else:  # the file is ours: make "us" someone else
        monkeypatch.setattr(os, "geteuid", lambda: 4242)
    with pytest.raises(KeyFileError, match="owned by uid"):
        load_key_file(path)
    (tmp_path / "short").write_bytes(b"abc\n")
    os.chmod(tmp_path / "short", 0o600)
    with pytest.raises(KeyFileError, match="at least"):
        load_key_file(tmp_path / "short")


# ------------------------------------------------------------------ the folder


def test_the_folder_is_created_0700_and_files_0600(tmp_path):
    root = tmp_path / "cache"
    d = _dir(root)
    paths = _write_chain(d)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for p in paths:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        assert stat.S_IMODE(p.parent.stat().st_mode) == 0o700  # the domain folder
        assert stat.S_IMODE(p.parent.parent.stat().st_mode) == 0o700  # the fingerprint's
    assert stat.S_IMODE((d.dir / ".in-use").stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_folder_others_can_write_stops_the_start_up(tmp_path, mode):
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(UnsafeFolder, match=f"chmod 700 {root}"):
        _dir(root)
    assert list(root.iterdir()) == []  # nothing was written into it
    os.chmod(root, 0o755)  # readable by others is allowed: everything inside is 0700/0600
    _write_chain(_dir(root))


def test_a_folder_of_another_owner_a_symlink_or_holding_the_key_is_refused(tmp_path,
                                                                          monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    link = tmp_path / "via-link"
    link.symlink_to(root)
    with pytest.raises(UnsafeFolder, match="is a symlink"):
        own_folder(link)
    with pytest.raises(UnsafeFolder, match="inside disk_dir"):
        own_folder(root, root / "keys" / "disk.key")
    own_folder(root, tmp_path / "disk.key")  # beside it: fine
    if os.geteuid() == 0:
        os.chown(root, 12345, -1)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: 4242)
    with pytest.raises(UnsafeFolder, match="owned by uid"):
        own_folder(root)


# ------------------------------------------------------------------ names


def test_names_are_keyed_digests_that_reveal_nothing_without_the_key(tmp_path):
    d = _dir(tmp_path / "a")
    paths = _write_chain(d)
    keys = PromptKeys(PROMPT)
    text = " ".join(str(p.relative_to(d.root)) for p in paths)
    for secret in (FP[:8].hex(), DOM[:8].hex(), *(keys.digest(c).hex()[:16] for c in CUTS)):
        assert secret not in text
    other = LinkDirectory(tmp_path / "b", FP, 1 << 30, key=other_key())
    assert other.path_for(DOM, 64, keys.digest(64)).relative_to(other.root) != \
        paths[0].relative_to(d.root)
    # two domains: two folders, no shared name
    assert d.path_for(OTHER_DOM, 64, keys.digest(64)).parent != paths[0].parent


# ------------------------------------------------------------------ forgeries


def test_a_file_from_another_installation_is_a_counted_miss_and_deleted(tmp_path):
    """Another installation (another disk key) wrote a valid chain; its files copied to the
    names this engine looks up are refused as unauthenticated, counted and deleted."""
    ours = _dir(tmp_path / "ours")
    theirs = _dir(tmp_path / "theirs", key=other_key())
    foreign = _write_chain(theirs)
    keys = PromptKeys(PROMPT)
    for src, end in zip(foreign, CUTS, strict=True):
        dst = ours.path_for(DOM, end, keys.digest(end))
        dst.parent.mkdir(mode=0o700, exist_ok=True)
        dst.write_bytes(src.read_bytes())
        with pytest.raises(LinkFileError) as e:
            read_header(dst, FP, TEST_KEY)
        assert e.value.problem is LinkFileProblem.UNAUTHENTICATED
        read_header(src, FP, theirs.key)  # negative control: the file itself is sound
    assert _lookup(ours) == []
    assert ours.stats.refused == {"unauthenticated": 3}  # each cut tried, each refused
    assert not any(ours.path_for(DOM, c, keys.digest(c)).exists() for c in CUTS)  # deleted


def test_a_header_forged_with_valid_crcs_is_refused(tmp_path):
    """Another prompt's tokens written into a valid file's header, the header's CRC-32 made
    valid again: before the MACs this was served as cold-exact for the other prompt."""
    d = _dir(tmp_path)
    path = _write_chain(d)[0]
    raw = path.read_bytes()
    magic, hlen, _, mac = _PRE.unpack(raw[:_PRE.size])
    h = msgspec.msgpack.decode(raw[_PRE.size:_PRE.size + hlen], type=LinkFileHeader)
    toks = h.token_ids().copy()
    toks[5] += 1
    forged = msgspec.msgpack.encode(msgspec.structs.replace(h, tokens=toks.tobytes()))
    assert len(forged) == hlen
    path.write_bytes(_PRE.pack(magic, hlen, zlib.crc32(forged), mac) + forged
                     + raw[_PRE.size + hlen:])
    with pytest.raises(LinkFileError) as e:
        read_header(path, FP, TEST_KEY)
    assert e.value.problem is LinkFileProblem.UNAUTHENTICATED
    assert zlib.crc32(forged) == struct.unpack("<8sII", path.read_bytes()[:16])[2]  # CRC ok


def test_a_part_forged_with_a_valid_crc_is_refused_before_use(tmp_path):
    """The state bytes of a sound file changed and 4 of them chosen so that the part's CRC-32
    is the header's again: the header (and its MAC) is the original's, the part's MAC fails."""
    d = _dir(tmp_path)
    path = _write_chain(d)[1]
    header, base = read_header(path, FP, TEST_KEY)
    entry = next(e for e in header.parts if e.name == "kv")
    raw = bytearray(path.read_bytes())
    part = bytearray(raw[base + entry.offset:base + entry.offset + entry.nbytes])
    part[10:40] = bytes(30)  # other state
    forge_crc(part, 60, entry.crc32)
    assert crc32(part) == entry.crc32  # negative control: a CRC check alone accepts it
    raw[base + entry.offset:base + entry.offset + entry.nbytes] = part
    path.write_bytes(bytes(raw))
    header, base = read_header(path, FP, TEST_KEY)  # the header is still the sound one
    dst = {"state": torch.empty(4, 4), "kv": torch.empty(4, 32, dtype=torch.uint8)}
    with pytest.raises(LinkFileError) as e:
        read_parts(path, header, base, dst, TEST_KEY)
    assert e.value.problem is LinkFileProblem.UNAUTHENTICATED


# ------------------------------------------------------------------ symlinks


def test_a_symlinked_link_file_is_refused_and_only_the_link_removed(tmp_path):
    d = _dir(tmp_path / "cache")
    paths = _write_chain(d)
    # a sound file of the same key and name elsewhere, linked in place of the deepest one
    elsewhere = tmp_path / "elsewhere.link"
    elsewhere.write_bytes(paths[2].read_bytes())
    paths[2].unlink()
    paths[2].symlink_to(elsewhere)
    assert _lookup(d) == [64, 128]  # the symlinked one is not read
    assert d.stats.refused == {"symlink": 1}
    assert not paths[2].is_symlink() and not paths[2].exists()
    assert elsewhere.exists()  # what it pointed to is untouched
    read_header(elsewhere, FP, TEST_KEY)  # negative control: followed, it would verify


def test_a_symlinked_domain_folder_is_refused_and_never_written_through(tmp_path):
    d = _dir(tmp_path / "cache")
    paths = _write_chain(d)
    folder = paths[0].parent
    moved = tmp_path / "moved"
    folder.rename(moved)
    folder.symlink_to(moved)  # the same files, reached through a link
    assert _lookup(d) == []
    assert d.stats.refused.get("symlink", 0) >= 1
    assert sorted(p.name for p in moved.iterdir()) == sorted(p.name for p in paths)  # intact
    again = _dir(tmp_path / "cache")  # the start-up scan refuses a planted link too
    assert not folder.is_symlink() or again.stats.refused.get("symlink", 0) >= 1
    _write_chain(again)  # a fresh folder is made in its place, the moved files untouched
    assert not again.dir.joinpath(folder.name).is_symlink()
    assert sorted(p.name for p in moved.iterdir()) == sorted(p.name for p in paths)


# ------------------------------------------------------------------ the two MAC algorithms


def test_the_mac_algorithm_follows_the_cpu():
    assert preferred_mac("flags\t: fpu sse2 avx2 sha_ni aes\n") is MacAlgorithm.HMAC_SHA256
    assert preferred_mac("Features\t: fp asimd aes sha1 sha2 crc32\n") is MacAlgorithm.HMAC_SHA256
    assert preferred_mac("flags\t: fpu sse2 avx2 avx512f aes\n") is MacAlgorithm.BLAKE2B
    assert preferred_mac("") is MacAlgorithm.BLAKE2B


@pytest.mark.parametrize("alg", list(MacAlgorithm), ids=lambda a: a.name.lower())
def test_files_of_either_algorithm_are_read_and_checked_by_any_reader(tmp_path, monkeypatch,
                                                                      alg):
    """A file names its MAC algorithm (magic and header): a reader that prefers the other one
    verifies it all the same, and a file whose magic claims the other algorithm (its MACs left
    as they are) is refused as unauthenticated, never read with the wrong construction."""
    monkeypatch.setattr(linkfile, "PREFERRED_MAC", alg)
    d = _dir(tmp_path)
    path = _write_chain(d)[1]
    raw = path.read_bytes()
    assert raw[7] == int(alg)
    header, base = read_header(path, FP, TEST_KEY)
    assert header.mac_alg == int(alg)
    dst = {"state": torch.empty(4, 4), "kv": torch.empty(4, 32, dtype=torch.uint8)}
    read_parts(path, header, base, dst, TEST_KEY)
    assert torch.equal(dst["state"], _parts(128, 4)["state"])
    other = next(a for a in MacAlgorithm if a is not alg)
    swapped = path.with_name("swapped.link")
    swapped.write_bytes(raw[:7] + bytes([int(other)]) + raw[8:])
    with pytest.raises(LinkFileError) as e:
        read_header(swapped, FP, TEST_KEY)
    assert e.value.problem is LinkFileProblem.UNAUTHENTICATED


# ------------------------------------------------------------------ names are not authenticated


def test_a_genuine_file_under_another_links_name_never_stitches_a_chain(tmp_path):
    """Whoever can write the folder can copy a sound file to another link's name. The root
    link [0, 64) copied to the name of the [64, 128) link made the [128, 256) link's parent a
    file ending at 64: a chain with the rows [64, 128) missing (the prompt's tokens there never
    compared) and another prefix's state. Each file must hold the very link its name was
    looked up for."""
    d = _dir(tmp_path)
    paths = _write_chain(d)
    paths[1].write_bytes(paths[0].read_bytes())  # genuine bytes, another link's name
    read_header(paths[1], FP, TEST_KEY)  # negative control: the file itself verifies
    assert _lookup(d) == [64]  # the sound chain only, no [0, 64) + [128, 256)
    keys = PromptKeys(PROMPT)
    # an end anchor's name holding another anchor of the domain is refused the same way
    assert d.lookup_anchor(keys, DOM, 399, [(256, keys.digest(128))]) is None


def test_a_file_swapped_after_the_lookup_is_refused_by_the_worker(tmp_path):
    """The worker reads a hit's files again: a file renamed or swapped in between the lookup
    and the read (another domain's genuine link of the same segment) is refused as
    `mismatch`, never restored as this prompt's state."""
    from vllm_hybridcache.core import LinkRef, LinkStore, StateLayout
    from vllm_hybridcache.core.layout import SectionSpec, ViewSpec
    from vllm_hybridcache.core.linkformat.reader import DiskReadError, SourceKey, stage_chain

    layout = StateLayout((SectionSpec("state", (4, 4), "float32"),),
                         (ViewSpec("kv", (32,), "uint8"),), view_block_tokens=16)
    d = _dir(tmp_path)
    ours = _write_chain(d)
    theirs = _write_chain(d, OTHER_DOM)
    keys = PromptKeys(PROMPT)
    refs = [LinkRef(1, 0, 64), LinkRef(2, 64, 128)]
    expect = [SourceKey("tree", DOM, keys.digest(64)), SourceKey("tree", DOM, keys.digest(128))]
    store = LinkStore(layout, pin_memory=False)
    stage_chain(store, refs, [str(p) for p in ours[:2]], FP, key=TEST_KEY, root=d.root,
                expect=expect)  # the files the lookup found: staged
    store.drop([1, 2])
    ours[1].write_bytes(theirs[1].read_bytes())  # swapped in after the lookup
    with pytest.raises(DiskReadError) as e:
        stage_chain(store, refs, [str(p) for p in ours[:2]], FP, key=TEST_KEY, root=d.root,
                    expect=expect)
    assert e.value.problem == "mismatch" and e.value.link_id == 2 and len(store) == 0
    # negative control: without the lookup's expectation the swapped file would be staged
    stage_chain(store, refs, [str(p) for p in ours[:2]], FP, key=TEST_KEY, root=d.root)


# ------------------------------------------------------------------ odd files


def test_short_and_oversized_preludes_and_fifos_are_refused_not_fatal(tmp_path):
    import threading

    d = _dir(tmp_path)
    paths = _write_chain(d)
    for raw, problem in ((b"HCLINK\x00", LinkFileProblem.NOT_A_LINK),
                         (b"HCLINK\x00\x03" + (1 << 31).to_bytes(4, "little") + bytes(36),
                          LinkFileProblem.FORMAT)):
        paths[0].write_bytes(raw)
        with pytest.raises(LinkFileError) as e:
            read_header(paths[0], FP, TEST_KEY)
        assert e.value.problem is problem
    # a FIFO under a link's name: neither the lookup nor a read of it blocks or reads it
    d2 = _dir(tmp_path / "fifo")
    paths = _write_chain(d2)
    paths[2].unlink()
    os.mkfifo(paths[2])
    done: list = []

    def probe() -> None:
        done.append(_lookup(d2))
        try:
            read_header(paths[2], FP, TEST_KEY)
        except LinkFileError as e:
            done.append(e.problem)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "blocked on a FIFO"
    assert done == [[64, 128], LinkFileProblem.SYMLINK]


def test_engines_creating_the_disk_key_at_once_agree_on_one(tmp_path):
    """Data-parallel ranks start together: every one of them creating the missing key file at
    the same moment reads the same complete secret (never an empty file half made)."""
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "conf" / "disk.key"
    with ThreadPoolExecutor(8) as pool:
        got = set(pool.map(lambda _: load_key_file(path, create=True), range(32)))
    assert len(got) == 1 and len(next(iter(got))) == 64
    assert [p.name for p in path.parent.iterdir()] == ["disk.key"]  # no temporary left


def test_a_key_file_replaced_after_the_start_is_refused_not_trusted(tmp_path):
    """The scheduler side reads the key at its start and sends its public id; a worker that
    reads the file later and finds another key refuses the work (a miss: nothing is deleted
    or invalidated because of it) instead of calling every file forged."""
    from vllm_hybridcache.core import auth
    from vllm_hybridcache.core.linkformat.reader import SourceOrigin

    path = write_key_file(tmp_path / "disk.key")
    started = auth.key_from_file(path, "disk")
    origin = SourceOrigin(FP, str(path), "disk", str(tmp_path), started.key_id)
    assert origin.key() is started
    write_key_file(path)  # replaced while the engine runs
    auth._KEYS.clear()  # a process that reads it only now
    with pytest.raises(KeyFileError, match="another key"):
        origin.key()
    assert auth.key_from_file(path, "disk").key_id != started.key_id  # control: it did change
