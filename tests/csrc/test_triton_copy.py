"""The Triton twin of the snapshot copy (the GPU fallback) through Triton's interpreter: same
segment table, same bytes as torch index ops. The interpreter runs CPU tensors, so CI checks
the kernel's addressing without a GPU."""

from __future__ import annotations

import importlib

import pytest
import torch

from vllm_hybridcache.ops import segments


@pytest.fixture
def triton_copy(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from vllm_hybridcache.ops import triton_copy as mod

    yield importlib.reload(mod)  # @triton.jit reads TRITON_INTERPRET when the kernel is defined
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(mod)


@pytest.mark.parametrize("dtype,inner", [(torch.bfloat16, 32), (torch.uint8, 7)])
def test_triton_copy_matches_index_ops(triton_copy, dtype, inner) -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 256, (2, 9, 4, inner * torch.empty((), dtype=dtype).element_size()),
                      generator=g, dtype=torch.uint8).view(dtype)
    ids = [8, 2, 5]
    p = segments.BlockPieces.of(t, 1)
    rows = torch.zeros(3, t.numel() * t.element_size() // 9, dtype=torch.uint8)
    table = segments.build(p.addresses(torch.tensor(ids)), p.row_addresses(rows),
                           torch.tensor(p.piece_bytes), tile_bytes=8)
    assert table.tiles > table.rows  # several programs per piece
    triton_copy.run(table, torch.device("cpu"))
    expect = t.index_select(1, torch.tensor(ids)).movedim(1, 0).contiguous()
    assert torch.equal(rows, expect.view(torch.uint8).reshape(3, -1))
