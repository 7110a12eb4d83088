"""`vllm-hybridcache disk ls|stats|verify|prune|clear [DIR]`: a disk tier's folder, offline.

Why: the disk tier's folder (`disk_dir`, docs/disk-tier.md) outlives every engine, and an
operator needs to see what it holds, prove it sound, shrink it and empty it without starting a
vLLM engine. The commands work on the files alone, through the project's own code: names and
folders as `LinkDirectory` makes them (core/disk/directory.py), headers and parts checked by
`read_header`/`read_parts` (core/linkformat/linkfile.py: every CRC-32 and MAC), eviction and TTL by
`LinkDirectory.scan`/`evict`, the folder rules of `own_folder` (core/disk/folder.py). No vLLM
is imported.

Layout reminder: `DIR/<F>/<T>-<D>/<N>-<end>.link` (tree links) and `DIR/<F>/a-<T>-<D>/...`
(spilled end anchors); F, T, D and N are digests keyed by the disk key (of the fingerprint, the
domain's tenant, the domain, the link), so they reveal no fingerprint, tenant or prompt. The
commands print F, T and D as they are (digests), never a token id; a file's token count only
with `ls --tokens`.

The fingerprint of a folder is not known offline (it is computed from the engine's weights and
settings): it is read from the folder's files, from a header whose MAC verifies under the disk
key and whose fingerprint's keyed name is the folder's name (a header of another key, or a file
moved in from another folder, does not qualify). A folder without one has no known fingerprint:
`verify` reports its files, `prune` leaves it alone, `clear` can still remove it.

`verify` reads every byte (every part's CRC-32 and MAC, as a restore would) and only reports,
unless `--delete`; `prune` reads headers only (as an engine's start-up scan does), so it
deletes a damaged header but not a damaged part, which a restore would find.

Safety:
- DIR must be the caller's own folder, not writable by group or others, not a symlink
  (`own_folder`'s rules, the engine's own); it is never created. Nothing below it is followed
  through a symlink (every file is opened from the folder's descriptor, core/linkformat/safeio.py).
- `prune` may run while engines use the folder: it does what one more engine sharing the
  folder does (several engines share one folder by design: a file deleted under an engine is a
  counted miss, never a wrong token). It holds the folder's `.in-use` lock shared while it
  works (exclusive when no engine holds it), so no engine's start-up sweep removes the folder
  under it. A running engine's index still counts the pruned files until its lookups miss them
  or it restarts: its gauges overstate, and its writer may evict up to that many bytes more.
- `clear` refuses a folder an engine holds (its `.in-use` lock, probed like the engine's own
  sweep does): a running engine's queued writes would land after it, and its index would
  still list the files. Clear a running server with `vllm-hybridcache cache clear URL --tier
  disk` instead (the engine then drops its index and its queued writes too), or stop it, or
  pass `--force` (the files are deleted, the folder and its lock stay).

The disk key (`--key-file`, else `VLLM_HYBRIDCACHE_DISK_KEY_FILE`, else the default path of
config.CacheSettings.disk_key_path) is read only by the commands that check files (`verify`,
`prune`, `ls --tokens`, `clear --kind` or `--force`); it is never created here: a new key
would make every file unauthenticated.

Exit codes: 0 done (verify: every file sound); 1 verify found problems; 2 a usage error or a
refusal (the folder, the key, an engine holding the folder for `clear`).

Why one module over ~500 lines: one operator command (`hybridcache disk ls|stats|verify|prune|
clear`), whose subcommands share the folder listing, the key handling and the lock probe.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_hybridcache.config import setting_env
from vllm_hybridcache.units import human_age, human_bytes

__all__ = ["EXIT_PROBLEMS", "EXIT_USAGE", "FolderListing", "LinkEntry", "add_parser",
           "list_root"]

EXIT_PROBLEMS = 1
EXIT_USAGE = 2
DISK_DIR_ENV = setting_env("disk_dir")
DISK_KEY_ENV = setting_env("disk_key_file")
# verify: what an engine would refuse (and delete) or could never serve; not problems:
# temporaries (a write in progress, or swept at the next start), files not named *.link
# (never read by an engine), files deleted meanwhile by a running engine ("gone")
PROBLEMS = frozenset({"checksum", "unauthenticated", "truncated", "foreign", "not_a_link",
                      "format", "mismatch", "symlink", "orphan", "io_error"})


class CommandError(Exception):
    """A refusal or usage error: its message is printed, its code returned."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------- listing


