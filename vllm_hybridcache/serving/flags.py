"""What `--plugin hybridcache` means in stock vLLM flags.

For a hybrid model: the connector (`--kv-transfer-config`), the segmentation scheduler
(`--scheduler-cls`), vLLM's own recurrent prefix caching off (`--no-enable-prefix-caching`:
the connector is the prefix cache), prompt-token details on so clients see `cached_tokens`,
a graceful shutdown long enough for the session spill when the disk tier is on
(`--shutdown-timeout`: vLLM's default 0 kills the engine at once on SIGTERM, so end anchors
could not be written; the worker's own limit `VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS` is raised
with it when the spill needs more than vLLM's 5 s), and the HTTP routes plugin enabled
through `VLLM_PLUGINS` (`compat.enable_endpoint_plugin`: once set, VLLM_PLUGINS filters the
other plugin groups too, so it lists every installed one). A non-hybrid model is left exactly
as the user asked, with a log line saying so. Flags the user gave win: we only add what is
absent.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from vllm_hybridcache.compat import enable_endpoint_plugin

logger = logging.getLogger("vllm_hybridcache")

CONNECTOR_CONFIG = {
    "kv_connector": "HybridSnapshotConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "vllm_hybridcache.adapter.connector",
    "kv_load_failure_policy": "recompute",
}
SCHEDULER_CLS = "vllm_hybridcache.adapter.scheduler.SegmentedScheduler"
HTTP_PLUGIN = "hybridcache_http"
SPILL_GRACE_MARGIN_S = 2
"""Seconds of shutdown grace on top of `spill_timeout_s` (the engine core's own teardown)."""
WORKER_SHUTDOWN_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
VLLM_WORKER_SHUTDOWN_DEFAULT_S = 5


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _has(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def model_arg(args: list[str]) -> str | None:
    """The model of `serve MODEL ...` (positional or --model)."""
    if "serve" in args:
        i = args.index("serve")
        if i + 1 < len(args) and not args[i + 1].startswith("-"):
            return args[i + 1]
    return _flag_value(args, "--model")


def is_hybrid_model(model: str, trust_remote_code: bool = False) -> bool:
    """True when the model's config has recurrent (linear-attention / mamba) layers."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    text = getattr(cfg, "text_config", None) or cfg
    layer_types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    if layer_types:
        kinds = {str(t) for t in layer_types}
        return bool(kinds & {"linear_attention", "mamba", "mamba2", "gdn"})
    return any(k in (cfg.model_type or "") for k in ("mamba", "qwen3_next", "qwen4_exp"))


def apply_plugin(plugins: list[str], args: list[str]) -> list[str]:
    """Return `args` with the flags that `--plugin hybridcache` stands for."""
    if "hybridcache" not in plugins or "serve" not in args:
        return args
    from vllm_hybridcache.config import load_settings

    settings = load_settings()
    if not settings.active:  # budget 0 / disabled: exactly vLLM without the plugin
        print("hybridcache: cache off (budget 0 or disabled); serving with stock vLLM settings",
              flush=True)
        return args
    model = model_arg(args)
    trust = _has(args, "--trust-remote-code")
    try:
        hybrid = model is not None and is_hybrid_model(model, trust)
    except Exception as e:  # unreadable config: let vLLM report it in its own words
        logger.warning("hybridcache: cannot read the config of %s (%s); passing through", model, e)
        return args
    if not hybrid:
        logger.warning("hybridcache: %s is not a hybrid model; serving it untouched "
                       "(vLLM's own prefix caching stays as configured)", model)
        print(f"hybridcache: {model} is not a hybrid model; the snapshot cache stays off",
              flush=True)
        return args
    out = list(args)
    if not _has(out, "--kv-transfer-config"):
        out += ["--kv-transfer-config", json.dumps(CONNECTOR_CONFIG)]
    else:
        cfg = json.loads(_flag_value(out, "--kv-transfer-config") or "{}")
        if cfg.get("kv_connector") != CONNECTOR_CONFIG["kv_connector"]:
            raise SystemExit("vllm: error: --plugin hybridcache provides the KV connector; "
                             "it cannot be combined with another --kv-transfer-config")
    if not _has(out, "--scheduler-cls"):
        out += ["--scheduler-cls", SCHEDULER_CLS]
    if not _has(out, "--enable-prefix-caching", "--no-enable-prefix-caching"):
        out += ["--no-enable-prefix-caching"]
    if not _has(out, "--enable-prompt-tokens-details"):
        out += ["--enable-prompt-tokens-details"]
    out = _spill_grace(out, settings)
    enable_endpoint_plugin(HTTP_PLUGIN, always=("hybridcache",))
    print(f"hybridcache: snapshot cache on for {Path(model).name if model else model}", flush=True)
    return out


def _spill_grace(args: list[str], settings: Any) -> list[str]:
    """Give the session spill the shutdown time it needs (see the module docstring).

    Only when the disk tier and the spill are on and the user set no `--shutdown-timeout`;
    the worker limit is raised in this process's environment (inherited by vLLM's engine
    processes) only when the user did not set it either.
    """
    if not (settings.disk_dir and settings.session_spill) or _has(args, "--shutdown-timeout"):
        return args
    grace = settings.spill_timeout_s + SPILL_GRACE_MARGIN_S
    if WORKER_SHUTDOWN_ENV not in os.environ and settings.spill_timeout_s >= (
            VLLM_WORKER_SHUTDOWN_DEFAULT_S - 1):
        os.environ[WORKER_SHUTDOWN_ENV] = str(settings.spill_timeout_s + 1)
    return [*args, "--shutdown-timeout", str(grace)]
