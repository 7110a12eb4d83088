"""The CPU twin of csrc's snapshot copy, and PagedBlocks on every backend, against torch index
ops, bit for bit.

Why bit-exact: the cache's promise is that a restored request continues exactly as a cold one
would; a copy that changed one byte of a KV block would break it silently. The layouts are the
two vLLM uses (CPU [blocks, heads, block, C]; GPU [2, blocks, block, heads, D], two pieces per
block), the dtypes cover every word width the kernels pick (16, 8, 4 and 1 bytes).
"""

from __future__ import annotations

import pytest
import torch

from vllm_hybridcache.ops import copy_select, segments
from vllm_hybridcache.ops.paged_blocks import PagedBlocks


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty(
        (), dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _expected_rows(t: torch.Tensor, block_dim: int, ids: list[int]) -> torch.Tensor:
    sel = t.index_select(block_dim, torch.tensor(ids)).movedim(block_dim, 0).contiguous()
    return sel.view(torch.uint8).reshape(len(ids), -1)


LAYOUTS = [
    # (shape, block_dim, dtype): CPU layout, GPU layout, fp32 state-like, odd byte rows
    ((40, 2, 16, 64), 0, torch.bfloat16),
    ((2, 40, 16, 2, 32), 1, torch.float16),
    ((40, 3, 8, 8), 0, torch.float32),
    ((2, 40, 5, 3), 1, torch.uint8),
]


@pytest.mark.parametrize("shape,block_dim,dtype", LAYOUTS)
def test_gather_scatter_match_index_ops(csrc_backend, shape, block_dim, dtype) -> None:
    t = _random(shape, dtype, seed=1)
    n_blocks = shape[block_dim]
    block_bytes = t.numel() * t.element_size() // n_blocks
    acc = PagedBlocks(t, n_blocks, block_bytes)
    assert acc.backend == "csrc"
    ids = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(2))[:23].tolist()
    out = torch.full((20, block_bytes), 0xAB, dtype=torch.uint8)
    acc.gather(ids, 3, out)
    assert torch.equal(out, _expected_rows(t, block_dim, ids[3:23]))

    rows = _random((20, block_bytes), torch.uint8, seed=3)
    expect = t.clone()
    src = rows.view(dtype).reshape(20, *[s for i, s in enumerate(shape) if i != block_dim])
    expect.index_copy_(block_dim, torch.tensor(ids[3:23]), src.movedim(0, block_dim))
    acc.scatter(ids, 3, rows)
    assert torch.equal(t.view(torch.uint8), expect.view(torch.uint8))


def test_word_width_follows_alignment() -> None:
    """16-byte moves when every address and length allows, bytes when a row is odd-sized."""
    t = torch.zeros(4, 64, dtype=torch.uint8)
    rows = torch.zeros(4, 64, dtype=torch.uint8)
    p = segments.BlockPieces.of(t, 0)
    ids = torch.arange(4)
    assert segments.build(p.addresses(ids), p.row_addresses(rows), torch.tensor(64),
                          4096).word_bytes == (16 if t.data_ptr() % 16 == 0 else 1)
    odd = segments.build(torch.tensor([t.data_ptr()]), torch.tensor([rows.data_ptr()]),
                         torch.tensor(3), 4096)
    assert odd.word_bytes == 1 and odd.table[0, 2] == 3


def test_one_call_for_many_layers_with_split_tiles(cpu_twin) -> None:
    """Several layers' tables concatenated and cut into tiles smaller than a block (the GPU
    tile logic on the CPU): still the index-op result, in one call."""
    layers = [_random((12, 2, 16, 16), torch.bfloat16, seed=s) for s in range(3)]
    ids = [7, 0, 11, 3]
    outs = [torch.zeros(4, 1024, dtype=torch.uint8) for _ in layers]
    tables = []
    for t, out in zip(layers, outs, strict=True):
        p = segments.BlockPieces.of(t, 0)
        tables.append(segments.build(p.addresses(torch.tensor(ids)), p.row_addresses(out),
                                     torch.tensor(p.piece_bytes), 1 << 20))
    table = segments.concat(tables, tile_bytes=48)  # 3 words of 16 B: many tiles per block
    assert table.rows == 12 and table.tiles > table.rows
    cpu_twin.snapshot_copy(table.table, table.tiles, table.tile_words, table.word_bytes)
    for t, out in zip(layers, outs, strict=True):
        assert torch.equal(out, _expected_rows(t, 0, ids))


def test_twin_rejects_bad_tables(cpu_twin) -> None:
    with pytest.raises(RuntimeError, match="int64"):
        cpu_twin.snapshot_copy(torch.zeros(2, 4, dtype=torch.int32), 2, 1, 16)
    with pytest.raises(RuntimeError, match="word_bytes"):
        cpu_twin.snapshot_copy(torch.zeros(1, 4, dtype=torch.int64), 1, 1, 3)


def test_selection_and_forcing(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert copy_select.preference("rocm") == ("csrc", "triton", "torch")
    assert copy_select.preference("cuda") == ("triton", "torch")
    assert copy_select.preference("xpu") == ("torch",)
    assert copy_select.preference("cpu")[-1] == "torch"
    for value, name in (("torch", "torch"), ("TORCH ", "torch")):
        monkeypatch.setenv(copy_select.ENV_VAR, value)
        assert copy_select.select(cpu) == (name, None)
    monkeypatch.setenv(copy_select.ENV_VAR, "triton")
    with pytest.raises(RuntimeError, match="GPUs only"):
        copy_select.select(cpu)
    monkeypatch.setenv(copy_select.ENV_VAR, "memcpy")
    with pytest.raises(ValueError, match="must be one of"):
        copy_select.select(cpu)
    copy_select._select.cache_clear()


def test_padded_rows_and_unaddressable_rows(csrc_backend) -> None:
    """Rows with a stride beyond the block (a slice of a wider buffer) go through the kernel;
    rows a kernel cannot address (element stride 2) are refused before any copy."""
    t = _random((10, 2, 4, 8), torch.float32, seed=5)
    acc = PagedBlocks(t, 10, 256)
    wide = torch.zeros(3, 512, dtype=torch.uint8)
    padded = wide[:, :256]
    assert acc.addressable(padded)
    acc.gather([4, 1, 9], 0, padded)
    assert torch.equal(padded, _expected_rows(t, 0, [4, 1, 9]))
    assert not wide[:, 256:].any()
    assert not acc.addressable(wide[:, ::2])


def test_selfcheck_on_cpu(cpu_twin) -> None:
    """The on-box check (`python -m vllm_hybridcache.ops.selfcheck`) runs here on the CPU: the
    twin and torch bit-exact, Triton reported unavailable rather than failing."""
    from vllm_hybridcache.ops import selfcheck

    res = {r["backend"]: r for r in selfcheck.run(torch.device("cpu"), layers=2, heads=2,
                                                  dim=32, block=16, tokens=100, reps=1)}
    assert res["csrc"]["exact"] is True and res["torch"]["exact"] is True
    assert res["triton"]["loaded"] is False