@dataclass
class LinkEntry:
    """One file below a fingerprint folder, as its name and status say (no header read)."""

    rel: str  # F/T-D/name, relative to DIR
    tenant: str  # T: a keyed digest of the domain's tenant (its cache_salt); names no tenant
    domain: str  # D: a keyed digest of the domain (tenant, adapter, route, rank)
    kind: str  # tree | anchor
    end: int | None  # from the name (None: a name the engine never writes)
    nbytes: int
    last_use: float  # mtime: the engine stamps every use on the file


@dataclass
class FolderListing:
    """One fingerprint folder `DIR/<name>`, or at TP > 1 one rank's folder below it
    (`DIR/<name>/<shard>`, core/linkformat/shard.py): each rank's files are listed, checked and
    pruned as a folder of their own."""

    name: str
    in_use: bool | None  # an engine holds its .in-use lock; None: no lock file (not ours)
    links: list[LinkEntry] = field(default_factory=list)
    temporaries: list[LinkEntry] = field(default_factory=list)  # writes in progress or cut
    others: list[str] = field(default_factory=list)  # files the engine never reads
    symlinks: list[str] = field(default_factory=list)  # planted: the engine removes them
    shard: str = ""  # the rank's folder below `name` ("" with one worker)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.links)

    @property
    def parts(self) -> tuple[str, ...]:
        """The folder's path below DIR, one component each."""
        return (self.name, self.shard) if self.shard else (self.name,)

    @property
    def label(self) -> str:
        return "/".join(self.parts)

    def shard_of(self):
        """The rank whose files these are (a `Shard`; one worker's when unsharded)."""
        from vllm_hybridcache.core.linkformat.shard import Shard

        return Shard.from_folder(self.shard) if self.shard else Shard()


def _link_dir():
    from vllm_hybridcache.core.disk import directory

    return directory


@contextmanager
def _lock_fd(root: Path, name: str) -> Iterator[int | None]:
    """A descriptor of `DIR/<name>/.in-use` (None without one), opened without following a
    symlink and without blocking (a FIFO planted there would hang an open)."""
    from vllm_hybridcache.core.linkformat.safeio import SymlinkRefused, dir_fd

    fd = None
    try:
        with dir_fd(root, name) as d:
            fd = os.open(_link_dir().LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK, dir_fd=d)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            fd = None
    except (FileNotFoundError, SymlinkRefused, NotADirectoryError):
        fd = None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        fd = None
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)  # releases any flock taken on it


