"""Where a finished request's end anchor ends, and which state block it copies.

Its own module because the rule is subtle (synchronous vs. async scheduling, drafts) and tested
on its own (tests/harness/test_async_scheduling.py, tests/connector/test_mtp_route.py); the
scheduler side calls it as a request finishes.
"""

from __future__ import annotations

__all__ = ["anchor_end"]


def anchor_end(num_computed: int, num_tokens: int, prompt_len: int, last_start: int,
               last_len: int, speculative: bool,
               in_flight: int | None = None) -> tuple[int, int] | None:
    """(tokens, section block) of a finished request's end anchor, or None for no anchor.

    Without drafts the anchor is the state after every forwarded token, in block 0: the
    capture runs in a step planned after the request finished, after every step that
    forwarded its tokens, and vLLM counts a step's tokens in `num_computed` when it schedules
    it. Under synchronous scheduling that is every token but the last one sampled.

    `in_flight` (async scheduling only; None when synchronous): the request's output
    placeholders when it finished, the tokens still to come from steps in flight. vLLM's
    `AsyncScheduler` schedules a decode before the previous step's token is known (one step in
    flight), and takes the placeholder of the token it just received off before the request
    finishes. So a request that stopped on a token (a stop id, EOS) has usually been scheduled
    once more: that step forwards the stop token and leaves the state after all `num_tokens`
    (`num_computed == num_tokens`, one placeholder left); one that reached `max_tokens` was not
    (vLLM skips a step it knows to be the last's successor: `num_computed == num_tokens - 1`,
    none left). Either way the tokens settled (`num_computed - in_flight`) are all but the last
    sampled, and the anchor covers `num_computed` tokens; any other count (more than one step
    in flight, a count vLLM rolled back) gives no anchor. Drafts under async scheduling give
    none either: their in-flight verify step overwrites the state blocks (see
    `SchedulerSide.__init__`).

    With
    drafts the last step is a verify step that forwarded `last_len` tokens from `last_start`
    and wrote the state after its j-th token to block j; its rejected tokens are already taken
    off `num_computed`, and a stop inside the accepted ones leaves fewer tokens in the request
    than were forwarded (`num_tokens`), so the anchor ends at the last token kept but one (the
    last one is the first the next turn forwards) and copies that token's block. A request
    that finished in a prefill step gets none (a short chunk runs as a decode: on doubt, miss).
    """
    if in_flight is not None:
        if speculative or in_flight not in (0, 1) or num_computed - in_flight != num_tokens - 1:
            return None
        return num_computed, 0
    if not speculative:
        return num_computed, 0
    n = min(num_computed, num_tokens - 1)
    block = n - 1 - last_start
    if last_start < prompt_len or not 0 <= block < last_len:
        return None
    return n, block
