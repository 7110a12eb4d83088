"""The MTP route's draft tags without an engine: which prompt tokens a link's boundary draft
row read, per speculative path, and which prompts a link therefore fits; where the boundary row
is rebuilt instead (Flash-Next's MTP head), which prompts a link fits and what a restore
rebuilds; and what counts as a shortened lookup across tiers.

The engine test (test_mtp_route.py) measures the default path; this checks the tag logic for
every path, including the conservative one kept for paths not measured in an engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hybridcache.adapter.anchor_end import anchor_end
from vllm_hybridcache.adapter.draft_rows import (
    DRAFT_INPUT,
    DRAFT_PASS_SPEC,
    DraftRebuild,
    PassGeometry,
    rebuild_input,
)
from vllm_hybridcache.adapter.draft_tags import (
    DRAFT_READS_BOTH,
    DRAFT_READS_LAST,
    DRAFT_REBUILD,
    DraftStep,
    NextToken,
    RebuiltAnchor,
    draft_reads,
)
from vllm_hybridcache.adapter.request_state import RequestState
from vllm_hybridcache.core import EndAnchors, IdSource, LinkKind, SnapshotCache, SnapshotTree
from vllm_hybridcache.core.keys import PromptKeys, blake2b_128, make_domain


def _config(method: str | None, padded: bool = True, parallel: bool = False):
    if method is None:
        return SimpleNamespace(speculative_config=None)
    return SimpleNamespace(speculative_config=SimpleNamespace(
        method=method, disable_padded_drafter_batch=not padded, parallel_drafting=parallel))


def _live(tokens: list[int], reads: str | None, cuts: tuple[int, ...] = ()) -> RequestState:
    return RequestState(domain=b"d", keys=PromptKeys(tokens, blake2b_128), cuts=list(cuts),
                 cut_set=frozenset(cuts), draft_reads=reads)


def _draft_config(arch: str = "Qwen4ExpMTP", method: str = "mtp", padded: bool = True,
                  layers: int = 1):
    text = SimpleNamespace(mtp_num_hidden_layers=layers)
    draft = SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch]), hf_text_config=text,
                            get_hidden_size=lambda: 64)
    return SimpleNamespace(
        model_config=SimpleNamespace(dtype="torch.float32"),
        speculative_config=SimpleNamespace(method=method, disable_padded_drafter_batch=not padded,
                                           parallel_drafting=False, draft_model_config=draft))


def test_the_boundary_rows_are_rebuilt_only_where_measured():
    """Flash-Next's MTP head on the padded drafter batch keeps the target's hidden row at each
    link's end (one section); every other path keeps the draft tags."""
    spec = rebuild_input(_draft_config())
    assert (spec.name, spec.shape, spec.dtype) == (DRAFT_INPUT, (64,), "float32")
    assert rebuild_input(SimpleNamespace(speculative_config=None)) is None
    assert rebuild_input(_draft_config(padded=False)) is None
    assert rebuild_input(_draft_config(arch="Qwen3NextMTP")) is None
    assert rebuild_input(_draft_config(method="eagle")) is None
    assert rebuild_input(_draft_config(layers=2)) is None
    # the section joins the layout (what links hold), not the KV-backed sections
    from vllm_hybridcache.adapter.draft_rows import with_draft_input
    from vllm_hybridcache.adapter.parts import PartMap
    from vllm_hybridcache.core import StateLayout
    from vllm_hybridcache.core.layout import SectionSpec

    gdn = SectionSpec(name="gdn", shape=(4,), dtype="float32")
    parts = PartMap(layout=StateLayout(sections=(gdn,)), sections=(("gdn", 0, "l0", 0),),
                    views=(), block_bytes={})
    out = with_draft_input(parts, spec)
    assert out.layout.sections == (gdn, spec, DRAFT_PASS_SPEC)
    assert out.sections == parts.sections
    assert with_draft_input(parts, None) is parts


def test_rebuilt_links_fit_every_prompt_that_shares_their_tokens():
    """On the rebuild route a link's tag is the shape of the step that ended at its cut; a
    restore rebuilds each chain link's boundary row with the new prompt's last token."""
    a = list(range(10, 90))
    cuts = (16, 32, 48, 64)
    tag = _live(a, DRAFT_REBUILD, cuts).draft_tag(48)
    assert tag == DraftStep(32)
    for other in ([*a, 7, 8], [*a[:48], 5, 6], [*a[:49], 5, 6], [*a, 7, 8, a[-1]]):
        live = _live(other, DRAFT_REBUILD, tuple(c for c in cuts if c < len(other)))
        assert live.fits(48, tag)
    assert _live(a, DRAFT_REBUILD, cuts).draft_tag(len(a)) == DraftStep(64)  # prompt's end too
    # a prompt whose step ending at 48 would start elsewhere does not fit (other row count)
    assert not _live(a, DRAFT_REBUILD, (20, 48)).fits(48, tag)
    chain = (SimpleNamespace(end=16), SimpleNamespace(end=32), SimpleNamespace(end=48))
    live = _live([*a, 3], DRAFT_REBUILD, cuts)
    assert live.draft_rebuild(chain, 3) == DraftRebuild(3, ((16, 0), (32, 16), (48, 32)))
    assert _live(a, DRAFT_READS_LAST, cuts).draft_rebuild(chain, 3) is None