def _try_exclusive(fd: int) -> bool:
    """Whether nobody holds the lock (then this process holds it exclusively), as the engine's
    sweep of foreign folders decides it (directory.py `_sweep_foreign`)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _in_use(root: Path, name: str) -> bool | None:
    with _lock_fd(root, name) as fd:
        if fd is None:
            return None
        return not _try_exclusive(fd)  # closing the descriptor releases a lock taken


def _shard_folders(root: Path, name: str) -> list[str]:
    """The rank folders below fingerprint folder `name` (TP > 1), in rank order."""
    from vllm_hybridcache.core.linkformat.safeio import dir_fd
    from vllm_hybridcache.core.linkformat.shard import Shard

    with dir_fd(root, name) as fd, os.scandir(fd) as it:
        found = [e.name for e in it if e.is_dir(follow_symlinks=False)
                 and Shard.from_folder(e.name) is not None]
    return sorted(found, key=lambda n: Shard.from_folder(n).rank)


def _scan_folder(root: Path, name: str, shard: str = "") -> FolderListing:
    from vllm_hybridcache.core.linkformat.linkfile import TMP_PREFIX
    from vllm_hybridcache.core.linkformat.safeio import SymlinkRefused, dir_fd
    from vllm_hybridcache.core.linkformat.shard import Shard

    d = _link_dir()
    listing = FolderListing(name, _in_use(root, name), shard=shard)
    at = listing.label
    with dir_fd(root, *listing.parts) as fd, os.scandir(fd) as it:
        subs = [(e.name, e.is_symlink(), e.is_dir(follow_symlinks=False)) for e in it]
    for sub, link, is_dir in sorted(subs):
        if link:
            listing.symlinks.append(f"{at}/{sub}")
            continue
        if not is_dir:
            if sub != d.LOCK_NAME:
                listing.others.append(f"{at}/{sub}")
            continue
        if not shard and Shard.from_folder(sub) is not None:
            continue  # a rank's folder (TP > 1): listed as a folder of its own
        anchor = sub.startswith(d.ANCHOR_PREFIX)
        try:
            with dir_fd(root, *listing.parts, sub) as fd, os.scandir(fd) as it:
                entries = []
                for e in it:
                    try:
                        entries.append((e.name, e.is_symlink(), e.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        continue  # deleted meanwhile by an engine
        except (FileNotFoundError, SymlinkRefused, NotADirectoryError):
            continue
        for fname, flink, st in sorted(entries, key=lambda x: x[0]):
            rel = f"{at}/{sub}/{fname}"
            if flink:
                listing.symlinks.append(rel)
                continue
            if not stat.S_ISREG(st.st_mode):
                listing.others.append(rel)
                continue
            end = None
            stem = fname.removesuffix(d.SUFFIX)
            if fname.endswith(d.SUFFIX) and "-" in stem and stem.rsplit("-", 1)[1].isdigit():
                end = int(stem.rsplit("-", 1)[1])
            tenant, _, domain = (sub.removeprefix(d.ANCHOR_PREFIX) if anchor
                                 else sub).rpartition("-")
            entry = LinkEntry(rel, tenant, domain, d.ANCHOR if anchor else d.TREE, end,
                              st.st_size, st.st_mtime)
            if fname.startswith(TMP_PREFIX):
                listing.temporaries.append(entry)
            elif fname.endswith(d.SUFFIX):
                listing.links.append(entry)
            else:
                listing.others.append(rel)
    listing.links.sort(key=lambda e: (e.tenant, e.domain, e.kind, e.end or 0, e.rel))
    return listing


def list_root(root: Path) -> tuple[list[FolderListing], list[str]]:
    """(the fingerprint folders of `root`, the names of symlinks planted at its top); hidden
    entries (the weights memo, the lock files) are not folders of links."""
    from vllm_hybridcache.core.linkformat.safeio import SymlinkRefused, dir_fd

    with dir_fd(root) as fd, os.scandir(fd) as it:
        top = sorted((e.name, e.is_symlink(), e.is_dir(follow_symlinks=False)) for e in it)
    folders, symlinks = [], []
    for name, link, is_dir in top:
        if name.startswith("."):
            continue
        if link:
            symlinks.append(name)
        elif is_dir:
            try:
                shards = _shard_folders(root, name)
                listing = _scan_folder(root, name)
                if not shards or listing.links or listing.temporaries or listing.others:
                    folders.append(listing)
                folders += [_scan_folder(root, name, shard) for shard in shards]
            except (FileNotFoundError, SymlinkRefused):
                continue  # swept meanwhile by an engine
    return folders, symlinks


# ---------------------------------------------------------------------------- keys, folder


def _default_dir() -> str:
    return os.environ.get(DISK_DIR_ENV, "")


def _key_path(args: argparse.Namespace) -> Path:
    """`--key-file`, else the engine's own choice (config.CacheSettings.disk_key_path)."""
    if args.key_file:
        return Path(args.key_file).expanduser()
    from vllm_hybridcache.config import CacheSettings

    return CacheSettings(disk_key_file=os.environ.get(DISK_KEY_ENV, "").strip()
                         ).disk_key_path()


def _root(args: argparse.Namespace) -> Path:
    """DIR, checked by the engine's own rules (own_folder) and never created."""
    from vllm_hybridcache.core.disk.folder import UnsafeFolder, own_folder

    given = args.dir or _default_dir()
    if not given:
        raise CommandError(f"give the cache folder (DIR), or set {DISK_DIR_ENV}")
    root = Path(os.path.abspath(Path(given).expanduser()))
    try:
        os.lstat(root)
    except FileNotFoundError:
        raise CommandError(f"{root}: no such folder") from None
    try:
        return own_folder(root, _key_path(args))
    except UnsafeFolder as e:
        raise CommandError(f"refused: {e}") from None


def _key(args: argparse.Namespace):
    """The disk key (a LinkKey), read like the engine reads it, never created."""
    from vllm_hybridcache.core.auth import KeyFileError, key_from_file

    path = _key_path(args)
    try:
        return key_from_file(path, "disk")
    except FileNotFoundError:
        raise CommandError(f"no disk key at {path}: give the engine's key with --key-file "
                           f"(its setting disk_key_file, {DISK_KEY_ENV}); a new key would "
                           "make every file unauthenticated") from None
    except KeyFileError as e:
        raise CommandError(f"refused: {e}") from None
    except OSError as e:
        raise CommandError(f"the disk key {path} cannot be read: {e.strerror}") from None


def _names_fingerprint(args: argparse.Namespace) -> bool:
    """Whether `--fingerprint` gives a full fingerprint (its folder's name needs the key)."""
    return bool(args.fingerprint) and len(args.fingerprint.strip()) == 64


def _select(folders: list[FolderListing], wanted: str | None, key=None
            ) -> list[FolderListing]:
    """The folders `--fingerprint` names: a folder's name (F), or a full fingerprint (64 hex,
    the engine's start-up log line; its folder name is computed with the key)."""
    if wanted is None:
        return folders
    name = wanted.strip().lower()
    if len(name) == 64 and key is not None:
        try:
            name = key.name(b"fingerprint", bytes.fromhex(name), size=8)
        except ValueError:
            pass
    chosen = [f for f in folders if f.name == name]
    if not chosen:
        raise CommandError(f"no fingerprint folder {wanted!r}; there are: "
                           f"{', '.join(sorted({f.name for f in folders})) or 'none'}")
    return chosen


