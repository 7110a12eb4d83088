"""What the plugin registers with vLLM, in one list so a reader sees the whole surface."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_hybridcache")

REGISTERED: list[str] = []


def register_all() -> None:
    from vllm_hybridcache.compat import install_vllm_metadata_alias

    install_vllm_metadata_alias()
    REGISTERED.append("metadata-alias")
    _register_connector()
    REGISTERED.append("connector:HybridSnapshotConnector")
    from vllm_hybridcache.flash_next.registration import register as register_flash_next

    REGISTERED.extend(register_flash_next())
    logger.debug("vllm_hybridcache registered: %s", ", ".join(REGISTERED))


def _register_connector() -> None:
    """Make `"kv_connector": "HybridSnapshotConnector"` work without a module path."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(
            "HybridSnapshotConnector", "vllm_hybridcache.adapter.connector",
            "HybridSnapshotConnector")
    except ValueError:  # already registered in this process
        pass
