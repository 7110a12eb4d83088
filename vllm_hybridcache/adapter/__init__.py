"""The vLLM adapter: a KV connector (scheduler side owns the snapshot tree, worker side moves
bytes), the segmentation scheduler hook, and the mapping of KV-cache groups to state parts.
This is the only layer that imports vLLM's cache internals; keep it thin."""
