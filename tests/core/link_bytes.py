"""Link bytes in the core, disk and cluster tests: a link filled with seeded bytes, and what a
restore from a link store writes (the tests compare restores by it)."""

from __future__ import annotations

import torch

from vllm_hybridcache.core import LinkStore


def fill_seeded(store: LinkStore, link_id: int, rows: dict, gen: torch.Generator) -> None:
    """Allocate link `link_id` with `rows` per view, fill every part with bytes from `gen`
    and seal it, as a worker's capture would (with made-up bytes)."""
    bufs = store.allocate(link_id, rows)
    for t in (*bufs.sections.values(), *bufs.views.values()):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                dtype=torch.uint8, generator=gen))
    store.seal(link_id)


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
