"""The GPU benchmark script runs end to end (tiny shapes, interpreter) and checks correctness,
so it is ready for the first GPU run (docs/kernels.md)."""

from __future__ import annotations

from benchmarks.kernels_bench import main


def test_kernels_bench_smoke(capsys) -> None:
    assert main(["--smoke", "--ops", "gdn_recurrent_step,ple_conv,sparse_attention"]) == 0
    out = capsys.readouterr().out
    assert "gdn_recurrent_step" in out and "sparse_attention" in out and "FAIL" not in out
