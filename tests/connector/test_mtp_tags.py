"""The MTP route's draft tags without an engine: which prompt tokens a link's boundary draft
row read, per speculative path, and which prompts a link therefore fits.

The engine test (test_mtp_route.py) measures the default path; this checks the tag logic for
every path, including the conservative one kept for paths not measured in an engine.
"""

from __future__ import annotations

from types import SimpleNamespace

from vllm_hybridcache.adapter.scheduler_side import (
    DRAFT_READS_BOTH,
    DRAFT_READS_LAST,
    NextToken,
    _Live,
    anchor_end,
    draft_reads,
)
from vllm_hybridcache.core.keys import PromptKeys, blake2b_128


def _config(method: str | None, padded: bool = True, parallel: bool = False):
    if method is None:
        return SimpleNamespace(speculative_config=None)
    return SimpleNamespace(speculative_config=SimpleNamespace(
        method=method, disable_padded_drafter_batch=not padded, parallel_drafting=parallel))


def _live(tokens: list[int], reads: str | None) -> _Live:
    return _Live(domain=b"d", keys=PromptKeys(tokens, blake2b_128), cuts=[], cut_set=frozenset(),
                 draft_reads=reads)


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
    assert (res.hit, res.miss_reason) == (False, "domain_mismatch")
