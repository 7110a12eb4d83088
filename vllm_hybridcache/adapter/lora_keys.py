"""LoRA adapters in the domain: named by the digest of their files, never by the client's name.

A LoRA request carries a name and an integer id the client (or the operator's resolver)
chooses. Keyed by those, a new adapter published under an old name would be served the old
adapter's states from the disk tier after a restart, or from another replica. The domain
names an adapter by the sha256 of the files vLLM loads it from (`adapter_config.json` and the
weights: `adapter_model.safetensors`, `.bin`, `.pt`), found where vLLM's
`get_adapter_absolute_path` finds them (a path, or the Hugging Face cache snapshot of a hub
name; this module never downloads). Digests are remembered per folder by the files' (name,
size, mtime, inode), so a request costs a directory listing, not a read.

An adapter whose files cannot be found or read cannot be named: its request is served
without the cache (miss reason `unkeyed_input`).

Inside one engine, vLLM's worker keeps an adapter loaded under its integer id and does not
read the files again for later requests with that id (unless `load_inplace`). So the files'
digest names the weights a request runs with only while it is the digest the engine saw first
for that id: `AdapterBindings` keeps that first digest per id; a request whose files now
differ is not keyed (the worker may still hold the old weights), and an in-place reload
rebinds the id and ends the captures of requests in flight on it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from vllm_hybridcache.adapter.fingerprint import file_digest, hub_snapshot
from vllm_hybridcache.adapter.mm_keys import UnkeyableInput

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
"""The files vLLM 0.32's `LoRAModel.from_local_checkpoint` and `PEFTHelper.from_local_dir`
read (the first weight file present wins there; every one present is hashed here)."""

_MEMO: dict[str, tuple[tuple, str]] = {}
"""folder -> (stamps of its adapter files, digest): a request re-lists, never re-reads."""


def adapter_folder(lora_path: str) -> Path | None:
    """Where vLLM loads the adapter from (`vllm.lora.utils.get_adapter_absolute_path`,
    without its download): an absolute or `~` path as given, a relative path that exists, else
    the hub cache snapshot of the name; None when there is none."""
    if not lora_path:
        return None
    if os.path.isabs(lora_path):
        return Path(lora_path)
    if lora_path.startswith("~"):
        return Path(os.path.expanduser(lora_path))
    if os.path.exists(lora_path):
        return Path(os.path.abspath(lora_path))
    try:
        import vllm.envs as envs

        if envs.VLLM_USE_MODELSCOPE:
            return None  # ModelScope's cache: not read here
    except Exception:
        pass
    return hub_snapshot(lora_path, None, None)


def adapter_digest(lora_path: str) -> str:
    """sha256 over the adapter's config and weight files (names and contents).

    Raises UnkeyableInput when the folder, its config or every weight file is missing, or a
    file cannot be read."""
    folder = adapter_folder(lora_path)
    if folder is None or not folder.is_dir():
        raise UnkeyableInput(f"LoRA adapter {lora_path!r}: no local folder")
    names = (ADAPTER_CONFIG, *ADAPTER_WEIGHTS)
    try:
        found = [(n, folder / n) for n in names if (folder / n).is_file()]
        if not any(n == ADAPTER_CONFIG for n, _ in found) or len(found) < 2:
            raise UnkeyableInput(f"LoRA adapter {lora_path!r}: {ADAPTER_CONFIG} or its weights "
                                 f"missing in {folder}")
        stamps = []
        for n, p in found:
            st = p.stat()
            stamps.append((n, st.st_size, st.st_mtime_ns, st.st_ino, str(p.resolve())))
        key = str(folder.resolve())
        hit = _MEMO.get(key)
        if hit is not None and hit[0] == tuple(stamps):
            return hit[1]
        h = hashlib.sha256()
        for n, p in found:
            h.update(n.encode() + b"\0" + file_digest(p).encode() + b"\0")
    except OSError as e:
        raise UnkeyableInput(f"LoRA adapter {lora_path!r}: {type(e).__name__}: {e}") from e
    _MEMO[key] = (tuple(stamps), h.hexdigest())
    return h.hexdigest()


def lora_key(lora_request) -> str:
    """The domain's `lora` field: '' without an adapter, else the digest of its files (and
    how vLLM reads the weights: `is_3d_lora_weight`). Raises UnkeyableInput."""
    if lora_request is None:
        return ""
    digest = adapter_digest(str(getattr(lora_request, "lora_path", "") or ""))
    layout = ";3d" if getattr(lora_request, "is_3d_lora_weight", False) else ""
    return f"sha256:{digest}{layout}"


class AdapterBindings:
    """The adapter digest this engine's workers hold under each LoRA integer id."""

    def __init__(self) -> None:
        self._bound: dict[int, str] = {}

    def admit(self, lora_request, key: str) -> tuple[bool, bool]:
        """(whether a request with this adapter key may use the cache, whether the id was
        just rebound by an in-place reload: requests in flight on it must capture no more)."""
        int_id = int(lora_request.lora_int_id)
        held = self._bound.get(int_id)
        if held is None or held == key:
            self._bound[int_id] = key
            return True, False
        if getattr(lora_request, "load_inplace", False):
            self._bound[int_id] = key  # the worker reloads the files for this request
            return True, True
        return False, False
