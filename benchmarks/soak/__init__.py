"""Soak and chaos: a `vllm serve --plugin hybridcache` server under concurrent agent traffic,
a churning budget, vLLM preemptions and injected faults, every answer checked against a cold
run of its prompt (`python -m benchmarks.soak`, docs/reliability.md)."""
