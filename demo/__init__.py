"""`make demo`: an agent conversation against `vllm serve --plugin hybridcache`."""
