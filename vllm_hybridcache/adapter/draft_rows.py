"""MTP route: rebuild the draft head's boundary rows for the prompt being restored.

With speculative decoding the draft head (MTP) writes one K/V row per position; its row at
position i is computed from the target's hidden row at i and one token. Inside a prefill step
that token is the prompt's token at i + 1, so those rows depend only on tokens before the cut.
The row at a step's last position p - 1 is different: vLLM's drafter gives it the request's
"next token", which in a partial prefill on its default padded batch is the prompt's *last*
token (`prepare_next_token_ids_padded`), and the sampled token at the prompt's end. A link at
cut p therefore holds a boundary row that belongs to the prompt that captured it.

Instead of refusing such links for every other prompt, each link keeps what the boundary row
is made from besides the token: the target's hidden row at p - 1, as one more section of the
link (`DRAFT_INPUT`, tapped from the drafter's first pass by a forward pre-hook on the draft
head). A restore writes the chain's rows as stored and then recomputes the boundary row of
every link with the new prompt's token, by the draft head's own code (`draft_rows`) on inputs
of the shape the cold step had (the step's length in rows: GEMM kernels may round differently
for other shapes, a row never depends on the other rows' values). The rebuilt rows equal a
cold prefill's bit for bit (tests/connector/test_mtp_route.py).

End anchors (live continuation) keep the same input: the target's hidden row at the anchor's
last position, from the draft pass of the request's last verify step, which wrote the anchor's
boundary row for the request's last sampled token. A restore rebuilds that row for the next
turn's token at the anchor's end on the shape of that pass, so the anchor fits any next turn
that extends its tokens; with the same token the rebuilt row is the one the pass wrote, bit for
bit. Each link also keeps the geometry of the pass that wrote its boundary row (`DRAFT_PASS`),
so a link's bytes alone say how to rebuild it.

Only where it is measured: Flash-Next's MTP head (ours, `Qwen4ExpMTP`) on vLLM's default
padded drafter batch, one draft layer. Every other speculative path keeps the draft tags
(`draft_tags.draft_reads`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from vllm_hybridcache.adapter.parts import PartMap
from vllm_hybridcache.core.layout import SectionSpec, StateLayout, torch_dtype

# the section a link keeps the target's hidden row at its last position in
DRAFT_INPUT = "draft#boundary_hidden"
# the section with the geometry of the draft pass that wrote the link's boundary row:
# (row position q, q's index in the pass, the pass's row count); see PassGeometry
DRAFT_PASS = "draft#boundary_pass"
DRAFT_PASS_SPEC = SectionSpec(name=DRAFT_PASS, shape=(3,), dtype="int64")
REBUILD_ARCHITECTURES = ("Qwen4ExpMTP",)


class DraftRebuild(NamedTuple):
    """What a restore needs to rebuild the boundary rows: the token the new prompt gives every
    link's boundary row (a tree link: the prompt's last token, which its cold prefill gives
    every partial step's last draft row; an end anchor: the prompt's token at the anchor's
    end, the one the session continues with), and for tree links, per chain link (root first),
    the link's end p and the first position of the prefill step that ends there, which the
    link's kept pass geometry must match (an end anchor: (), its geometry is its own)."""

    token: int
    steps: tuple[tuple[int, int], ...]


class PassGeometry(NamedTuple):
    """Where a boundary row sat in the draft pass that wrote it: the row's position `q`, its
    index in the pass and the pass's row count. A rebuild reruns the draft layer on a pass of
    `rows` rows (the kept inputs and position q repeated) and takes row `index`: a row's bits
    depend on the pass's shape, never on the other rows' values."""

    q: int
    index: int
    rows: int

    @classmethod
    def step(cls, start: int, end: int) -> PassGeometry:
        """A prefill step [start, end): its first draft pass ends at the boundary row."""
        return cls(end - 1, end - 1 - start, end - start)

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(tuple(self), dtype=torch.int64)

    @classmethod
    def of(cls, t: torch.Tensor) -> PassGeometry:
        q, index, rows = (int(x) for x in t.tolist())
        if not 0 <= index < rows or q < 0:
            raise ValueError(f"bad draft pass geometry {(q, index, rows)}")
        return cls(q, index, rows)


