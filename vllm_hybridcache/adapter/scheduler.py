"""`SegmentedScheduler`: every prefill step ends on the segmentation.

vLLM already clips each prefill chunk, in both its waiting and running paths, through
`Scheduler._mamba_block_aligned_split` when `need_mamba_block_aligned_split` is set. We set the
flag and replace that one method: a step that starts at position s ends no later than the first
cut after s. A resumed prefill then runs exactly the steps a cold prefill runs, which is what
makes a restored link exact. Nothing else in `schedule()` changes.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from vllm_hybridcache.segmentation import first_cut_after


class SegmentedScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        active = bool(getattr(self.connector, "snapshot_cache_active", False))
        self._cuts_for = self.connector.cuts_for if active else None
        if self._cuts_for is not None and self.has_mamba_layers:
            self.need_mamba_block_aligned_split = True

    def _mamba_block_aligned_split(
        self,
        request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        cuts = self._cuts_for(request) if self._cuts_for is not None else None
        if cuts is None:
            return super()._mamba_block_aligned_split(
                request, num_new_tokens, num_new_local_computed_tokens,
                num_external_computed_tokens)
        start = (request.num_computed_tokens + num_new_local_computed_tokens
                 + num_external_computed_tokens)
        if start >= request.num_prompt_tokens:
            return num_new_tokens
        end = min(start + num_new_tokens, first_cut_after(cuts, start, start + num_new_tokens))
        return max(end - start, 0)
