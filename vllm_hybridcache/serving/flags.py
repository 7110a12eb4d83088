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
as the user asked, with a log line saying so.

The command line is read by vLLM's own parser (`compat.parse_vllm_serve`, and in a real
`vllm serve` the general plugin's `compat.extend_vllm_serve` hook, `on_serve`), so whatever
vLLM accepts is understood: a `--config` YAML (naming the model too), underscore spellings,
dotted keys, abbreviations. Flags the user gave win: we only add what is absent. The one
exception is the connector: a `--kv-transfer-config` naming another connector, or ours with
a value of its own for a key we set (`CONNECTOR_CONFIG`), is refused with a message (never
overridden); keys it leaves out are completed, keys we do not set (its extra config) kept.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from vllm_hybridcache import compat
from vllm_hybridcache.compat import ServeCommand, enable_endpoint_plugin

logger = logging.getLogger("vllm_hybridcache")

CONNECTOR_CONFIG = {
    "kv_connector": "HybridSnapshotConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "vllm_hybridcache.adapter.connector",
    "kv_load_failure_policy": "recompute",
}
SCHEDULER_CLS = "vllm_hybridcache.adapter.scheduler.SegmentedScheduler"
HTTP_PLUGIN = "hybridcache_http"
KNOWN_PLUGINS = ("hybridcache",)
PLUGIN_HELP = ("Serve with a vLLM plugin: `hybridcache` turns on vllm-hybridcache's snapshot "
               "prefix cache for hybrid (linear-attention + attention) models: its KV "
               "connector, segmentation scheduler and /v1/cache routes. A model without "
               "recurrent layers is served untouched.")
TRACKED = ("kv_transfer_config", "scheduler_cls", "enable_prefix_caching",
           "enable_prompt_tokens_details", "shutdown_timeout")
"""vLLM serve destinations whose "did the user set it" decides what `--plugin` adds."""
SPILL_GRACE_MARGIN_S = 2
"""Seconds of shutdown grace on top of `spill_timeout_s` (the engine core's own teardown)."""
WORKER_SHUTDOWN_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
VLLM_WORKER_SHUTDOWN_DEFAULT_S = 5


class FlagConflict(ValueError):
    """The command line asks for something `--plugin hybridcache` cannot combine with."""


def split_plugin_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Remove every `--plugin NAME` / `--plugin=NAME` from argv; return (plugins, rest).

    Raises SystemExit with a `vllm: error:` line for a `--plugin` without a name or an unknown
    plugin name (what `vllm serve` reports for the same command line).
    """
    try:
        plugins, rest = compat.take_plugin_options(argv)
        check_plugin_names(plugins)
    except ValueError as e:
        raise SystemExit(f"vllm: error: {e}") from None
    return plugins, rest


def check_plugin_names(plugins: list[str]) -> None:
    """FlagConflict naming the first plugin this package does not provide."""
    for name in plugins:
        if name not in KNOWN_PLUGINS:
            raise FlagConflict(f"unknown plugin {name!r}; available: {', '.join(KNOWN_PLUGINS)}")


def is_hybrid_model(model: str, trust_remote_code: bool = False,
                    revision: str | None = None) -> bool:
    """True when the model's config has recurrent (linear-attention / mamba) layers."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code,
                                     revision=revision)
    text = getattr(cfg, "text_config", None) or cfg
    layer_types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    if layer_types:
        kinds = {str(t) for t in layer_types}
        return bool(kinds & {"linear_attention", "mamba", "mamba2", "gdn"})
    return any(k in (cfg.model_type or "") for k in ("mamba", "qwen3_next", "qwen4_exp"))


def served_model(args: Any) -> str | None:
    """The model `vllm serve` will load: the positional model, else `--model` (which a YAML
    `--config` sets), as vLLM's `ServeSubcommand.cmd` decides."""
    return getattr(args, "model_tag", None) or getattr(args, "model", None)


def on_serve(command: ServeCommand) -> None:
    """`compat.extend_vllm_serve`'s hook: apply `--plugin` to a parsed `vllm serve`, or stop it
    with the reason (an unsupported vLLM, a bad setting, a conflicting flag), exit status 2."""
    from vllm_hybridcache.config import SettingsError

    try:
        flags = plugin_flags(command)
    except (compat.UnsupportedVllmError, SettingsError, FlagConflict) as e:
        command.fail(str(e))
    command.set_flags(flags)


def apply_plugin(plugins: list[str], args: list[str]) -> list[str]:
    """Return `args` (`serve MODEL ...`) with the flags that `--plugin hybridcache` stands for.

    The same decision `vllm serve --plugin hybridcache` makes, on an argument list (tests,
    tools): read by vLLM's own parser, the flags added at the end. A conflict raises
    SystemExit with a `vllm: error:` line.
    """
    if "hybridcache" not in plugins or args[:1] != ["serve"]:
        return args
    from vllm_hybridcache.config import SettingsError

    command = compat.parse_vllm_serve(args, TRACKED)
    command.plugins = [*plugins, *command.plugins]
    try:
        return [*args, *plugin_flags(command)]
    except (compat.UnsupportedVllmError, SettingsError, FlagConflict) as e:
        raise SystemExit(f"vllm: error: {e}") from None