# ---------------------------------------------------------------------------- headers


def _claimed_fingerprint(root: Path, path: Path) -> bytes | None:
    """The fingerprint a header names, read after its MAC verified (the caller's probe)."""
    import msgspec

    from vllm_hybridcache.core.linkformat import linkfile

    try:
        fd = linkfile.open_link(path, root)
        with os.fdopen(fd, "rb") as f:
            pre = f.read(linkfile._PRE.size)
            _, hlen, _, _ = linkfile._PRE.unpack(pre)
            raw = f.read(hlen)
        return msgspec.msgpack.decode(raw, type=linkfile.LinkFileHeader).fingerprint
    except (OSError, ValueError, linkfile.LinkFileError, msgspec.DecodeError):
        return None  # changed meanwhile: another file decides


def _probe(root: Path, path: Path, key) -> tuple[bytes | None, str | None]:
    """(the fingerprint of an authentic header, None) or (None, its problem)."""
    from vllm_hybridcache.core.linkformat.linkfile import (
        LinkFileError,
        LinkFileProblem,
        read_header,
    )

    try:
        header, _ = read_header(path, b"", key, root)
        return header.fingerprint, None
    except LinkFileError as e:
        if e.problem is LinkFileProblem.FOREIGN:  # its MAC verified: only the fingerprint
            fp = _claimed_fingerprint(root, path)
            return (fp, None) if fp is not None else (None, "gone")
        return None, e.problem.value
    except FileNotFoundError:
        return None, "gone"
    except OSError:
        return None, "io_error"


def folder_fingerprint(root: Path, folder: FolderListing, key) -> bytes | None:
    """The fingerprint of a folder's files: the first authentic header whose fingerprint's
    keyed name is the folder's name (module docstring); None when no file qualifies."""
    for entry in folder.links:
        fp, _ = _probe(root, root / entry.rel, key)
        if fp is not None and key.name(b"fingerprint", fp, size=8) == folder.name:
            return fp
    return None


def _namer(root: Path, fp: bytes, key, shard=None):
    """A LinkDirectory of `fp` (and of one rank's `shard` at TP > 1) on `root`, never opened:
    its names (`path_for`) and rules."""
    return _link_dir().LinkDirectory(root, fp, 1, key=key, shard=shard)


@dataclass
class Checked:
    """One file's verdict."""

    rel: str
    problem: str | None  # None: sound (header, every part's CRC and MAC, its parent)
    detail: str = ""
    start: int | None = None
    end: int | None = None


def _check_file(root: Path, path: Path, fp: bytes | None, key, namer) -> tuple[Checked, Any]:
    """Verify one file as the engine would before a restore: header (magic, CRC, MAC,
    format, fingerprint), its name against its header, every part's CRC-32 and MAC."""
    import torch

    from vllm_hybridcache.core.linkformat.linkfile import LinkFileError, read_header, read_parts

    rel = str(path.relative_to(root))
    if fp is None:
        _, problem = _probe(root, path, key)
        if problem is None:  # authentic, but not in the folder its fingerprint names
            return Checked(rel, "mismatch", "authentic, but this folder is not named for its "
                           "fingerprint"), None
        return Checked(rel, problem, f"{problem}: header"), None
    try:
        header, base = read_header(path, fp, key, root, namer.shard.tag)
        if namer.path_for(header.domain, header.end, header.digest, header.kind) != path:
            return Checked(rel, "mismatch", "its name does not name its header"), None
        dst = {e.name: torch.empty(e.nbytes, dtype=torch.uint8) for e in header.parts}
        read_parts(path, header, base, dst, key, root)
    except LinkFileError as e:
        # the message is "<problem>: <path>[: what]": keep what failed (a part, the header)
        what = str(e).removeprefix(f"{e.problem.value}: ").removeprefix(str(path))
        return Checked(rel, e.problem.value, what.removeprefix(": ") or "the file"), None
    except FileNotFoundError:
        return Checked(rel, "gone", "deleted meanwhile (an engine evicted it)"), None
    except OSError as e:
        return Checked(rel, "io_error", f"{type(e).__name__}: {e.strerror}"), None
    return Checked(rel, None, "", header.start, header.end), header


