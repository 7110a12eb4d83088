"""One engine replica as a Ray actor: an in-process vLLM engine with the plugin and the cluster
tier on, placed by Ray.

Why an actor around `vllm.LLM` rather than vLLM's Ray executor: vLLM 0.32 refuses Ray on the
CPU platform (its Ray backends need a device key, which the CPU platform leaves empty), so a CPU
replica is one ordinary engine, and Ray only places it and addresses it. The engine core and its
worker run inside the actor's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the actor's own Ray
connection is the cluster tier's, and the links it publishes are owned by the actor, so they
leave with it. See docs/cluster.md.
"""

from __future__ import annotations

import os
from typing import Any

import ray

REPLICA_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class EngineReplica:
    """The actor's body (wrapped by `replica_actor`).

    model: a checkpoint folder; name: this replica's name in the cluster directory;
    settings: the plugin's settings (cluster_address is filled in; cluster_secret_file must
    name a file this node holds, the secret every replica of the cluster shares);
    engine: vllm.LLM arguments.
    """

    def __init__(self, model: str, name: str, settings: dict[str, Any],
                 engine: dict[str, Any]) -> None:
        for k, v in REPLICA_ENV.items():
            os.environ[k] = v
        from vllm import LLM

        from vllm_hybridcache.serving.python_api import llm_kwargs

        address = ray.get_runtime_context().gcs_address
        self.name = name
        self.llm = LLM(model=model, **engine, **llm_kwargs(
            **{"cluster_address": address, "cluster_replica": name, **settings}))

    def generate(self, prompt: list[int], max_tokens: int = 6, logprobs: int = 5,
                 salt: str | None = None) -> dict[str, Any]:
        """Greedy generation of one prompt: tokens, logprobs, tokens served from the cache."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=logprobs,
                            detokenize=False)
        p: dict[str, Any] = {"prompt_token_ids": list(prompt)}
        if salt is not None:
            p["cache_salt"] = salt
        out = self.llm.generate([p], sp, use_tqdm=False)[0]
        return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                "logprobs": [{k: v.logprob for k, v in d.items()}
                             for d in out.outputs[0].logprobs]}

    def _sched(self) -> Any:
        """The connector's scheduler side (in this process; the workers may not be: TP > 1)."""
        from vllm_hybridcache.compat import inproc_scheduler_connector

        return inproc_scheduler_connector(self.llm)._sched

    def stats(self) -> dict[str, dict[str, Any]]:
        """This replica's cache stats per `tier/kind`."""
        import msgspec

        cache = self._sched().cache
        return {f"{t}/{k}": msgspec.to_builtins(s) for (t, k), s in cache.stats().items()}

    def clear(self, tier: str | None = None) -> int:
        return self._sched().clear(tier)

    def arm_corruption(self) -> tuple[str, list[dict[str, bool]]]:
        """Corrupt the next request's restore on every worker (an engine started with the
        `FaultInjection` worker extension, testing/instrumentation.py): the request's tag and
        each worker's answer."""
        tag = str(self.llm.request_counter.counter)  # the next request's id contains it
        return tag, self.llm.collective_rpc("hybridcache_corrupt_restore", args=(tag,))

    def corruption_result(self, tag: str) -> list[dict[str, Any] | None]:
        """Each worker's record of the tagged request's restore (`arm_corruption`)."""
        return self.llm.collective_rpc("hybridcache_corruption_result", args=(tag,))

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def replica_actor(num_cpus: float = 1) -> Any:
    """The Ray actor class of one replica (`num_cpus` reserved for its engine)."""
    return ray.remote(num_cpus=num_cpus, max_restarts=0,
                      runtime_env={"env_vars": dict(REPLICA_ENV)})(EngineReplica)