def rebuild_input(vllm_config) -> SectionSpec | None:
    """The section that carries a link's boundary hidden row, or None where the boundary rows
    cannot be rebuilt (no speculative decoding, another method, drafter path or draft model)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.method != "mtp" or spec.disable_padded_drafter_batch:
        return None
    if getattr(spec, "parallel_drafting", False):
        return None
    draft = spec.draft_model_config
    archs = tuple(getattr(draft.hf_config, "architectures", None) or ())
    if not any(a in REBUILD_ARCHITECTURES for a in archs):
        return None
    from vllm_hybridcache.flash_next.registration import use_ours

    if not use_ours():
        return None  # vLLM's in-tree MTP head: no draft_rows
    text = draft.hf_text_config
    if int(getattr(text, "mtp_num_hidden_layers", 1) or 1) != 1:
        return None
    dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    return SectionSpec(name=DRAFT_INPUT, shape=(int(draft.get_hidden_size()),), dtype=dtype)


def with_draft_input(parts: PartMap, section: SectionSpec | None) -> PartMap:
    """`parts` with the boundary-input sections (the hidden row, the pass geometry) added to
    its layout (not to the KV-backed sections: the worker fills them from the drafter, not
    from a KV tensor)."""
    if section is None:
        return parts
    layout = parts.layout
    layout = StateLayout(sections=(*layout.sections, section, DRAFT_PASS_SPEC),
                         views=layout.views,
                         view_block_tokens=layout.view_block_tokens)
    return dataclasses.replace(parts, layout=layout)


class BoundaryTap:
    """Worker side: the draft head's inputs at each request's rows of a pass.

    A forward pre-hook on the draft head records, for every request of every draft pass, the
    target hidden row at its last position, keyed by (the request's first block in the draft
    head's KV group, that position), with the pass's row count for the request. A capture at
    cut p takes the entry at p - 1: only the step's first pass has the request's last row at
    p - 1 (later passes of k > 1 drafts sit at p, p + 1, ...). Cleared after every step.

    For end anchors it also keeps, per request (first block), the first pass of its latest
    verify step (at most `verify_rows` rows for it): the hidden rows, their first position,
    their index in the pass and the pass's row count. A request's anchor is captured in the
    step after its last one, while vLLM keeps its blocks, so no other request can have
    replaced that entry; an entry of another step is refused by its positions.
    """

    def __init__(self, head: torch.nn.Module, attn_layer: Any, gid: int,
                 section: SectionSpec, verify_rows: int) -> None:
        self.head = head
        self.attn = attn_layer           # the draft layer's attention (its kv_cache, prefix)
        self.gid = gid                   # the draft head's KV-cache group
        self.verify_rows = verify_rows   # 1 + k: a verify step's rows per request
        # where a restore puts the deepest link's boundary input (read from the store instead)
        self.scratch = torch.empty(section.shape, dtype=torch_dtype(section.dtype))
        self.pass_scratch = torch.empty(DRAFT_PASS_SPEC.shape, dtype=torch.int64)
        self._seen: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        # first block -> (first position, hidden rows, index of the first row, pass rows)
        self._verify: dict[int, tuple[int, torch.Tensor, int, int]] = {}
        self._verify_step: set[int] = set()  # first blocks whose first pass this step is kept
        self._hook = head.register_forward_pre_hook(self._observe)

    def _observe(self, module, args) -> None:
        from vllm_hybridcache.compat import layer_attn_metadata

        meta = layer_attn_metadata(self.attn.prefix)
        if meta is None or len(args) < 3 or args[2] is None:
            return  # profiling or a dummy run
        positions, hidden = args[1], args[2]
        qsl = meta.query_start_loc_cpu.long()
        n = qsl.numel() - 1
        if n <= 0:
            return
        ends = qsl[1:] - 1
        lens = (qsl[1:] - qsl[:-1]).tolist()
        starts = qsl[:-1].tolist()
        total = int(qsl[-1])
        last_pos = positions[ends.to(positions.device)].long().tolist()
        first_blocks = meta.block_table[:n, 0].long().tolist()
        rows = hidden[ends.to(hidden.device)].detach().clone()
        for r in range(n):
            self._seen[(first_blocks[r], last_pos[r])] = (rows[r], lens[r])
            fb = first_blocks[r]
            if lens[r] > self.verify_rows:
                self._verify.pop(fb, None)  # a prefill on that block: another request's now
            elif lens[r] > 0 and fb not in self._verify_step:
                self._verify_step.add(fb)  # the step's first pass only
                lo = starts[r]
                self._verify[fb] = (last_pos[r] - lens[r] + 1,
                                    hidden[lo:lo + lens[r]].detach().clone(), lo, total)

    def take(self, first_block: int, end: int, step: int) -> torch.Tensor:
        """The hidden row the first pass of the step [step, end) read at end - 1 (ValueError
        when the drafter did not run that step as planned: then the link is not kept)."""
        got = self._seen.get((first_block, end - 1))
        if got is None:
            raise ValueError(f"no draft pass ended at position {end - 1}")
        row, rows = got
        if rows != end - step:
            raise ValueError(f"the draft pass had {rows} rows, the step {end - step}")
        return row

    def take_anchor(self, first_block: int, end: int, start: int,
                    length: int) -> tuple[torch.Tensor, PassGeometry]:
        """An end anchor at `end` after a verify step [start, start + length): the hidden row
        its first draft pass read at end - 1 and where that row sat in the pass (ValueError
        when no such pass was seen: then the anchor is not kept)."""
        got = self._verify.pop(first_block, None)
        if got is None:
            raise ValueError("no verify-step draft pass was seen for the request")
        first, rows, lo, total = got
        if first != start or rows.shape[0] != length or not start < end <= start + length:
            raise ValueError(f"the last draft pass covered {first}..{first + rows.shape[0]}, "
                             f"the verify step {start}..{start + length}, the anchor {end}")
        i = end - 1 - start
        return rows[i], PassGeometry(end - 1, lo + i, total)

    def clear(self) -> None:
        self._seen.clear()
        self._verify_step.clear()

    @torch.inference_mode()
    def rebuild(self, rebuild: DraftRebuild, hidden_rows: list[torch.Tensor],
                geometry: list[PassGeometry], blocks: list[int]) -> None:
        """Write the boundary row of every link into the request's draft head rows, computed
        for `rebuild.token` as the pass that the link's geometry describes computes it. A tree
        link's geometry must be its prefill step's (`rebuild.steps`): ValueError otherwise."""
        if rebuild.steps:
            want = [PassGeometry.step(step, end) for end, step in rebuild.steps]
            if want != geometry:
                raise ValueError(f"kept draft pass geometry {geometry} is not the steps' {want}")
        kv = self.attn.kv_cache           # [blocks, 1, block_size, width]
        bs, width = kv.shape[2], kv.shape[3]
        flat = kv[:, 0].view(-1, width)  # in place, as the layer writes its rows
        for g, h in zip(geometry, hidden_rows, strict=True):
            ids = torch.full((g.rows,), rebuild.token, dtype=torch.long, device=h.device)
            pos = torch.full((g.rows,), g.q, dtype=torch.long, device=h.device)
            hidden = h.unsqueeze(0).expand(g.rows, -1).contiguous()
            rows = self.head.draft_rows(ids, pos, hidden)[self.attn.prefix]
            q = g.q
            flat[blocks[q // bs] * bs + q % bs] = rows[g.index].to(flat.dtype)

    def close(self) -> None:
        self._hook.remove()


def find_draft_head(forward_layers: dict[str, Any], kv_cache_groups,
                    section: SectionSpec, verify_rows: int) -> BoundaryTap:
    """The tap on the draft head registered in vLLM's static forward context (an object with
    `draft_rows`), its attention layer and that layer's KV-cache group; RuntimeError when the
    engine has none (the layout promised boundary rows the worker could not rebuild)."""
    heads = [m for m in forward_layers.values()
             if isinstance(m, torch.nn.Module) and callable(getattr(m, "draft_rows", None))]
    if len(heads) != 1:
        raise RuntimeError(f"hybridcache: expected one draft head with draft_rows, found "
                           f"{len(heads)}")
    head = heads[0]
    prefix = head.layers[0].self_attn.prefix
    gid = next((g for g, group in enumerate(kv_cache_groups) if prefix in group.layer_names),
               None)
    if gid is None:
        raise RuntimeError(f"hybridcache: the draft layer {prefix} has no KV-cache group")
    return BoundaryTap(head, forward_layers[prefix], gid, section, verify_rows)
