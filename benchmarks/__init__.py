"""Benchmarks of vllm-hybridcache: trace replay against servers, and the microbenchmarks.

Entry point: `python -m benchmarks.run` (`make bench`). See docs/benchmarks.md.
"""