def verify_folder(root: Path, folder: FolderListing, key, progress=None
                  ) -> tuple[bytes | None, list[Checked]]:
    """(the folder's fingerprint, a verdict per file): every file checked, then the files
    whose parent link is missing or unsound marked `orphan` (a chain serves only while every
    link below it is on disk)."""
    fp = folder_fingerprint(root, folder, key)
    namer = _namer(root, fp, key, folder.shard_of()) if fp is not None else None
    out: list[Checked] = []
    sound: dict[Path, Any] = {}
    for entry in folder.links:
        path = root / entry.rel
        verdict, header = _check_file(root, path, fp, key, namer)
        out.append(verdict)
        if header is not None:
            sound[path] = header
        if progress is not None:
            progress.update(entry.nbytes)
    if namer is not None:
        changed = True
        while changed:  # an orphan's children are orphans too
            changed = False
            for path, h in list(sound.items()):
                if h.start and namer.path_for(h.domain, h.start, h.parent_digest,
                                              h.kind) not in sound:
                    del sound[path]
                    changed = True
        for v in out:
            if v.problem is None and root / v.rel not in sound:
                v.problem, v.detail = "orphan", "the link below it is missing or unsound"
    out += [Checked(s, "symlink", "a symlink in the folder (never followed)")
            for s in folder.symlinks]
    return fp, out


# ---------------------------------------------------------------------------- commands


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def _ls(args: argparse.Namespace) -> int:
    root = _root(args)
    folders, top_links = list_root(root)
    key = _key(args) if args.tokens or _names_fingerprint(args) else None
    folders = _select(folders, args.fingerprint, key)
    key = key if args.tokens else None
    now = time.time()
    out = []
    for f in folders:
        fp = folder_fingerprint(root, f, key) if key is not None else None
        files = []
        for e in f.links:
            item = asdict(e)
            if key is not None:
                verdict = _header_tokens(root, root / e.rel, fp, key, f.shard_of().tag)
                item.update(verdict)
            files.append(item)
        out.append({"folder": f.label, "in_use": f.in_use, "files": files,
                    "fingerprint": fp.hex() if fp is not None else None,
                    "temporaries": len(f.temporaries), "others": f.others,
                    "symlinks": f.symlinks})
    if args.json:
        _print_json({"root": str(root), "folders": out, "symlinks": top_links})
        return 0
    print(f"{root}: {len(folders)} fingerprint folder(s)")
    for f, o in zip(folders, out, strict=True):
        state = {True: "in use by an engine", False: "idle", None: "no .in-use: not a cache "
                 "folder"}[f.in_use]
        fp = f", fingerprint {o['fingerprint']}" if o["fingerprint"] else ""
        print(f"\n{f.label}  {_files(len(f.links))}, {human_bytes(f.nbytes)}, {state}{fp}")
        if f.links:
            cols = (f"  {'kind':7s} {'tenant':16s} {'domain':16s} {'end':>8s} {'size':>10s} "
                    f"{'last use':>10s}")
            print(cols + (f" {'start':>8s} {'tokens':>7s}" if key is not None else ""))
        for e, item in zip(f.links, o["files"], strict=True):
            line = (f"  {e.kind:7s} {e.tenant:16s} {e.domain:16s} "
                    f"{e.end if e.end is not None else '?':>8} "
                    f"{human_bytes(e.nbytes):>10s} {human_age(now - e.last_use) + ' ago':>10s}")
            if key is not None:
                line += (f" {item['start']:>8d} {item['tokens']:>7d}" if item.get("problem")
                         is None else f"  {item['problem']}")
            print(line)
        if f.temporaries:
            print(f"  {len(f.temporaries)} temporary file(s) (writes in progress, or cut "
                  "short: swept after 10 min)")
        for s in f.symlinks:
            print(f"  symlink {s} (never followed; an engine removes it)")
    for s in top_links:
        print(f"symlink {s} at the top (never followed)")
    return 0


