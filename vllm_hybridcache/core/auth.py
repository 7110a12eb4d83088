"""Secrets that authenticate what crosses the process boundary: link files and cluster payloads.

Why: a link file (disk tier) or payload (cluster tier) is restored into an engine as state it
did not compute. A CRC-32 catches corruption but anyone can compute one, so a forged file with
valid CRCs would be served as cold-exact (a wrong token). Every link file therefore carries
MACs keyed by a secret the operator controls, over its header and over each part
(core/linkformat/linkfile.py; the two constructions are below). A reader without the secret cannot
produce a file the engine accepts, and names derived from the secret (`LinkKey.name`) let
nobody without it find or enumerate another domain's links.

One secret serves several purposes, each with its own derived key (`LinkKey(secret, purpose)`
for "disk" and "cluster"; inside it "mac", "name" and "directory"), so a key handed to one
party (the cluster directory actor holds only the "directory" key) opens nothing else.

Two MAC constructions (`MacAlgorithm`), both with their own derived key, both computed by C
code that releases the GIL, so the disk reads' helper threads check parts in parallel:
HMAC-SHA256 (OpenSSL) where the CPU has SHA instructions (x86 `sha_ni`, Arm `sha2`: every
AMD Zen, Intel since Ice Lake), about 1.5x keyed BLAKE2b's rate there; keyed BLAKE2b-256
elsewhere, where it is about twice HMAC-SHA256's. A file names its algorithm (the magic's last
byte, repeated in the authenticated header), so a reader accepts both whatever it prefers.

Key files (`load_key_file`): the secret is the file's content (surrounding whitespace
stripped), at least MIN_SECRET_BYTES long. A file that another user owns or that group/other
may write is refused (whoever can write it can forge every link); one that group/other may
read is used with a warning. `load_key_file(create=True)` creates a missing file with 32
random bytes (hex), mode 0600, atomically (O_EXCL: two engines starting together agree on one
key) and without following a symlink. Pure: no vLLM, no torch.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
from enum import IntEnum
from pathlib import Path
from typing import Protocol

__all__ = ["MAC_BYTES", "MIN_SECRET_BYTES", "PREFERRED_MAC", "KeyFileError", "LinkKey",
           "MacAlgorithm", "PartMac", "key_from_file", "load_key_file", "new_secret",
           "preferred_mac"]

logger = logging.getLogger("vllm_hybridcache")

MAC_BYTES = 32
MIN_SECRET_BYTES = 16
_MAX_KEY = 64  # BLAKE2b's key size limit; longer secrets are hashed down first


class MacAlgorithm(IntEnum):
    """How a link file's MACs are computed (the value is the file magic's last byte)."""

    BLAKE2B = 2       # keyed BLAKE2b-256
    HMAC_SHA256 = 3   # HMAC-SHA256


def preferred_mac(cpuinfo: str | None = None) -> MacAlgorithm:
    """The faster MAC on this CPU (module docstring): HMAC-SHA256 with SHA instructions."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read(1 << 16)
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[-1].split())
            return (MacAlgorithm.HMAC_SHA256 if flags & {"sha_ni", "sha2"}
                    else MacAlgorithm.BLAKE2B)
    return MacAlgorithm.BLAKE2B


PREFERRED_MAC = preferred_mac()


