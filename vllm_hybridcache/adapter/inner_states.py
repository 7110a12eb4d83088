"""States at positions inside a step, handed over by the model (fine segmentation).

Where the kernel backend is split-invariant at 64-aligned positions, the scheduler side plans
captures inside a step (`CaptureJob.inner_offset` > 0; docs/split-invariance.md). The model's
state layers run their recurrent ops piece by piece at those offsets and hand each state to an
injected hook (`InnerCapture`, inner_capture.py); this module is that hook, owned by the
worker side: it is armed with the step's plan before the forward (which request slot wants
which offsets), keeps the states the layers hand over, and gives the capture job its sections
after the forward. The model never sees the cache, and a state that did not arrive fails the
capture (its link is aborted), never falls back to another state.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from vllm_hybridcache.adapter.plans import CaptureJob, StepPlan


class InnerStates:
    """One step's wanted offsets and received states, for every section layer of a worker.

    `sources`: section name -> (KV-cache group id, layer name, state index), as the part map
    names them. A layer's state slot is a block id of its own group, so wants are keyed by
    (group, slot).
    """

    def __init__(self, sources: dict[str, tuple[int, str, int]]) -> None:
        self.sources = sources
        self._gids = sorted({gid for gid, _, _ in sources.values()})
        self._want: dict[tuple[int, int], tuple[int, ...]] = {}
        self._got: dict[tuple[str, int, int, int], torch.Tensor] = {}

    def hook(self, gid: int) -> _LayerHook:
        """The `InnerCapture` hook for the layers of group `gid`."""
        return _LayerHook(self, gid)

    def arm(self, plan: StepPlan) -> None:
        """Before the step's forward: the offsets its inner captures want (none: disarmed)."""
        self._got.clear()
        want: dict[tuple[int, int], set[int]] = defaultdict(set)
        for job in plan.captures:
            if job.inner_offset > 0:
                for gid in self._gids:
                    want[(gid, job.block_ids[gid][job.section_block])].add(job.inner_offset)
        self._want = {k: tuple(sorted(v)) for k, v in want.items()}

    def offsets(self, gid: int, slot: int) -> tuple[int, ...]:
        return self._want.get((gid, slot), ())

    def put(self, layer: str, slot: int, offset: int, index: int, value: torch.Tensor) -> None:
        self._got[(layer, slot, offset, index)] = value.detach().clone()

    def sections(self, job: CaptureJob) -> dict[str, torch.Tensor]:
        """After the forward: every section of `job`'s link at its inner offset. KeyError
        names the first state the model did not hand over (the capture then fails)."""
        out = {}
        for name, (gid, layer, idx) in self.sources.items():
            key = (layer, job.block_ids[gid][job.section_block], job.inner_offset, idx)
            if key not in self._got:
                raise KeyError(f"no state {name} at offset {job.inner_offset} of this step")
            out[name] = self._got[key]
        return out

    def clear(self) -> None:
        """After the step's captures: nothing is kept to the next step."""
        self._got.clear()
        self._want = {}


class _LayerHook:
    """`inner_capture.InnerCapture` for the layers of one KV-cache group."""

    def __init__(self, owner: InnerStates, gid: int) -> None:
        self._owner, self._gid = owner, gid

    def offsets(self, slot: int) -> tuple[int, ...]:
        return self._owner.offsets(self._gid, slot)

    def put(self, layer: str, slot: int, offset: int, index: int, value: torch.Tensor) -> None:
        self._owner.put(layer, slot, offset, index, value)
