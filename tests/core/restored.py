"""What a restore from a link store writes, as bytes: the tests compare restores by it."""

from __future__ import annotations

import torch

from vllm_hybridcache.core import LinkStore


def restored_bytes(store: LinkStore, chain) -> dict[str, bytes]:
    """Every section of the deepest link of `chain` and every view's rows (concatenated from
    the root), as bytes, restored from `store` into fresh zeroed sections."""
    secs = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype))
            for s in store.layout.sections}
    rows: dict[str, list[bytes]] = {}

    def sink(name, start, t):
        rows.setdefault(name, []).append(t.contiguous().view(torch.uint8).numpy().tobytes())

    store.restore(chain, secs, sink)
    out = {k: v.view(torch.uint8).numpy().tobytes() for k, v in secs.items()}
    out.update({k: b"".join(v) for k, v in rows.items()})
    return out
