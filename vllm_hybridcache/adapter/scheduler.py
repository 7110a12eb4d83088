"""`SegmentedScheduler`: every prefill step ends on the segmentation.

vLLM clips each prefill chunk, in both its waiting and running paths, through a private hook
that `compat.install_prefill_split` wraps (see there for the vLLM versions it was checked on).
We install `_split` there: a step that starts at position s ends no later than the first cut
after s. A resumed prefill then runs exactly the steps a cold one runs, which is what makes a
restored link exact. Nothing else in `schedule()` changes; `--scheduler-cls` is vLLM's
documented way to supply this class.

With `attention_in_place` the scheduler also gets an attention-only prefix cache
(`compat.install_attention_in_place`): a hit's attention K/V comes from vLLM's shared blocks,
capped by the connector below the link that restores the recurrent state. Requests are hashed
again with a provenance key on the blocks they write off the segmentation
(`compat.provenance_block_hasher`); positions found off it during a step are marked at the
end of that `schedule()` (and any found between steps at the start of the next), before vLLM
registers those blocks.

Synchronous loads (`sync_loads`): a RAM hit loads in the step that runs it. vLLM 0.32 cannot
recover such a load that fails on a model with several KV-cache groups, so this class does
(`update_from_output`, before vLLM applies the step: `compat.withdraw_failed_sync_load`). Only
on synchronous scheduling, where a step's report arrives before the next step is planned.

Async scheduling: `--scheduler-cls` names one class, but vLLM decides whether it schedules
asynchronously only after the command line is parsed (`VllmConfig`: on by default on GPUs, off
on vLLM's CPU platform), and `get_scheduler_cls` returns a custom class as is. So the class
named, `SegmentedScheduler`, picks its own flavour when `EngineCore` instantiates it: with
`scheduler_config.async_scheduling` on, `__new__` makes a `SegmentedAsyncScheduler` instead,
which is this class over vLLM's `AsyncScheduler` (the shape of vLLM's own
`DiffusionAsyncScheduler(DiffusionScheduler, AsyncScheduler)`): the same hooks, with vLLM's
placeholders for the step in flight. Nothing here depends on when outputs arrive: the cut hook
reads `num_computed_tokens`, which vLLM advances when it schedules a step, so a prefill chunk
scheduled while the previous one is in flight starts where that one ends. Off-segmentation
marks are applied before `schedule()` returns as well as at its start: the async scheduler
also registers a request's blocks when a step's output arrives, up to the tokens scheduled so
far (the step in flight included), so the marks a plan finds must not wait for the next
`schedule()`.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_hybridcache.compat import require_supported_vllm

# vLLM imports this module when `--scheduler-cls` names the class: the cache is asked for, so
# an unsupported vLLM is refused here, with the guard's message, before anything of vLLM's
# that may have moved is imported.
require_supported_vllm()

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from vllm_hybridcache.compat import (  # noqa: E402
    decode_rows,
    install_attention_in_place,
    install_prefill_split,
    prefill_step_limit,
    rehash_request,
    scheduler_has_recurrent_layers,
    withdraw_failed_sync_load,
)
from vllm_hybridcache.segmentation import first_cut_after  # noqa: E402

logger = logging.getLogger("vllm_hybridcache")


def _async_scheduling(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the engine being built schedules asynchronously: its `VllmConfig` (the keyword
    `EngineCore` passes, or the first positional argument of `Scheduler.__init__`) says so,
    resolved by the time a scheduler is built."""
    cfg = kwargs.get("vllm_config", args[0] if args else None)
    return bool(getattr(getattr(cfg, "scheduler_config", None), "async_scheduling", False))


