"""The MTP route's draft tags: what a link carries so that `fits` knows which prompts it serves.

Plain NamedTuples (they go into link files through core/disk/tags.py TagCodec, by name).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DraftStep", "NextToken", "RebuiltAnchor"]


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
