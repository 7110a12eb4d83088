"""Diagnostics run from the command line (`python -m vllm_hybridcache.tools.<name>`)."""
