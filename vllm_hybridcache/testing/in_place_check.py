"""The soak run's check of attention K/V in place: the blocks a restore took from vLLM's block
pool hold the rows the restored links were computed over.

Why: a hit served in place reads, below its shared end, vLLM's cached blocks instead of the rows
its links stored; it is exact only if those blocks hold the same rows (docs/how-it-works.md,
"Attention K/V in place"). Nothing in production compares them (that would cost the copy the
sharing saves), so the soak run does, at every such restore in its workers: after the load, each
shared block is gathered and compared with the last stored copy of that block in the restored
chain (the copy a restore without sharing would have written). A float32 engine in step mode is
not batch-invariant, so two cold prefills of one prefix may differ in the last bits; a block
that differs by more than `GROSS` holds other rows altogether and fails the soak run
(benchmarks/soak/report.py). docs/reliability.md says what the check found so far.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_hybridcache.core.layout import torch_dtype

if TYPE_CHECKING:
    from vllm_hybridcache.adapter.plans import LoadJob
    from vllm_hybridcache.adapter.worker_side import WorkerSide

__all__ = ["GROSS", "InPlaceCheck"]

GROSS = 1e-3
"""Largest absolute difference of one value between a shared block and its stored copy that
rounding explains: float32 step-mode batches measured at most 2.6e-6, bf16 rounds at 4e-3 of
a value near 1, so only a bf16 or float32 block whose rows are another computation's (another
state, other positions) exceeds it by far; fp8 K/V is compared by bytes only."""


class InPlaceCheck:
    """Compares, after each restore with a shared prefix, vLLM's shared blocks with the
    restored chain's stored copies of them (module docstring).

    `counts`: `restores` checked, `blocks` compared, `differing` (any byte), `gross` (a value
    off by more than `GROSS`); `worst`: the largest absolute difference seen."""

    def __init__(self, worker: WorkerSide) -> None:
        self.worker = worker
        self.counts = {"restores": 0, "blocks": 0, "differing": 0, "gross": 0}
        self.worst = 0.0

    def __call__(self, job: LoadJob) -> None:
        worker = self.worker
        parts = worker.parts
        if parts is None or not job.chain or job.in_place <= 0:
            return
        layout = parts.layout
        shared = job.in_place // layout.view_block_tokens
        if shared <= 0:
            return
        rows = layout.view_rows(0, job.chain[-1].end)
        stored = {v.name: torch.empty((rows, *v.row_shape), dtype=torch_dtype(v.dtype))
                  for v in layout.views}
        worker.store.restore_views_into(job.chain, stored)  # later links' copies win
        self.counts["restores"] += 1
        n = min(shared, rows)
        for name, (gid, acc) in worker._rows.items():
            mine = stored[name][:n].reshape(n, -1).view(torch.uint8)
            pool = torch.empty_like(mine)
            acc.gather(job.block_ids[gid], 0, pool)
            self._compare(pool, mine, acc.tensor.dtype)

    def _compare(self, pool: torch.Tensor, mine: torch.Tensor, dtype: torch.dtype) -> None:
        differing = (pool != mine).any(dim=1)
        self.counts["blocks"] += int(pool.shape[0])
        self.counts["differing"] += int(differing.sum())
        if not bool(differing.any()):
            return
        if dtype.is_floating_point and dtype.itemsize >= 2:
            a = pool.view(dtype).float()
            b = mine.view(dtype).float()
            diff = (a - b).abs().nan_to_num(nan=float("inf")).amax(dim=1)
        else:  # fp8 or integer K/V: bytes only, a differing block counts as gross
            diff = torch.where(differing, float("inf"), 0.0)
        self.counts["gross"] += int((diff > GROSS).sum())
        self.worst = max(self.worst, float(diff.max()))

    def report(self) -> dict[str, int]:
        """The counts keyed `in_place_<name>` (all summable: the soak's monitor adds up every
        `in_place_*` key over workers and lives)."""
        return {f"in_place_{k}": v for k, v in self.counts.items()}