def plugin_flags(command: ServeCommand) -> list[str]:
    """The vLLM serve flags `command`'s plugins add (none for a non-hybrid model or with the
    cache off). Raises UnsupportedVllmError on an unsupported vLLM (the cache was asked for),
    SettingsError for a bad plugin setting, FlagConflict for a conflicting flag; sets
    VLLM_PLUGINS (and the worker's shutdown limit) in this process's environment."""
    check_plugin_names(command.plugins)
    if "hybridcache" not in command.plugins:
        return []
    compat.require_supported_vllm()
    from vllm_hybridcache.config import load_settings

    settings = load_settings()
    if not settings.active:  # budget 0 / disabled: exactly vLLM without the plugin
        print("hybridcache: cache off (budget 0 or disabled); serving with stock vLLM settings",
              flush=True)
        return []
    args = command.args
    model = served_model(args)
    source = getattr(args, "hf_config_path", None) or model
    try:
        hybrid = source is not None and is_hybrid_model(
            source, bool(getattr(args, "trust_remote_code", False)),
            getattr(args, "revision", None))
    except Exception as e:  # unreadable config: let vLLM report it in its own words
        logger.warning("hybridcache: cannot read the config of %s (%s); passing through", model, e)
        return []
    if not hybrid:
        logger.warning("hybridcache: %s is not a hybrid model; serving it untouched "
                       "(vLLM's own prefix caching stays as configured)", model)
        print(f"hybridcache: {model} is not a hybrid model; the snapshot cache stays off",
              flush=True)
        return []
    given = command.given
    out = connector_flags(command)
    if "scheduler_cls" not in given:
        out += ["--scheduler-cls", SCHEDULER_CLS]
    if "enable_prefix_caching" not in given:
        out += ["--no-enable-prefix-caching"]
    if "enable_prompt_tokens_details" not in given:
        out += ["--enable-prompt-tokens-details"]
    out += _spill_grace(given, settings)
    enable_endpoint_plugin(HTTP_PLUGIN, always=("hybridcache",))
    logger.info("hybridcache: --plugin hybridcache adds %s", " ".join(out) or "nothing")
    print(f"hybridcache: snapshot cache on for {Path(model).name if model else model}", flush=True)
    return out


def _json_keys(raw: str | None) -> dict[str, Any] | None:
    """The top-level keys and values of a `--kv-transfer-config` string as given (None when
    it is not plain JSON, e.g. with vLLM's human-readable numbers like `80m`)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def connector_flags(command: ServeCommand) -> list[str]:
    """`--kv-transfer-config` for our connector, completing (never overriding) the user's.

    FlagConflict when the user's names another connector, or sets one of `CONNECTOR_CONFIG`'s
    keys to another value. Empty when the user's config is already complete.
    """
    cfg = command.args.kv_transfer_config if "kv_transfer_config" in command.given else None
    if cfg is None:
        return ["--kv-transfer-config", json.dumps(CONNECTOR_CONFIG)]
    ours = CONNECTOR_CONFIG["kv_connector"]
    connector = getattr(cfg, "kv_connector", None)
    if connector not in (None, ours):
        raise FlagConflict(
            f"--plugin hybridcache provides the KV connector ({ours}); it cannot be combined "
            f"with --kv-transfer-config naming {connector!r}. Drop one of the two.")
    as_given = _json_keys(command.raw.get("kv_transfer_config"))
    if as_given is None:  # not plain JSON: every key that differs from ours counts as given
        raw = command.raw.get("kv_transfer_config", "")
        explicit = set(re.findall(r'"([A-Za-z_][A-Za-z0-9_]*)"\s*:', raw))
        as_given = {k: getattr(cfg, k) for k in explicit if hasattr(cfg, k)}
    clashes = [f"{key}={getattr(cfg, key)!r} (it needs {value!r})"
               for key, value in CONNECTOR_CONFIG.items()
               if key in as_given and getattr(cfg, key, None) != value]
    if clashes:
        raise FlagConflict(
            "--plugin hybridcache sets the KV connector's " + ", ".join(CONNECTOR_CONFIG)
            + "; --kv-transfer-config gives " + "; ".join(clashes)
            + ". Leave those keys out (or set them to its values).")
    if all(getattr(cfg, key, None) == value for key, value in CONNECTOR_CONFIG.items()):
        return []
    # As dotted keys: vLLM's parser merges those into one JSON placed after every plain
    # --kv-transfer-config (a YAML's included), so on an argument list they win over the
    # user's and merge with the user's own dotted keys.
    merged = {**as_given, **CONNECTOR_CONFIG}
    return [part for key, value in merged.items()
            for part in (f"--kv-transfer-config.{key}", json.dumps(value, default=str))]


def _spill_grace(given: frozenset[str], settings: Any) -> list[str]:
    """Give the session spill the shutdown time it needs (see the module docstring).

    Only when the disk tier and the spill are on and the user set no `--shutdown-timeout`;
    the worker limit is raised in this process's environment (inherited by vLLM's engine
    processes) only when the user did not set it either.
    """
    if not (settings.disk_dir and settings.session_spill) or "shutdown_timeout" in given:
        return []
    grace = settings.spill_timeout_s + SPILL_GRACE_MARGIN_S
    if WORKER_SHUTDOWN_ENV not in os.environ and settings.spill_timeout_s >= (
            VLLM_WORKER_SHUTDOWN_DEFAULT_S - 1):
        os.environ[WORKER_SHUTDOWN_ENV] = str(settings.spill_timeout_s + 1)
    return ["--shutdown-timeout", str(grace)]