class SegmentedScheduler(Scheduler):
    """vLLM's scheduler with the segmentation hook (and attention K/V in place): the class
    `--scheduler-cls` names. Built under async scheduling it is a `SegmentedAsyncScheduler`."""

    def __new__(cls, *args: Any, **kwargs: Any) -> SegmentedScheduler:
        # A subclass is returned, so Python runs its __init__ with these arguments as usual.
        target = (SegmentedAsyncScheduler
                  if cls is SegmentedScheduler and _async_scheduling(args, kwargs) else cls)
        return super().__new__(target)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require_supported_vllm()
        super().__init__(*args, **kwargs)
        if isinstance(self, AsyncScheduler):
            logger.info("hybridcache: segmentation scheduler on vLLM's AsyncScheduler "
                        "(async scheduling)")
        connector = self.get_kv_connector()
        active = bool(getattr(connector, "snapshot_cache_active", False))
        self._cuts_for = connector.cuts_for if active else None
        self._waits_for_room = connector.waits_for_room if active else None
        self._in_place = None
        self._sync_side = None
        if self._cuts_for is not None and scheduler_has_recurrent_layers(self):
            install_prefill_split(self, self._split)
            side = connector.in_place_side()
            if side is not None:
                self._install_in_place(side)
            side = connector.sync_load_side()
            if side is None:
                why = "sync_loads off or the MTP route"
            elif isinstance(self, AsyncScheduler):
                # the next step is planned on top of a failed one before its report arrives
                why = "async scheduling"
            else:
                side.sync_loads = True
                self._sync_side = side
                why = ""
            logger.info("hybridcache: RAM hits load %s", f"a step ahead ({why})" if why
                        else "in the step that runs them (sync_loads)")

    def _install_in_place(self, side: Any) -> None:
        try:
            self._in_place = install_attention_in_place(self, side.in_place_cap)
        except RuntimeError as e:
            logger.warning("hybridcache: attention K/V in place not available: %s", e)
            return
        side.in_place_block = self._in_place.block_size
        side.share_blocks = self._in_place.share
        self._side = side
        self._marked: dict[str, int] = {}  # request id -> off-segmentation position applied
        self._hasher = self._in_place.hasher(self._off_from)
        logger.info("hybridcache: attention K/V in place (attention block %d, hash block %d)",
                    self._in_place.block_size, self._in_place.hash_block_size)

    def _off_from(self, request: Any) -> int:
        return self._marked.get(request.request_id, request.num_prompt_tokens)

    def add_request(self, request: Any) -> None:
        if self._in_place is not None and request.request_id not in self.requests:
            rehash_request(request, self._hasher)
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._apply_off_segmentation()
        out = super().schedule(*args, **kwargs)
        # the positions this step's plan found: marked before schedule() returns, so before
        # anything registers the step's blocks (under async scheduling, the output of the step
        # in flight can: `AsyncScheduler` caches a request's blocks up to its scheduled tokens
        # when a token arrives, a stale one after a preemption included)
        self._apply_off_segmentation()
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self._sync_side is not None:
            self._withdraw_failed_loads(model_runner_output)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _withdraw_failed_loads(self, model_runner_output: Any) -> None:
        """Before vLLM applies a step's output: every request whose synchronous load failed
        in it, and any request that read the blocks that load wrote, is withdrawn
        (`compat.withdraw_failed_sync_load`: its output dropped, its blocks out of the prefix
        cache, back to the waiting queue from token 0), and the links the step captured for
        them are aborted. The failed request's connector state says cold-only (the report's
        failed load), so it recomputes; the others look up again."""
        kv = getattr(model_runner_output, "kv_connector_output", None)
        report = getattr(kv, "kv_connector_worker_meta", None)
        failed = self._sync_side.failed_sync_loads(report)
        if not failed:
            return
        withdrawn: dict[str, int] = {}
        for req_id, in_place in failed.items():
            for rid in withdraw_failed_sync_load(self, req_id, in_place):
                withdrawn[rid] = self.requests[rid].num_output_tokens
        self._sync_side.withdrawn(report, withdrawn)
        logger.warning("hybridcache: synchronous load failed for %s; withdrawn with its step "
                       "and recomputed: %s", ", ".join(sorted(failed)),
                       ", ".join(sorted(withdrawn)))

    def _apply_off_segmentation(self) -> None:
        """Mark the blocks of positions the connector found written off the segmentation
        (`compat.mark_off_segmentation`) before vLLM registers them."""
        if self._in_place is None:
            return
        for req_id, position in self._side.take_off_segmentation():
            request = self.requests.get(req_id)
            if request is None:
                continue
            old = self._off_from(request)
            if position < old:
                self._in_place.mark(request, old, position)
                self._marked[req_id] = position
        for req_id in [r for r in self._marked if r not in self.requests]:
            del self._marked[req_id]

    def _split(self, request: Any, num_new_tokens: int, num_new_local_computed_tokens: int,
               num_external_computed_tokens: int) -> int | None:
        """Tokens of this step so it ends on the next cut; None keeps vLLM's own clipping."""
        cuts = self._cuts_for(request) if self._cuts_for is not None else None
        if cuts is None:
            return None
        start = (request.num_computed_tokens + num_new_local_computed_tokens
                 + num_external_computed_tokens)
        prompt_len = request.num_prompt_tokens
        if start >= prompt_len:
            return num_new_tokens
        target = first_cut_after(cuts, start, prompt_len)
        if start + num_new_tokens < target and self._waits(request, target - start):
            return 0
        return max(min(start + num_new_tokens, target) - start, 0)

    def _waits(self, request: Any, segment: int) -> bool:
        """Whether a step that cannot reach the request's next cut (`segment` tokens away, the
        prompt's end past its last cut) should give it nothing rather than the tokens left.

        A step cut short of a cut takes the rest of the prompt off the segmentation: no link
        from there, and its attention blocks are not shared in place. So the request waits for
        a step with room, as vLLM's own align mode waits for a block-aligned chunk; but only
        where such a step is bound to come: the segment fits one request's share of a step
        (`prefill_step_limit`) beside every running decode (`decode_rows`). Then only other
        prefills took the budget, and those end (the first in the step's order always gets its
        whole segment), so waiting never starves the request. Where decodes alone leave too
        little room, the request already left its cuts, or `step_wait` is off, it takes the
        tokens left as before.
        """
        if self._waits_for_room is None or not self._waits_for_room(request):
            return False
        return segment <= prefill_step_limit(self) - decode_rows(self, request)


class SegmentedAsyncScheduler(SegmentedScheduler, AsyncScheduler):
    """`SegmentedScheduler` over vLLM's `AsyncScheduler` (method order: ours, then vLLM's async
    placeholders, then `Scheduler`): what `SegmentedScheduler(...)` builds when the engine
    schedules asynchronously. Nothing is overridden here; the end anchors' reading of the
    async scheduler's placeholders is in `adapter/anchor_end.py`."""