def _header_tokens(root: Path, path: Path, fp: bytes | None, key,
                   shard: str = "") -> dict[str, Any]:
    """A file's start and token count from its verified header (ls --tokens)."""
    from vllm_hybridcache.core.linkformat.linkfile import LinkFileError, read_header

    if fp is None:
        return {"problem": "fingerprint unknown"}
    try:
        h, _ = read_header(path, fp, key, root, shard)
    except LinkFileError as e:
        return {"problem": e.problem.value}
    except OSError:
        return {"problem": "gone"}
    return {"start": h.start, "tokens": h.end - h.start}


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def _stats(args: argparse.Namespace) -> int:
    root = _root(args)
    folders, _ = list_root(root)
    folders = _select(folders, args.fingerprint,
                      _key(args) if _names_fingerprint(args) else None)
    now = time.time()
    rows = []
    for f in folders:
        kinds: dict[str, dict[str, int]] = {}
        for e in f.links:
            k = kinds.setdefault(e.kind, {"files": 0, "bytes": 0})
            k["files"] += 1
            k["bytes"] += e.nbytes
        uses = [e.last_use for e in f.links]
        rows.append({
            "folder": f.label, "in_use": f.in_use, "files": len(f.links), "bytes": f.nbytes,
            "kinds": kinds, "tenants": len({e.tenant for e in f.links}),
            "domains": len({(e.tenant, e.domain) for e in f.links}),
            "oldest_use": min(uses) if uses else None, "newest_use": max(uses) if uses else None,
            "temporaries": len(f.temporaries),
            "temporary_bytes": sum(e.nbytes for e in f.temporaries),
            "symlinks": len(f.symlinks)})
    total = {"files": sum(r["files"] for r in rows), "bytes": sum(r["bytes"] for r in rows)}
    try:
        usage = shutil.disk_usage(root)
        total["free_bytes"] = usage.free
    except OSError:
        pass
    if args.json:
        _print_json({"root": str(root), "folders": rows, "total": total})
        return 0
    print(f"{root}: {_files(total['files'])}, {human_bytes(total['bytes'])} in {len(rows)} "
          f"fingerprint folder(s)"
          + (f"; {human_bytes(total['free_bytes'])} free on its file system"
             if "free_bytes" in total else ""))
    for r in rows:
        state = {True: "in use", False: "idle", None: "not a cache folder"}[r["in_use"]]
        kinds = ", ".join(f"{k} {_files(v['files'])} {human_bytes(v['bytes'])}"
                          for k, v in sorted(r["kinds"].items())) or "no files"
        ages = (f"; last use {human_age(now - r['newest_use'])} ago, oldest "
                f"{human_age(now - r['oldest_use'])} ago" if r["files"] else "")
        extra = (f"; {r['temporaries']} temporaries ({human_bytes(r['temporary_bytes'])})"
                 if r["temporaries"] else "")
        print(f"  {r['folder']} ({state}): {kinds}; {r['tenants']} tenant(s), "
              f"{r['domains']} domain(s){ages}{extra}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from vllm_hybridcache.progress import Progress

    root = _root(args)
    key = _key(args)
    folders, top_links = list_root(root)
    folders = _select(folders, args.fingerprint, key)
    total = sum(f.nbytes for f in folders)
    results = []
    with Progress(total, f"verifying {root}", unit="B") as bar:
        for f in folders:
            results.append((f, *verify_folder(root, f, key, bar)))
    report = []
    problems = 0
    for f, fp, verdicts in results:
        bad = [v for v in verdicts if v.problem in PROBLEMS]
        problems += len(bad)
        deleted = 0
        if args.delete and bad:
            # what an engine does with each when it meets it; a symlink: the link itself
            namer = _namer(root, fp if fp is not None else b"", key, f.shard_of())
            deleted = namer.delete([root / v.rel for v in bad])
        counts: dict[str, int] = {}
        for v in verdicts:
            counts[v.problem or "ok"] = counts.get(v.problem or "ok", 0) + 1
        report.append({"folder": f.label, "fingerprint": fp.hex() if fp is not None else None,
                       "in_use": f.in_use, "files": len(f.links), "bytes": f.nbytes,
                       "counts": counts, "problems": [asdict(v) for v in bad],
                       "deleted": deleted,
                       "stale_temporaries": sum(1 for t in f.temporaries
                                                if time.time() - t.last_use > 600)})
    problems += len(top_links)
    if args.json:
        _print_json({"root": str(root), "folders": report, "symlinks": top_links,
                     "problems": problems})
        return EXIT_PROBLEMS if problems else 0
    for r in report:
        fp = (f"fingerprint {r['fingerprint']}" if r["fingerprint"] else
              "fingerprint unknown: no file verifies under this disk key")
        print(f"{r['folder']}: {fp}; {_files(r['files'])}, {human_bytes(r['bytes'])}"
              + ("; in use by an engine" if r["in_use"] else ""))
        for v in r["problems"]:
            print(f"  {v['problem']:15s} {v['rel']}: {v['detail']}")
        print("  " + ", ".join(f"{n} {k}" for k, n in sorted(r["counts"].items())))
        if r["deleted"]:
            print(f"  {r['deleted']} deleted")
        if r["stale_temporaries"]:
            print(f"  {r['stale_temporaries']} stale temporary file(s): the next start "
                  "(or prune) sweeps them")
    for s in top_links:
        print(f"symlink {s} at the top of the folder (never followed)")
    print(f"verify: {problems} problem(s) in {len(report)} fingerprint folder(s)"
          + ("; `disk verify --delete` deletes them (an engine deletes each one it meets)"
             if problems and not args.delete else ""))
    return EXIT_PROBLEMS if problems else 0


def _prune(args: argparse.Namespace) -> int:
    root = _root(args)
    key = _key(args)
    folders, _ = list_root(root)
    folders = _select(folders, args.fingerprint, key)
    rows = []
    for f in folders:
        rows.append(_prune_folder(root, f, key, args.budget, args.ttl))
    if args.json:
        _print_json({"root": str(root), "folders": rows})
        return 0
    for r in rows:
        if r["skipped"]:
            print(f"{r['folder']}: left alone: {r['skipped']}")
            continue
        refused = ", ".join(f"{k} {v}" for k, v in sorted(r["refused"].items()))
        print(f"{r['folder']}: {r['files_before']} -> {r['files_after']} files, "
              f"{human_bytes(r['bytes_before'])} -> {human_bytes(r['bytes_after'])}: "
              f"{r['expired']} expired (TTL), {r['evicted']} evicted (budget), "
              f"{r['orphans']} orphans, {r['temporaries']} stale temporaries"
              + (f", damaged: {refused}" if refused else "")
              + ("; an engine holds this folder: its index forgets the pruned files as its "
                 "lookups miss them" if r["in_use"] else ""))
    return 0


def _prune_folder(root: Path, f: FolderListing, key, budget: int | None,
                  ttl: float | None) -> dict[str, Any]:
    """Apply TTL and budget to one folder through LinkDirectory (scan: damaged files, orphans,
    stale temporaries and expired files deleted, as at an engine's start; evict: the least
    valuable leaves until the budget holds)."""
    row: dict[str, Any] = {"folder": f.label, "in_use": f.in_use, "skipped": None,
                           "files_before": len(f.links), "bytes_before": f.nbytes}
    if f.in_use is None:
        row["skipped"] = "no .in-use lock file: not a cache folder an engine made"
        return row
    fp = folder_fingerprint(root, f, key)
    if fp is None:
        row["skipped"] = ("its fingerprint is unknown (no file verifies under this disk key); "
                          f"`disk clear --fingerprint {f.name}` removes it")
        return row
    with _lock_fd(root, f.name) as fd:
        if fd is None:
            row["skipped"] = "its .in-use lock file went away (swept meanwhile)"
            return row
        if _try_exclusive(fd):  # idle: an engine starting now waits until the prune is done
            row["in_use"] = False
        else:  # shared beside the engines: no start-up sweep removes the folder meanwhile
            row["in_use"] = True
            fcntl.flock(fd, fcntl.LOCK_SH)
        d = _link_dir().LinkDirectory(root, fp, budget if budget is not None else 1 << 62,
                                      ttl_s=ttl or 0.0, key=key, shard=f.shard_of())
        assert d.dir == root.joinpath(*f.parts), (d.dir, f.label)
        d.scan()
        if budget is not None and d.stats.bytes > budget:
            d.evict(d.stats.bytes - budget)
    row.update(files_after=d.stats.files, bytes_after=d.stats.bytes, expired=d.stats.expired,
               evicted=d.stats.evictions, orphans=d.stats.orphans,
               temporaries=d.stats.swept_temporaries, refused=dict(d.stats.refused))
    return row


def _clear(args: argparse.Namespace) -> int:
    root = _root(args)
    folders, _ = list_root(root)
    keys: list[Any] = []

    def key() -> Any:
        """The disk key, read only when a folder's files must be named (not for a folder
        removed whole: a lost key is when a clear is needed most)."""
        if not keys:
            keys.append(_key(args))
        return keys[0]

    targets = [f for f in _select(folders, args.fingerprint,
                                  key() if _names_fingerprint(args) else None)
               if f.in_use is not None]
    rows = []
    with ExitStack() as stack:
        held = []
        locked = []
        idle_by_name: dict[str, bool] = {}  # one lock per fingerprint folder (its ranks' too)
        for f in targets:
            if f.name not in idle_by_name:
                fd = stack.enter_context(_lock_fd(root, f.name))
                if fd is None:
                    continue  # swept meanwhile
                idle_by_name[f.name] = _try_exclusive(fd)
                if not idle_by_name[f.name]:
                    held.append(f)
            locked.append((f, idle_by_name[f.name]))
        if held and not args.force:
            names = ", ".join(f.name for f in held)
            raise CommandError(
                f"refused: an engine holds {names} (its .in-use lock): clear a running server "
                "with `vllm-hybridcache cache clear URL --tier disk` (the engine then forgets "
                "the files and drops its queued writes too), stop it first, or pass --force "
                "(files deleted under the engine: its queued writes may land afterwards)")
        for f, idle in locked:
            rows.append(_clear_folder(root, f, idle, args.kind, key))
    if args.json:
        _print_json({"root": str(root), "folders": rows})
        return 0
    if not rows:
        print(f"{root}: no fingerprint folder to clear")
    for r in rows:
        how = ("folder removed" if r["removed"] else
               "files deleted, the folder stays" + ("; an engine holds it" if r["in_use"]
                                                    else ""))
        print(f"{r['folder']}: {_files(r['files'])} ({human_bytes(r['bytes'])}) cleared, {how}")
    return 0


def _clear_folder(root: Path, f: FolderListing, idle: bool, kind: str | None,
                  key: Callable[[], Any]) -> dict[str, Any]:
    """Remove an idle folder whole while holding its lock exclusively, as the engine's sweep
    does; otherwise (a kind, or --force on a held folder) delete its link files through
    LinkDirectory.clear, which leaves the folder and its lock to the engine."""
    files = [e for e in f.links if kind is None or e.kind == kind]
    row = {"folder": f.label, "in_use": not idle, "files": len(files),
           "bytes": sum(e.nbytes for e in files), "removed": False}
    if idle and kind is None:
        shutil.rmtree(root / f.name, ignore_errors=True)
        row["removed"] = not os.path.lexists(root / f.name)
        return row
    fp = folder_fingerprint(root, f, key())
    d = _link_dir().LinkDirectory(root, fp if fp is not None else b"", 1, key=key(),
                                  shard=f.shard_of())
    # clear() acts on the folder's files by name only; a folder of unknown fingerprint is
    # named for the instance here (its files need no header to be deleted)
    d.dir = root.joinpath(*f.parts)
    row["files"] = d.clear(kind)
    return row


# ---------------------------------------------------------------------------- parser


def _size(text: str) -> int:
    """A size as the settings take it (config.parse_size: `32GiB`, `512MiB`, `8GB`)."""
    from vllm_hybridcache.config import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"size {e}") from None


