"""What the plugin registers with vLLM, in one list so a reader sees the whole surface."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_hybridcache")

REGISTERED: list[str] = []


def register_all() -> None:
    from vllm_hybridcache.compat import install_vllm_metadata_alias

    install_vllm_metadata_alias()
    REGISTERED.append("metadata-alias")
    logger.debug("vllm_hybridcache registered: %s", ", ".join(REGISTERED))
