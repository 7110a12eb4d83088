"""`vllm serve --plugin hybridcache`: the bends of vLLM's command line.

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
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from vllm_hybridcache.compat.registry import checked

logger = logging.getLogger("vllm_hybridcache")


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