def _duration(text: str) -> int:
    """A duration as the settings take it (config.parse_duration: `7d`, `12h`, `30m`)."""
    from vllm_hybridcache.config import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"duration {e}") from None


def _run(func):
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except CommandError as e:
            print(f"vllm-hybridcache disk: error: {e}", file=sys.stderr)
            return e.code
    return run


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`disk ls|stats|verify|prune|clear` under the `vllm-hybridcache` command."""
    p = sub.add_parser("disk", help="a disk tier's folder, offline: ls, stats, verify, prune, "
                       "clear", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = p.add_subparsers(dest="disk_cmd", required=True)

    def common(q: argparse.ArgumentParser, fingerprint: bool = True) -> None:
        q.add_argument("dir", nargs="?", default=None,
                       help=f"the cache folder (disk_dir; default ${DISK_DIR_ENV})")
        q.add_argument("--key-file", default=None,
                       help=f"the disk key (default ${DISK_KEY_ENV}, else "
                            "$XDG_CONFIG_HOME/vllm-hybridcache/disk.key)")
        q.add_argument("--json", action="store_true", help="machine-readable output")
        if fingerprint:
            q.add_argument("--fingerprint", default=None,
                           help="only this fingerprint folder (its name, or the full "
                                "fingerprint's 64 hex digits)")

    q = cmds.add_parser("ls", help="the fingerprint folders and their files")
    common(q)
    q.add_argument("--tokens", action="store_true",
                   help="read every header (needs the key): each file's first token position "
                        "and token count (never the token ids)")
    q.set_defaults(func=_run(_ls))
    q = cmds.add_parser("stats", help="totals per fingerprint folder")
    common(q)
    q.set_defaults(func=_run(_stats))
    q = cmds.add_parser("verify", help="check every header and part (CRC-32 and MAC); exit 1 "
                        "on any problem")
    common(q)
    q.add_argument("--delete", action="store_true",
                   help="delete the files found unsound (and planted symlinks), as an engine "
                        "does when it meets one; the exit code still says they were found")
    q.set_defaults(func=_run(_verify))
    q = cmds.add_parser("prune", help="apply a budget and a TTL (and delete damaged files), "
                        "as an engine's start does; safe beside running engines")
    common(q)
    q.add_argument("--budget", type=_size, default=None,
                   help="bytes to keep per fingerprint folder, e.g. 32GiB (the least valuable "
                        "files go first)")
    q.add_argument("--ttl", type=_duration, default=None,
                   help="delete files unused this long, e.g. 7d, 12h")
    q.set_defaults(func=_run(_prune))
    q = cmds.add_parser("clear", help="delete every file (or one fingerprint's, one kind's); "
                        "refused while an engine holds the folder unless --force")
    common(q)
    q.add_argument("--kind", choices=("tree", "anchor"), default=None,
                   help="only tree links or only spilled end anchors")
    q.add_argument("--force", action="store_true",
                   help="delete the files even where an engine holds the folder")
    q.set_defaults(func=_run(_clear))
