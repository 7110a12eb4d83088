"""The `vllm.general_plugins` entry point.

vLLM calls it in every process (API server, engine core, each worker, the model-inspection
subprocess), sometimes several times in one process, so it must be idempotent and cheap: it
only records string registrations (lazy) and never imports heavy modules itself. It is also the
first plugin code every vLLM process runs, so it refuses an unsupported vLLM here.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_hybridcache")

_registered = False


def register() -> None:
    """Register what the plugin provides with vLLM. Safe to call any number of times.

    Raises `UnsupportedVllmError` on a vLLM outside `compat.SUPPORTED_VLLM` (unless forced on),
    and any registration error; a failed call is not remembered as done, so a retry fails the
    same way instead of silently running with nothing registered.
    """
    global _registered
    if _registered:
        return
    from vllm_hybridcache import compat, registrations

    compat.require_supported_vllm()
    compat.route_logs_through_vllm()
    registrations.register_all()
    _registered = True
