"""A whole link (state slots of every recurrent tensor + KV blocks of every attention layer) in
one launch: the bytes equal torch's copies, the kernel path runs exactly once, and parts it
cannot address fall back to torch without being lost."""

from __future__ import annotations

import torch

from vllm_hybridcache.ops import copy_select
from vllm_hybridcache.ops.link_copy import gather_link
from vllm_hybridcache.ops.paged_blocks import PagedBlocks


def _link(seed: int):
    g = torch.Generator().manual_seed(seed)
    states = [torch.randn(6, 4, 8, 8, generator=g), torch.randn(6, 3, 5, generator=g)]
    kv = [torch.randn(20, 2, 16, 32, generator=g).to(torch.bfloat16) for _ in range(3)]
    return states, kv


def test_one_launch_per_link_matches_torch(csrc_backend) -> None:
    states, kv = _link(0)
    slot, ids, first = 4, [3, 17, 0, 9, 12], 1
    accs = [PagedBlocks(t, 20, 2 * 16 * 32 * 2) for t in kv]
    calls = []
    run = accs[0]._run

    def counting(table) -> None:
        calls.append(table.rows)
        run(table)

    for a in accs:
        a._run = counting
    sec_out = [torch.zeros_like(s[slot]) for s in states]
    rows = [torch.zeros(4, 2048, dtype=torch.uint8) for _ in kv]
    launches = gather_link(list(zip([s[slot] for s in states], sec_out, strict=True)),
                           [(a, ids, first, r) for a, r in zip(accs, rows, strict=True)])
    assert launches == 1 and calls == [2 + 3 * 4]
    for s, o in zip(states, sec_out, strict=True):
        assert torch.equal(o, s[slot])
    for t, r in zip(kv, rows, strict=True):
        expect = t.index_select(0, torch.tensor(ids[first:])).contiguous()
        assert torch.equal(r, expect.view(torch.uint8).reshape(4, -1))


def test_unaddressable_parts_fall_back(csrc_backend) -> None:
    states, kv = _link(1)
    accs = [PagedBlocks(t, 20, 2048) for t in kv]
    src = states[0][2].transpose(-1, -2)  # a non-contiguous slot view
    dst = torch.zeros_like(src)
    rows = [torch.zeros(2, 2048, dtype=torch.uint8) for _ in kv]
    assert gather_link([(src, dst)], [(a, [5, 6], 0, r) for a, r in zip(accs, rows,
                                                                        strict=True)]) == 1
    assert torch.equal(dst, src)
    assert all(torch.equal(r, t[[5, 6]].contiguous().view(torch.uint8).reshape(2, -1))
               for t, r in zip(kv, rows, strict=True))


def test_torch_backend_makes_no_launch(monkeypatch) -> None:
    monkeypatch.setenv(copy_select.ENV_VAR, "torch")
    copy_select._select.cache_clear()
    states, kv = _link(2)
    acc = PagedBlocks(kv[0], 20, 2048)
    out = torch.zeros_like(states[1][0])
    rows = torch.zeros(1, 2048, dtype=torch.uint8)
    assert gather_link([(states[1][0], out)], [(acc, [7], 0, rows)]) == 0
    assert torch.equal(out, states[1][0])
    assert torch.equal(rows, kv[0][7].contiguous().view(torch.uint8).reshape(1, -1))
    copy_select._select.cache_clear()
