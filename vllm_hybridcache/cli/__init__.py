"""Command-line entry points: `vllm-hybridcache` (our tools) and the `vllm` wrapper."""
