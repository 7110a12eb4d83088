"""Finding a link file by what it holds: file names are keyed digests (the disk key's,
core/disk/directory.py), so a test that wants "the link of these tokens at this cut" reads the
headers, verified under the tests' disk key (tests/keys.py, which the servers are given)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from tests.keys import TEST_KEY
from vllm_hybridcache.core.linkformat.linkfile import _PRE, TMP_PREFIX, LinkFileHeader, read_header


def header_of(path: Path) -> LinkFileHeader:
    """The verified header of a link file (its fingerprint taken from the file itself)."""
    raw = path.read_bytes()[:1 << 20]
    _, hlen, _, _ = _PRE.unpack(raw[:_PRE.size])
    fp = msgspec.msgpack.decode(raw[_PRE.size:_PRE.size + hlen], type=LinkFileHeader).fingerprint
    return read_header(path, fp, TEST_KEY)[0]


def link_file(folder: Path, digest: bytes, end: int, pattern: str = "*.link",
              kind: str = "tree") -> Path:
    """The one file under `folder` (matching `pattern`) whose header holds the link of kind
    `kind` and `digest` ending at `end`."""
    found = [p for p in folder.glob(pattern) if not p.name.startswith(TMP_PREFIX)
             and p.name.endswith(f"-{end}.link")
             and (h := header_of(p)).digest == digest and h.kind == kind]
    assert len(found) == 1, (folder, end, found)
    return found[0]