class PartMac(Protocol):
    """An incremental MAC: `update` per chunk, `digest` at the end."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def digest(self) -> bytes: ...


class _HmacPart:
    """An incremental HMAC-SHA256 of one part, personalised like the BLAKE2b MACs."""

    __slots__ = ("_h",)

    def __init__(self, key: bytes, person: bytes) -> None:
        self._h = hmac.new(key, person + b"\0", "sha256")

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()


class KeyFileError(ValueError):
    """A key file that must not be used (its path and the fix are in the message)."""


def _derive(secret: bytes, label: str) -> bytes:
    key = secret if len(secret) <= _MAX_KEY else hashlib.blake2b(secret).digest()
    return hashlib.blake2b(label.encode(), key=key, digest_size=MAC_BYTES,
                           person=b"hybridcache-kdf").digest()


class LinkKey:
    """The keys derived from one secret for one purpose ("disk" or "cluster").

    `mac(*chunks)`: a MAC over the concatenation (header MACs); `part_mac()`: an incremental
    MAC object for one part's bytes (update per chunk, as the direct reads stream); both with
    `alg` (default: this CPU's preferred MacAlgorithm); `name(...)`:
    a keyed digest for a file or directory name; `directory_key`: the key the cluster
    directory actor authenticates its callers with (it holds nothing else). `key_id` is a
    public 8-byte commitment to the secret, for log lines that must say which key is in use.
    """

    __slots__ = ("_mac", "_name", "directory_key", "key_id", "purpose")

    def __init__(self, secret: bytes, purpose: str) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise KeyFileError(f"a {purpose} secret must hold at least {MIN_SECRET_BYTES} bytes")
        self.purpose = purpose
        self._mac = {alg: _derive(secret, f"{purpose}/mac" + ("" if alg is MacAlgorithm.BLAKE2B
                                                              else f"/{alg.name.lower()}"))
                     for alg in MacAlgorithm}
        self._name = _derive(secret, f"{purpose}/name")
        self.directory_key = _derive(secret, f"{purpose}/directory")
        self.key_id = _derive(secret, f"{purpose}/id")[:8].hex()

    def _new(self, person: bytes, alg: MacAlgorithm | None) -> PartMac:
        alg = PREFERRED_MAC if alg is None else MacAlgorithm(alg)
        if alg is MacAlgorithm.HMAC_SHA256:
            return _HmacPart(self._mac[alg], person)
        return hashlib.blake2b(key=self._mac[alg], digest_size=MAC_BYTES, person=person)

    def mac(self, *chunks: bytes | memoryview, person: bytes = b"hc-header",
            alg: MacAlgorithm | None = None) -> bytes:
        h = self._new(person, alg)
        for c in chunks:
            h.update(c)
        return h.digest()

    def part_mac(self, alg: MacAlgorithm | None = None) -> PartMac:
        """A fresh MAC of one part (`.update(bytes)` per chunk, `.digest()` at the end).
        The hash runs in C without the GIL on large updates: helper threads verify in
        parallel."""
        return self._new(b"hc-part", alg)

    def name(self, *fields: bytes, size: int = 16) -> str:
        """Hex of a keyed digest of `fields` (length-prefixed, so field boundaries count)."""
        h = hashlib.blake2b(key=self._name, digest_size=size, person=b"hc-name")
        for f in fields:
            h.update(len(f).to_bytes(4, "little"))
            h.update(f)
        return h.hexdigest()

    @staticmethod
    def equal(a: bytes, b: bytes) -> bool:
        """Constant-time comparison of two MACs."""
        return hmac.compare_digest(a, b)


def new_secret() -> bytes:
    """A fresh secret as a key file holds it: 32 random bytes, hex."""
    return secrets.token_hex(32).encode()


def _check_owner_mode(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"key file {path} is not a regular file")
    if st.st_uid not in (os.geteuid(), 0):
        raise KeyFileError(f"key file {path} is owned by uid {st.st_uid}, not by this user "
                           f"({os.geteuid()}): whoever owns it can forge links. "
                           f"Fix: chown it, or point the setting at a file of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KeyFileError(f"key file {path} is writable by group or others (mode "
                           f"{stat.S_IMODE(st.st_mode):04o}): fix with `chmod 600 {path}`")
    if st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("hybridcache: key file %s is readable by group or others (mode %04o); "
                       "anyone who reads it can forge links: `chmod 600 %s`", path,
                       stat.S_IMODE(st.st_mode), path)


def _create_key_file(path: Path) -> None:
    """A new key file at `path`, complete before anyone can see it: the secret is written and
    fsynced under a temporary name, then linked to `path` (`link` fails when the name exists:
    another engine starting at the same moment created it first, and both use that one)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        try:
            os.write(fd, new_secret() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path, follow_symlinks=False)
        except FileExistsError:
            return
        logger.info("hybridcache: created key file %s (mode 0600)", path)
    finally:
        tmp.unlink(missing_ok=True)


def load_key_file(path: Path, *, create: bool = False) -> bytes:
    """The secret held by `path` (see the module docstring for the checks).

    create: a missing file is created (its folder too, mode 0700) with a new secret, mode 0600.
    Raises KeyFileError for a file that must not be used, OSError when it cannot be read or
    created.
    """
    path = Path(path).expanduser()
    # O_NONBLOCK: a FIFO under the key's name never blocks the start (it is refused below)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        if not create:
            raise
        _create_key_file(path)
        return load_key_file(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise KeyFileError(f"key file {path} is a symlink; give the file itself") from e
        raise
    try:
        _check_owner_mode(path, os.fstat(fd))
        data = b""
        while chunk := os.read(fd, 1 << 16):
            data += chunk
            if len(data) > 1 << 20:
                raise KeyFileError(f"key file {path} is larger than 1 MiB")
    finally:
        os.close(fd)
    secret = data.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise KeyFileError(f"key file {path} holds {len(secret)} bytes; a secret needs at "
                           f"least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32 > {path}`)")
    return secret


_KEYS: dict[tuple[str, str], LinkKey] = {}
_KEYS_LOCK = threading.Lock()


def key_from_file(path: str | Path, purpose: str, *, create: bool = False,
                  expect_id: str = "") -> LinkKey:
    """The LinkKey of `purpose` from the key file at `path`, read once per process (a worker
    asks for it with every staged load; a new key takes a restart).

    expect_id: the `key_id` the process that planned the work read (the scheduler side, at
    its start). Processes read the file at different times; a file replaced in between would
    make every file the other one wrote look forged. A mismatch raises KeyFileError, so the
    work fails (a miss) and nothing is deleted or invalidated for it."""
    ident = (os.path.abspath(Path(path).expanduser()), purpose)
    with _KEYS_LOCK:
        key = _KEYS.get(ident)
        if key is None:
            key = _KEYS[ident] = LinkKey(load_key_file(Path(ident[0]), create=create), purpose)
    if expect_id and key.key_id != expect_id:
        raise KeyFileError(f"the {purpose} key file {ident[0]} holds another key (id "
                           f"{key.key_id}) than the engine started with ({expect_id}); "
                           "restart the engine after changing a key")
    return key
