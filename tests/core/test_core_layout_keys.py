"""State layout (issue 3, req. 1) and keys (req. 2)."""

from __future__ import annotations

import pickle

import msgspec
import numpy as np
import pytest

from vllm_hybridcache.core import (
    BLOCK,
    PromptKeys,
    SectionSpec,
    StateLayout,
    TreeConfig,
    ViewSpec,
    blake2b_128,
    make_domain,
    tenant_of,
    tenant_tag,
)
from vllm_hybridcache.core.keys import in_tenant


def test_layout_sizes(layout: StateLayout) -> None:
    assert layout.section_bytes == 2 * 4 * 4 + 3 * 2
    assert layout.view_bytes_per_row == 2 * 2 * 2 + 4
    assert layout.link_bytes(0) == 38
    assert layout.link_bytes(10) == 38 + 120
    assert layout.views[0].bytes_per_row == 8
    assert layout.part_names == ("gdn", "conv", "kv", "idx")


def test_layout_is_plain_data(layout: StateLayout) -> None:
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(layout), type=StateLayout) == layout


@pytest.mark.parametrize(
    "make",
    [
        lambda: SectionSpec("a", (2,), "float99"),
        lambda: SectionSpec("a", (-1,), "float32"),
        lambda: ViewSpec("a", (2,), "torch.float32"),
        lambda: StateLayout(sections=(SectionSpec("a", (1,), "float32"),),
                            views=(ViewSpec("a", (1,), "float32"),)),
        lambda: TreeConfig(policy="fifo"),
        lambda: TreeConfig(budget_bytes=-1),
    ],
)
def test_invalid_specs_are_rejected(make) -> None:
    with pytest.raises(ValueError):
        make()


def test_digest_depends_on_prefix_only() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 50_000, 500)
    b = a.copy()
    b[300] += 1
    ka, kb = PromptKeys(a), PromptKeys(b)
    for p in (0, 1, 63, 64, 65, 128, 299, 300):
        assert ka.digest(p) == kb.digest(p)
    for p in (301, 320, 384, 500):
        assert ka.digest(p) != kb.digest(p)
    # a prefix-only prompt gives the same digests as the full prompt
    kp = PromptKeys(a[:200])
    assert all(kp.digest(p) == ka.digest(p) for p in range(0, 201, 7))


def test_digest_length_and_cut_are_part_of_the_key() -> None:
    k = PromptKeys(np.zeros(300, dtype=np.int64))
    digests = {k.digest(p) for p in range(301)}
    assert len(digests) == 301  # same tokens, different cuts: different keys
    assert len(k.digest(5)) == 16  # 128 bits
    assert k.digest(BLOCK * 3) == blake2b_128(
        k._chain[3] + b"" + (BLOCK * 3).to_bytes(8, "little")
    )


def test_digest_rejects_cuts_outside_prompt() -> None:
    with pytest.raises(ValueError):
        PromptKeys([1, 2, 3]).digest(4)


def test_tokens_are_copied_not_aliased() -> None:
    arr = np.arange(10)
    k = PromptKeys(arr)
    arr[0] = 99
    assert k.tokens[0] == 0
    assert PromptKeys([1, 2, 3]).token_bytes(1, 3) == np.array([2, 3], np.int64).tobytes()


def test_make_domain_is_canonical_and_sensitive() -> None:
    d1 = make_domain(weights="abc", tp_rank=0, tp_size=2, lora=None, images=[b"\x01"])
    d2 = make_domain(images=[b"\x01"], lora=None, tp_size=2, tp_rank=0, weights="abc")
    assert d1 == d2 and len(d1) == 32
    assert d1 != make_domain(weights="abc", tp_rank=1, tp_size=2, lora=None, images=[b"\x01"])
    assert d1 != make_domain(weights="abc", tp_rank=0, tp_size=2, lora=None, images=[b"\x02"])
    assert make_domain(cache_salt="a") != make_domain(cache_salt="b")
    assert make_domain(cache_salt="a") != make_domain(route="a")


def test_a_domain_ends_with_its_tenant_tag() -> None:
    """Issue 29: a domain is 16 bytes of the digest of every field, then the tag of its
    tenant (the `cache_salt`), so a tenant's links are found without the other fields."""
    engine = {"weights": "m@1", "route": "ar", "lora": ""}
    a = make_domain(**engine, cache_salt="tenant-a")
    b = make_domain(**engine, cache_salt="tenant-b")
    a_mtp = make_domain(**{**engine, "route": "mtp"}, cache_salt="tenant-a")
    assert len(a) == 32 and tenant_of(a) == tenant_tag("tenant-a") == tenant_of(a_mtp)
    assert a[:16] != a_mtp[:16]  # two domains of one tenant differ in their first bytes
    assert tenant_of(b) != tenant_of(a) and len(tenant_tag("x")) == 16
    # requests without a salt are one tenant, the "" one; the tag is no other digest of it
    unsalted = make_domain(**engine, cache_salt="")
    assert tenant_of(unsalted) == tenant_of(make_domain(**engine)) == tenant_tag("")
    assert tenant_of(make_domain(**engine, cache_salt=None)) == tenant_tag("")
    assert tenant_tag("") not in (PromptKeys([]).digest(0), b"\x00" * 16)
    assert in_tenant(tenant_tag("tenant-a"))(a_mtp) and not in_tenant(tenant_tag("tenant-a"))(b)
    with pytest.raises(TypeError):
        tenant_tag(b"tenant-a")  # type: ignore[arg-type]
