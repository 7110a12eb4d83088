"""`SegmentedScheduler`: every prefill step ends on the segmentation.

vLLM clips each prefill chunk, in both its waiting and running paths, through a private hook
that `compat.install_prefill_split` wraps (see there for the vLLM versions it was checked on).
We install `_split` there: a step that starts at position s ends no later than the first cut
after s. A resumed prefill then runs exactly the steps a cold one runs, which is what makes a
restored link exact. Nothing else in `schedule()` changes; `--scheduler-cls` is vLLM's
documented way to supply this class.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from vllm_hybridcache.compat import (
    install_prefill_split,
    require_supported_vllm,
    scheduler_has_recurrent_layers,
)
from vllm_hybridcache.segmentation import first_cut_after


class SegmentedScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require_supported_vllm()
        super().__init__(*args, **kwargs)
        connector = self.get_kv_connector()
        active = bool(getattr(connector, "snapshot_cache_active", False))
        self._cuts_for = connector.cuts_for if active else None
        if self._cuts_for is not None and scheduler_has_recurrent_layers(self):
            install_prefill_split(self, self._split)

    def _split(self, request: Any, num_new_tokens: int, num_new_local_computed_tokens: int,
               num_external_computed_tokens: int) -> int | None:
        """Tokens of this step so it ends on the next cut; None keeps vLLM's own clipping."""
        cuts = self._cuts_for(request) if self._cuts_for is not None else None
        if cuts is None:
            return None
        start = (request.num_computed_tokens + num_new_local_computed_tokens
                 + num_external_computed_tokens)
        if start >= request.num_prompt_tokens:
            return num_new_tokens
        end = min(start + num_new_tokens, first_cut_after(cuts, start, start + num_new_tokens))
        return max(end - start, 0)
