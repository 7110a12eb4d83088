"""The disk tier's folder is the engine's own: created 0700, refused when others could write it.

Why: the folder holds link files an engine restores as state it did not compute, and their
headers hold every tenant's prompt token ids. Whoever can write the folder can plant or swap
files and folders (a MAC refuses a forged file, but a rename or a symlink could still point a
name at the files of another installation); whoever can read it reads the prompts. So, at
start-up (`own_folder`):

- a missing folder is created with mode 0700 (its missing parents with the default mode);
- an existing folder is used only when it is a real folder (not a symlink: give its target),
  owned by this user, and not writable by group or others; otherwise start-up stops with an
  error that names the fix. A folder others may read is used: everything in it is created
  0700/0600 (the fingerprint and domain folders, the files), so they read nothing;
- the disk key (core/auth.py) must not lie inside it: a copy of the folder would carry the key
  that authenticates it.

Pure: no vLLM.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["UnsafeFolder", "own_folder"]


class UnsafeFolder(PermissionError):
    """The cache folder may not be used as it is (the message names the fix)."""


def own_folder(root: Path, key_file: Path | None = None) -> Path:
    """Create or check the cache folder `root` (see the module docstring); returns it as an
    absolute path. Raises UnsafeFolder, or OSError when it cannot be created."""
    root = Path(os.path.abspath(Path(root).expanduser()))
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:  # created meanwhile (another engine): check it below
            pass
        else:
            os.chmod(root, 0o700)  # whatever the umask left
        st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFolder(f"disk_dir {root} is a symlink (to {os.path.realpath(root)}); give "
                           "the folder itself: no symlink in the cache folder is followed")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolder(f"disk_dir {root} is not a folder")
    if st.st_uid != os.geteuid():
        raise UnsafeFolder(f"disk_dir {root} is owned by uid {st.st_uid}, not by this user "
                           f"({os.geteuid()}): its owner could plant or read link files. Give "
                           "a folder of your own (it is created 0700 when missing)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeFolder(f"disk_dir {root} is writable by group or others (mode "
                           f"{stat.S_IMODE(st.st_mode):04o}): anyone could plant link files. "
                           f"Fix: `chmod 700 {root}`")
    if key_file is not None:  # compared as resolved: a symlinked folder must not hide it
        key = Path(os.path.realpath(Path(key_file).expanduser()))
        real = Path(os.path.realpath(root))
        if key == real or real in key.parents:
            raise UnsafeFolder(f"the disk key {key} lies inside disk_dir {root}: a copy of the "
                               "folder would carry the key that authenticates its files. Keep "
                               "it elsewhere (setting disk_key_file)")
    return root
