"""Writing embedded checkpoints into the user cache directory, once, atomically.

A checkpoint is built in a temporary sibling folder and renamed into place only when complete,
so a crash, a full disk or an unwritable folder never leaves a half-written model that a later
run would trust. The folder name carries a key of the versions that shape the bytes
(package, transformers, torch, tokenizers); the same name and versions give identical bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from vllm_hybridcache.config import HOME_ENV

FINGERPRINT_FILE = "fingerprint.json"
_VERSIONED = ("vllm-hybridcache", "transformers", "torch", "tokenizers", "safetensors")


class ModelStoreError(RuntimeError):
    """A checkpoint could not be found or written; the message says what to do."""


def cache_root() -> Path:
    """Where embedded models live: $VLLM_HYBRIDCACHE_HOME, else the XDG user cache."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "vllm-hybridcache" / "models"


@lru_cache(maxsize=1)
def versions_key() -> str:
    """Short digest of the library versions that determine a checkpoint's bytes."""
    parts = []
    for dist in _VERSIONED:
        try:
            parts.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist}=none")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:10]


def fingerprint(folder: Path) -> str:
    """sha256 over every file's relative name and bytes (the fingerprint file excluded)."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == FINGERPRINT_FILE:
            continue
        h.update(rel.encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def read_fingerprint(folder: Path) -> dict | None:
    try:
        return json.loads((folder / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return None


def publish(build_into, final: Path) -> Path:
    """Run `build_into(tmpdir)` and rename the result to `final`; clean up on any failure."""
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=parent))
    except OSError as e:
        raise ModelStoreError(
            f"cannot write embedded models under {parent}: {e.strerror or e}. "
            "Set VLLM_HYBRIDCACHE_HOME to a writable folder."
        ) from e
    try:
        build_into(tmp)
        tmp.chmod(0o755)
        meta = {"name": final.name, "fingerprint": fingerprint(tmp), "versions_key": versions_key()}
        (tmp / FINGERPRINT_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if read_fingerprint(final) is None:  # not a concurrent writer's finished copy
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
