"""The disk tier's bandwidth benchmark runs and reports every figure (tiny sizes)."""

from __future__ import annotations

from benchmarks.disk_bench import run


def test_disk_bench_reports_tier_and_dd_figures(tmp_path):
    out = run(tmp_path, links=2, mib=2)
    for key in ("tier_write_gib_s", "dd_write_gib_s", "tier_read_gib_s", "dd_read_gib_s",
                "tier_read_page_cache_gib_s", "crc32_gib_s", "read_ratio", "write_ratio"):
        assert out[key] > 0, key
    assert out["file_bytes"] >= 2 * out["link_bytes"]
    assert list(tmp_path.iterdir()) == []  # its working folder is removed
