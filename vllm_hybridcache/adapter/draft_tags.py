"""The MTP route's draft-tag policy: what a link carries so that `fits` knows which prompts it
serves, and which prompt tokens the draft head's boundary row reads on this engine.

The tags are plain NamedTuples (they go into link files through core/linkformat/tags.py TagCodec, by
name); `draft_reads` picks the route's rule once per engine; the per-request tag and fit
(`RequestState.draft_tag` / `fits`, adapter/request_state.py) apply it to one prompt.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DRAFT_READS_BOTH", "DRAFT_READS_LAST", "DRAFT_REBUILD", "DraftStep", "NextToken",
           "RebuiltAnchor", "draft_reads"]


class DraftStep(NamedTuple):
    """A tree link's tag on the MTP rebuild route: the first position of the prefill step that
    ended at its cut. The link keeps the draft head's input at its boundary row, and a restore
    rebuilds that row on a step of this shape, which must be the new prompt's step too."""

    start: int


class NextToken(NamedTuple):
    """An end anchor's draft tag on the MTP route: the anchor's last draft-head row read this
    token (the request's last sampled token, the first one it did not forward), so the anchor
    fits a prompt only if that token comes next."""

    token: int


class RebuiltAnchor(NamedTuple):
    """An end anchor's draft tag on the rebuild route: the anchor keeps the target's hidden
    row at its last position and where its boundary draft row sat in the last verify step's
    draft pass, and a restore rebuilds that row for the next turn's token there (adapter/
    draft_rows.py), so the anchor fits every prompt that extends its tokens."""


DRAFT_READS_LAST = "last"
DRAFT_READS_BOTH = "both"
DRAFT_REBUILD = "rebuild"


def draft_reads(vllm_config) -> str | None:
    """Which prompt tokens the draft head's row at a partial prefill step's last position
    reads, beyond the tokens before the cut; None without speculative decoding.

    The draft head's row at position i is computed from the target's hidden state at i and
    the token at i + 1. At a step's last position p - 1 of a partial prefill, vLLM's EAGLE/MTP
    proposer takes that token from its "next token" for the request: on the padded drafter
    batch (the default) the backup token, which is the request's last known token, i.e. the
    prompt's last token (`prepare_next_token_ids_padded`); with `disable_padded_drafter_batch`
    the prompt's token at p (`prepare_next_token_ids_cpu`). `last` is exact for the padded
    EAGLE/MTP path and measured so in tests/connector/test_mtp_route.py; every other
    speculative method or path keeps both tokens (`both`), which is exact for either.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    if (spec.method in ("mtp", "eagle", "eagle3") and not spec.disable_padded_drafter_batch
            and not getattr(spec, "parallel_drafting", False)):
        return DRAFT_READS_LAST
    return DRAFT_READS_BOTH