def test_which_tokens_the_boundary_row_reads_per_path():
    assert draft_reads(_config(None)) is None
    assert draft_reads(_config("mtp")) == DRAFT_READS_LAST
    assert draft_reads(_config("eagle3")) == DRAFT_READS_LAST
    assert draft_reads(_config("mtp", padded=False)) == DRAFT_READS_BOTH
    assert draft_reads(_config("mtp", parallel=True)) == DRAFT_READS_BOTH
    assert draft_reads(_config("draft_model")) == DRAFT_READS_BOTH
    assert draft_reads(_config("ngram")) == DRAFT_READS_BOTH


def test_padded_path_links_fit_every_prompt_with_the_same_last_token():
    a = list(range(10, 60))
    link = _live(a, DRAFT_READS_LAST)
    tag = link.draft_tag(32)
    ext = [*a, 7, 8, a[-1]]                               # extension, same last token
    branch = [*a[:32], 5, 6, a[-1]]                        # branch at the cut
    other = [*a, 7, 8]                                    # another last token
    assert _live(ext, DRAFT_READS_LAST).fits(32, tag)
    assert _live(branch, DRAFT_READS_LAST).fits(32, tag)
    assert not _live(other, DRAFT_READS_LAST).fits(32, tag)
    # a link at the prompt's end read the sampled token: it fits no prompt
    end = link.draft_tag(len(a))
    assert end == -1 and not _live(ext, DRAFT_READS_LAST).fits(len(a), end)


def test_the_conservative_path_also_needs_the_token_after_the_cut():
    a = list(range(10, 60))
    tag = _live(a, DRAFT_READS_BOTH).draft_tag(32)
    assert _live([*a[:40], 1, a[-1]], DRAFT_READS_BOTH).fits(32, tag)
    assert not _live([*a[:32], 5, 6, a[-1]], DRAFT_READS_BOTH).fits(32, tag)
    assert not _live([*a, 7, 8], DRAFT_READS_BOTH).fits(32, tag)


def test_off_the_route_there_is_no_tag():
    live = _live(list(range(10, 60)), None)
    assert not live.draft_route and live.draft_tag(32) is None


def test_an_anchor_fits_only_the_prompt_that_continues_with_its_next_token():
    tokens = list(range(10, 60))
    tag = NextToken(tokens[40])
    assert _live(tokens, DRAFT_READS_LAST).fits(40, tag)
    assert not _live([*tokens[:40], 3, *tokens[41:]], DRAFT_READS_LAST).fits(40, tag)
    assert not _live(tokens[:40], DRAFT_READS_LAST).fits(40, tag)   # nothing comes next


def test_a_rebuilt_anchor_fits_every_prompt_that_extends_it():
    """On the rebuild route an end anchor's boundary row is rebuilt for the next turn's token
    at its end, whatever that token is; a prompt must still have a token there."""
    tokens = list(range(10, 60))
    tag = RebuiltAnchor()
    assert _live(tokens, DRAFT_REBUILD).fits(40, tag)
    assert _live([*tokens[:40], 3, *tokens[41:]], DRAFT_REBUILD).fits(40, tag)
    assert not _live(tokens[:40], DRAFT_REBUILD).fits(40, tag)
    assert _live(tokens, DRAFT_REBUILD).anchor_rebuild(3) == DraftRebuild(3, ())
    assert _live(tokens, DRAFT_READS_LAST).anchor_rebuild(3) is None


def test_pass_geometry_round_trips_and_refuses_nonsense():
    """A link's bytes say where its boundary row sat in the draft pass that wrote it: a
    prefill step's last row, or an anchor's row inside a verify step's pass."""
    g = PassGeometry.step(32, 48)
    assert g == PassGeometry(47, 15, 16)
    assert PassGeometry.of(g.as_tensor()) == g
    for bad in ((0, 0, 0), (5, 3, 3), (-1, 0, 2)):
        with pytest.raises(ValueError):
            PassGeometry.of(torch.tensor(bad))


