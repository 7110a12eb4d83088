"""The `vllm.general_plugins` entry point.

vLLM calls it in every process (API server, engine core, each worker, the model-inspection
subprocess), sometimes several times in one process, so it must be idempotent and cheap: it
only records string registrations (lazy) and never imports heavy modules itself.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_hybridcache")

_registered = False


def register() -> None:
    """Register what the plugin provides with vLLM. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_hybridcache import registrations

    registrations.register_all()
