"""The multi-replica fleet: several engines with the cluster tier behind one OpenAI port.

The launcher (`vllm-hybridcache cluster`) starts a local Ray, the replicas (each a `vllm serve
--plugin hybridcache` on its own port, server_replica.py) and the front (front.py, Ray Serve),
which routes each request to the replica that owns its prefix (routing.py, owners.py) and
merges the replicas' stats (relabel.py). It sits above the serving surface, which it reuses;
the cluster tier itself, what one engine uses to share links, is vllm_hybridcache/cluster.
See docs/cluster.md.
"""