def test_anchor_end_copies_the_block_of_the_last_accepted_token():
    # without drafts: every forwarded token, block 0
    assert anchor_end(306, 307, 300, 305, 1, speculative=False) == (306, 0)
    # a verify step from 310 with 1 + 3 tokens, 2 drafts accepted: 313 forwarded (the
    # rejected one taken off), 314 tokens in the request: the state after 312 is in block 2
    assert anchor_end(313, 314, 300, 310, 4, speculative=True) == (313, 2)
    # none accepted: block 0
    assert anchor_end(311, 312, 300, 310, 4, speculative=True) == (311, 0)
    # a stop on the first accepted draft (312 tokens kept): the anchor ends before it, with
    # the state after position 310 (block 0); a stop on the second (313 kept): the state after
    # position 311 (block 1)
    assert anchor_end(313, 312, 300, 310, 4, speculative=True) == (311, 0)
    assert anchor_end(313, 313, 300, 310, 4, speculative=True) == (312, 1)
    # finished in a prefill step (max_tokens=1): no anchor with drafts
    assert anchor_end(300, 301, 300, 256, 44, speculative=True) is None


def test_routes_never_cross():
    """An engine with speculative decoding keys its links under route `mtp`, one without under
    `ar`: the same prompt and tenant give different domains, so neither serves the other."""
    from vllm_hybridcache.adapter.domain import engine_fields, request_domain
    from vllm_hybridcache.core import SnapshotTree, StateLayout
    from vllm_hybridcache.core.layout import SectionSpec

    layout = StateLayout(sections=(SectionSpec(name="s", shape=(4,), dtype="float32"),))

    def config(spec):
        return SimpleNamespace(
            model_config=SimpleNamespace(model="m", revision=None, dtype="float32"),
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
            cache_config=SimpleNamespace(cache_dtype="auto", mamba_ssm_cache_dtype="auto"),
            speculative_config=spec)

    request = SimpleNamespace(lora_request=None, cache_salt=None)
    ar = engine_fields(config(None), layout)
    mtp = engine_fields(config(_config("mtp").speculative_config), layout)
    assert (ar["route"], mtp["route"]) == ("ar", "mtp")
    d_ar, d_mtp = request_domain(ar, request), request_domain(mtp, request)
    assert d_ar != d_mtp
    tree = SnapshotTree(layout)
    prompt = list(range(10, 60))
    r = tree.reserve(prompt, 32, d_ar)
    tree.commit(r.link_id)
    assert tree.lookup(prompt, d_ar, 49).tokens == 32
    res = tree.lookup(prompt, d_mtp, 49)
    assert (res.hit, res.miss_reason) == (False, "domain_mismatch")  # the same tenant
    # another tenant on the other route is told nothing of this one's links (issue 29)
    salted = request_domain(mtp, SimpleNamespace(lora_request=None, cache_salt="tenant-2"))
    res = tree.lookup(prompt, salted, 49)
    assert (res.hit, res.miss_reason) == (False, "no_prefix")


def test_a_refusal_counts_as_shortened_only_where_it_was_deeper_than_the_answer():
    """`shortened` is decided over every tier: an end anchor refused beyond the tree's hit
    counts, a tree link refused below an anchor's hit does not (that reuse was not lost)."""
    from vllm_hybridcache.core import StateLayout, TreeConfig
    from vllm_hybridcache.core.layout import SectionSpec

    layout = StateLayout(sections=(SectionSpec(name="s", shape=(4,), dtype="float32"),))
    d = make_domain(model="m")
    ids = IdSource()
    tree = SnapshotTree(layout, TreeConfig(budget_bytes=1 << 20, memory_floor_bytes=0),
                        next_id=ids)
    cache = SnapshotCache([tree,
                           EndAnchors(layout, max_count=4, budget_bytes=1 << 20, next_id=ids)])
    prompt = list(range(500, 900))

    def publish(kind, p, tag):
        r = cache.reserve(kind, prompt, p, d, tag)
        assert cache.commit(r.addr)

    publish(LinkKind.TREE, 64, "ok")
    publish(LinkKind.TREE, 128, "ok")
    publish(LinkKind.ANCHOR, 300, "no")
    fits = lambda p, tag: tag == "ok"  # noqa: E731
    res = cache.lookup(prompt, d, len(prompt) - 1, fits)
    assert (res.tokens, res.kind, res.shortened, res.refused) == (128, "tree", True, 300)
    before = tree.stats().shortened
    cache.record_lookup(res)
    assert tree.stats().shortened == before + 1
    cache.clear("ram", "anchor")
    publish(LinkKind.TREE, 192, "no")
    publish(LinkKind.ANCHOR, 300, "ok")     # the anchor fits: the refused 192 is below it
    res = cache.lookup(prompt, d, len(prompt) - 1, fits)
    assert (res.tokens, res.kind, res.shortened) == (300, "anchor", False)
    cache.clear()
    publish(LinkKind.TREE, 64, "ok")
    publish(LinkKind.ANCHOR, 40, "no")      # refused, but shallower than the tree's hit
    res = cache.lookup(prompt, d, len(prompt) - 1, fits)
    assert (res.tokens, res.shortened) == (64, False)
