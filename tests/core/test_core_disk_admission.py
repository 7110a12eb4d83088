"""Write admission of the disk tier (core/disk/admission.py), without vLLM: which tree links
are written, decided from counts before the prefill."""

from __future__ import annotations

import numpy as np
import pytest

from tests.keys import TEST_KEY
from vllm_hybridcache.core import PromptKeys
from vllm_hybridcache.core.disk import LinkDirectory
from vllm_hybridcache.core.disk.admission import WriteAdmission
from vllm_hybridcache.core.keys import make_domain
from vllm_hybridcache.core.tiers.disk import DiskTier
from vllm_hybridcache.core.tiers.ram_tree import LinkRecord

DOM = make_domain(model="m")
CUTS = [64, 128, 256, 512]


def _cuts(tokens: np.ndarray) -> list[int]:
    return [c for c in CUTS if c <= len(tokens)]


def _keys(seed: int, n: int, shared: int = 0) -> PromptKeys:
    """n tokens: the first `shared` of a common prefix, the rest seeded."""
    common = np.arange(10, 10 + shared, dtype=np.int64)
    own = np.random.default_rng(seed).integers(1000, 50000, n - shared)
    return PromptKeys(np.concatenate([common, own]))


def test_a_one_off_short_prompt_is_not_admitted():
    adm = WriteAdmission(first_prompt_tokens=400)
    assert adm.observe(_keys(1, 300), DOM, [64, 128, 256], continues_session=False) == []


def test_a_prefix_seen_twice_is_admitted_and_so_is_a_branch_point():
    """Two prompts share 150 tokens, then diverge: their common cuts (64, 128) are admitted at
    the second sighting, the cuts past the branch are not."""
    adm = WriteAdmission(first_prompt_tokens=10_000)
    a, b = _keys(1, 300, shared=150), _keys(2, 300, shared=150)
    assert adm.observe(a, DOM, _cuts(a.tokens), False) == []
    assert adm.observe(b, DOM, _cuts(b.tokens), False) == [64, 128]
    assert adm.admitted(DOM, 128, a.digest(128)) and not adm.admitted(DOM, 256, a.digest(256))
    assert adm.reasons == {"seen_twice": 2, "first_long_prompt": 0}
    # another domain counts apart
    other = make_domain(model="m", salt="x")
    assert adm.observe(a, other, _cuts(a.tokens), False) == []


def test_a_sessions_first_long_prompt_is_written_whole_on_first_sight():
    adm = WriteAdmission(first_prompt_tokens=500)
    head = _keys(3, 600)
    assert adm.observe(head, DOM, _cuts(head.tokens), False) == [64, 128, 256, 512]
    assert adm.reasons["first_long_prompt"] == 4
    # a long prompt that continues a session (an end anchor served it) is not a first prompt
    turn = _keys(4, 600)
    assert adm.observe(turn, DOM, _cuts(turn.tokens), continues_session=True) == []


def test_counts_are_bounded():
    adm = WriteAdmission(first_prompt_tokens=10_000, max_keys=4)
    a = _keys(5, 600)
    adm.observe(a, DOM, _cuts(a.tokens), False)
    b = _keys(6, 600)
    adm.observe(b, DOM, _cuts(b.tokens), False)  # pushes a's counts out
    assert adm.sightings(DOM, 64, a.digest(64)) == 0
    assert adm.observe(a, DOM, _cuts(a.tokens), False) == []  # forgotten: first sight again
    with pytest.raises(ValueError):
        WriteAdmission(first_prompt_tokens=-1)


def test_the_disk_tier_writes_only_admitted_links(tmp_path, layout):
    d = LinkDirectory(tmp_path, b"F" * 32, 1 << 30, key=TEST_KEY)
    d.open()
    tier = DiskTier(layout, d, _cuts, admission=WriteAdmission(first_prompt_tokens=10_000))
    a = _keys(7, 300, shared=200)

    def record(keys: PromptKeys, end: int, start: int = 0) -> LinkRecord:
        return LinkRecord(1, DOM, start, end, keys.digest(end),
                          keys.digest(start) if start else b"",
                          keys.token_bytes(start, end), None)

    assert tier.observe(a, DOM, continues_session=False) == []
    assert tier.write_job(record(a, 128)) is None
    assert tier.stats().skips.get("not_admitted") == 1
    b = _keys(8, 300, shared=200)
    assert tier.observe(b, DOM, continues_session=False) == [64, 128]
    job = tier.write_job(record(a, 128))
    assert job is not None and (job.start, job.end) == (0, 128)
    # without counts (first_prompt_tokens 0) every committed link is written
    every = DiskTier(layout, d, _cuts, admission=WriteAdmission(first_prompt_tokens=0))
    assert every.write_job(record(a, 256)) is not None
