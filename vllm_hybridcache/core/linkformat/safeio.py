"""Opening link files without following a symlink anywhere below the cache folder.

Why: the disk tier's folder and the cluster tier's staging folder hold state an engine restores
as its own. A symlink planted in them (a file, or a whole domain folder, pointing at files of
another installation or of the attacker's choosing) must never be read or written through.
`open_below(root, path, flags)` opens `path` one component at a time from `root`'s descriptor
(`openat`), every component with O_NOFOLLOW (folders also with O_DIRECTORY), so a symlink at
any level below `root` fails with ELOOP/ENOTDIR; `SymlinkRefused` is raised for it. The file
opened must be a regular file. `root` itself was checked at start-up (core/disk/folder.py) and
is opened with O_NOFOLLOW too.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["SymlinkRefused", "dir_fd", "open_below", "relative_parts"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SymlinkRefused(OSError):
    """A symlink (or another non-regular entry) where a link file or folder was expected."""


def relative_parts(root: Path, path: Path) -> tuple[str, ...]:
    """`path`'s components below `root`; ValueError when it does not lie below it."""
    rel = Path(path).relative_to(root)
    parts = rel.parts
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{path} is not a file below {root}")
    return parts


def _open_dir_at(parent: int | None, name: str | Path) -> int:
    try:
        return os.open(name, _DIR, dir_fd=parent)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SymlinkRefused(e.errno, "a symlink or not a folder", str(name)) from e
        raise


@contextmanager
def dir_fd(root: Path, *sub: str) -> Iterator[int]:
    """A descriptor of the folder `root/sub...`, every component opened without following a
    symlink (for os functions taking `dir_fd`: stat, unlink, replace, mkdir, scandir)."""
    fd = _open_dir_at(None, root)
    try:
        for name in sub:
            nxt = _open_dir_at(fd, name)
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def open_below(root: Path, path: Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of the regular file `path` below `root`, opened as described in the module
    docstring (`flags` for the file itself; O_NOFOLLOW and O_CLOEXEC are added). Raises
    SymlinkRefused, FileNotFoundError or another OSError; ValueError for a path not below
    `root`."""
    parts = relative_parts(root, path)
    with dir_fd(root, *parts[:-1]) as parent:
        try:
            # O_NONBLOCK: a FIFO planted under a link's name must not block the open (it is
            # then refused as not a regular file); on regular files it changes nothing
            fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode,
                         dir_fd=parent)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise SymlinkRefused(e.errno, "a symlink", str(path)) from e
            raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SymlinkRefused(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd
