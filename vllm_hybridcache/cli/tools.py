"""`vllm-hybridcache`: make embedded models, print their paths, serve one with the plugin, or
N replicas of a model under Ray behind one port (`cluster`, docs/cluster.md); what fits on a
box (`sizing`, docs/deploy-rocm.md); a running
server's cache (`cache stats|clear URL`) and a disk tier's folder offline (`disk
ls|stats|verify|prune|clear DIR`): docs/operations.md."""

from __future__ import annotations

import argparse
import os
import sys


def _make_model(args: argparse.Namespace) -> int:
    from vllm_hybridcache.models import ModelStoreError, ensure_model

    try:
        for name in args.names:
            path = ensure_model(name)
            print(path)
    except ModelStoreError as e:
        print(f"vllm-hybridcache: error: {e}", file=sys.stderr)
        return 2
    return 0


def _list_models(_: argparse.Namespace) -> int:
    from vllm_hybridcache.models.catalog import CATALOG

    for spec in CATALOG.values():
        print(f"{spec.name:20s} {spec.summary}")
    return 0


def _serve_embedded(args: argparse.Namespace) -> int:
    """`vllm serve --plugin hybridcache <embedded model path> ...`, in this process."""
    from vllm_hybridcache.models import ModelStoreError, ensure_model

    try:
        path = ensure_model(args.name)
    except ModelStoreError as e:
        print(f"vllm-hybridcache: error: {e}", file=sys.stderr)
        return 2
    from vllm_hybridcache.cli.vllm_entry import main as vllm_main

    plugin = [] if args.no_plugin else ["--plugin", "hybridcache"]
    argv = ["vllm", "serve", str(path), *plugin, "--served-model-name", args.name, *args.rest]
    return vllm_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cluster"]:  # its own parser (flags after `--` go to vllm serve)
        from vllm_hybridcache.fleet.launcher import main as cluster_main

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return cluster_main(argv[1:])
    if argv[:1] == ["sizing"]:  # its own parser (tools/sizing.py)
        from vllm_hybridcache.tools.sizing import main as sizing_main

        return sizing_main(argv[1:])
    parser = argparse.ArgumentParser(prog="vllm-hybridcache", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-model", help="write embedded model(s) and print their folders")
    p.add_argument("names", nargs="+")
    p.set_defaults(func=_make_model)
    p = sub.add_parser("list-models", help="list the embedded models")
    p.set_defaults(func=_list_models)
    p = sub.add_parser("serve-embedded", help="vllm serve an embedded model with the plugin")
    p.add_argument("name")
    p.add_argument("--no-plugin", action="store_true", help="serve with stock vLLM settings")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="further vllm serve flags")
    p.set_defaults(func=_serve_embedded)
    from vllm_hybridcache.cli import disk, live

    live.add_parser(sub)
    disk.add_parser(sub)
    sub.add_parser("cluster", help="N replicas with the cluster tier under Ray, one OpenAI "
                   "port (vllm-hybridcache cluster --help)")
    sub.add_parser("sizing", help="what fits where: weights, K/V space, link size and cache "
                   "budget of a checkpoint on the R9700 and Strix Halo boxes "
                   "(vllm-hybridcache sizing --help)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
