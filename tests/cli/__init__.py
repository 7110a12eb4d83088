"""The `vllm-hybridcache` operator commands (cache, disk) and the progress of long work."""
