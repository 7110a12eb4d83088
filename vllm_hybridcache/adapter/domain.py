"""Domains: what must be equal for two cache keys to be comparable.

See docs/architecture.md ("Vocabulary"): inside one engine, the domain separates what changes
a state's meaning (tenant, adapter, route); adapter/fingerprint.py adds what changes the
arithmetic between engines.
"""

from __future__ import annotations

import hashlib

import msgspec

from vllm_hybridcache.adapter.lora_keys import lora_key
from vllm_hybridcache.core import StateLayout, make_domain


def engine_fields(vllm_config, layout: StateLayout) -> dict[str, str]:
    """Per-engine domain fields: weights, dtypes, state layout, parallel rank layout."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    layout_digest = hashlib.sha256(msgspec.msgpack.encode(layout)).hexdigest()[:32]
    return {
        "weights": f"{mc.model}@{mc.revision or ''}",
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "mamba_ssm_dtype": str(getattr(cc, "mamba_ssm_cache_dtype", "")),
        "layout": layout_digest,
        "tp": str(pc.tensor_parallel_size),
        "pp": str(pc.pipeline_parallel_size),
        "route": "mtp" if vllm_config.speculative_config is not None else "ar",
    }


def request_domain(base: dict[str, str], request) -> bytes:
    """The full domain of one request: engine fields + tenant + adapter."""
    lora = request.lora_request
    return make_domain(
        **base,
        cache_salt=request.cache_salt or "",
        lora=lora_key(lora),  # the adapter's file digest; raises UnkeyableInput
    )
