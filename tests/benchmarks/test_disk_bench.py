"""The disk tier's bandwidth benchmark runs and reports every figure (tiny sizes)."""

from __future__ import annotations

from benchmarks.disk_bench import run


def test_disk_bench_reports_tier_and_dd_figures(tmp_path):
    out = run(tmp_path, links=2, mib=2, passes=2)
    for key in ("tier_write_gib_s", "dd_write_gib_s", "tier_read_gib_s", "dd_read_gib_s",
                "tier_read_page_cache_gib_s", "crc32_gib_s", "read_ratio", "write_ratio",
                "dd_read_4m_gib_s", "buffered_read_gib_s", "tier_read_cpu_s_per_gib",
                "buffered_read_cpu_s_per_gib", "read_ratio_best_dd", "direct_over_buffered"):
        assert out[key] > 0, key
    assert isinstance(out["direct_io"], bool)
    assert out["file_bytes"] >= 2 * out["link_bytes"]
    assert list(tmp_path.iterdir()) == []  # its working folder is removed
