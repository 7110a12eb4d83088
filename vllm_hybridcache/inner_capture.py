"""The inner-capture hook: how a GDN layer hands out states at positions inside a step.

Two layers produce these states (Flash-Next's own GDN layer, and vLLM's CPU GDN op loop that
`compat.install_cpu_gdn_inner_states` bends) and one consumes them (the adapter's
`inner_states`, which captures links at inner cuts: docs/split-invariance.md). The protocol and
the rule that splits a request's step into pieces live here, below all three, so none of them
imports another for it.
"""

from __future__ import annotations

from typing import Protocol

import torch

INNER_ALIGN = 64  # inner capture offsets are multiples of the GDN chunk size


class InnerCapture(Protocol):
    """Where a layer hands states at positions inside a step (owned by the adapter).

    `offsets(slot)`: the offsets from the step's start (multiples of `INNER_ALIGN`, ascending)
    at which the prefilling request reading state slot `slot` wants its states; () for none.
    `put(layer, slot, offset, index, value)`: state `index` of `layer` after `offset` tokens of
    this step (a tensor the layer no longer writes).
    """

    def offsets(self, slot: int) -> tuple[int, ...]: ...

    def put(self, layer: str, slot: int, offset: int, index: int, value: torch.Tensor) -> None:
        ...


def capture_pieces(capture: InnerCapture | None, slot: int, length: int) -> list[int]:
    """Piece ends for one prefilling request of `length` tokens: its wanted offsets inside the
    step (0 < offset < length, multiples of INNER_ALIGN), then `length`."""
    if capture is None:
        return [length]
    inner = [o for o in capture.offsets(slot) if 0 < o < length and o % INNER_ALIGN == 0]
    return [*inner, length]
