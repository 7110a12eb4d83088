"""`make bench`: replay a trace against native vLLM, vLLM without prefix caching and our plugin.

    python -m benchmarks.run [--model qwen3-next-tiny] [--trace coding-agent] [--size ci]
                             [--systems native,nocache,ours] [--base-url NAME=URL ...]
    python -m benchmarks.run --micro NAME[,NAME...]|all [args for it]   (names: --list)
    python -m benchmarks.run --list

For every size asked for, each system's server is started once with the same model and settings,
and replays each trace from an empty cache (a fresh server, or POST /reset_prefix_cache, which
also empties our connector's cache), after one short warm-up request; then it is stopped. So no
trace inherits another's cache, and the order of systems does not matter. Results go to
docs/benchmarks/ (JSON, markdown, PNG) with the command that produced them. A system that does
not start is reported with the reason, and the command then exits with status 1.

`--base-url` replays against a server that is already running (a GPU box, a remote host): the
runner then starts nothing for that system. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import os
import platform
import shlex
import sys
from pathlib import Path

import msgspec

from benchmarks import report as rep
from benchmarks.ideal import PromptTokenizer
from benchmarks.machine_load import LoadSampler, wait_for_quiet
from benchmarks.replay import ReplayConfig, replay
from benchmarks.results import REPLAY, git_commit, vllm_version
from benchmarks.servers import (
    SYSTEMS,
    ServerError,
    ServerSettings,
    SystemSpec,
    process_tree_cpu_s,
    reset_cache,
    running_server,
)
from benchmarks.traces import FAMILIES, SIZES, TEXT_FAMILIES, Trace, generate

REPO = Path(__file__).resolve().parent.parent

# The microbenchmarks of the other issues, each a module exposing `main(argv=None) -> int`.
MICRO: dict[str, tuple[str, str]] = {
    "core": ("benchmarks.core_bench", "cache core: keys, tree, eviction (no vLLM)"),
    "kernels": ("benchmarks.kernels_bench", "GDN / QSA / conv kernels per backend"),
    "model": ("benchmarks.model_bench", "Flash-Next forward vs transformers"),
    "connector": ("benchmarks.connector_bench", "KV connector capture / restore latency"),
    "segmentation": ("benchmarks.segmentation_bench",
                     "grid / message-end cut settings: reuse and prefill cost"),
    "disk": ("benchmarks.disk_bench", "disk tier: link file write / verified read vs dd"),
    "disk_restart": ("benchmarks.disk_restart_bench",
                     "disk tier: next-turn latency after a restart (cold / RAM / disk)"),
}


def _utc() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_available(name: str) -> bool:
    return importlib.util.find_spec(MICRO[name][0]) is not None


def run_micro(names: list[str], rest: list[str]) -> int:
    """Run the named microbenchmarks; an absent one is an error, never skipped in silence."""
    if names == ["all"]:
        names = list(MICRO)
    unknown = [n for n in names if n not in MICRO]
    if unknown:
        print(f"benchmarks: unknown microbenchmark(s) {', '.join(unknown)}; "
              f"known: {', '.join(MICRO)}", file=sys.stderr)
        return 2
    missing = [n for n in names if not micro_available(n)]
    if missing:
        for n in missing:
            print(f"benchmarks: microbenchmark {n!r} does not exist yet "
                  f"(module {MICRO[n][0]} not found)", file=sys.stderr)
        return 2
    status = 0
    for n in names:
        print(f"== micro {n}: {MICRO[n][1]}", flush=True)
        module = importlib.import_module(MICRO[n][0])
        status = max(status, int(module.main(list(rest)) or 0))
    return status


def list_everything() -> None:
    print("trace families:")
    for name, (_, doc) in FAMILIES.items():
        print(f"  {name:14s} {doc}")
    print("sizes:")
    for s in SIZES.values():
        print(f"  {s.name:14s} ~{s.conversation_tokens:,} tokens a conversation, "
              f"head ~{s.head_tokens:,}, max_model_len {s.max_model_len}")
    print("systems:")
    for s in SYSTEMS.values():
        print(f"  {s.name:14s} {s.description}: {' '.join(s.flags)}")
    print("microbenchmarks:")
    for name, (module, doc) in MICRO.items():
        state = "available" if micro_available(name) else "absent"
        print(f"  {name:14s} {doc} ({module}, {state})")


def resolve_model(name: str) -> tuple[str, str]:
    """(checkpoint path or hub id, served name): embedded names are written on first use."""
    from vllm_hybridcache.models import model_names

    if name in model_names():
        from vllm_hybridcache.models import ensure_model

        return str(ensure_model(name)), name
    return name, name


def _host() -> dict[str, object]:
    cpus = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cpus
    summary = f"{platform.system()} {platform.machine()}, {usable} CPUs"
    return {"summary": summary, "system": platform.system(), "machine": platform.machine(),
            "cpus": cpus, "usable_cpus": usable, "python": platform.python_version()}


def parse_base_urls(values: list[str], systems: list[str]) -> dict[str, str]:
    """`URL` (only with one system) or `NAME=URL` per system."""
    out: dict[str, str] = {}
    for v in values:
        name, sep, url = v.partition("=")
        if sep and not name.startswith("http"):
            out[name] = url
        elif len(systems) == 1:
            out[systems[0]] = v
        else:
            raise SystemExit("benchmarks: with several systems, write --base-url NAME=URL")
    unknown = [n for n in out if n not in systems]
    if unknown:
        raise SystemExit(f"benchmarks: --base-url for {unknown} not in --systems")
    return out


# How long a replay waits for the machine to be quiet before it starts (then runs flagged).
LOAD_WAIT_S = 120.0


def _measure(run: rep.SystemRun, trace: Trace, cfg: ReplayConfig,
             tokenizer: PromptTokenizer, pid: int | None = None,
             load_wait_s: float = LOAD_WAIT_S) -> None:
    """Replay one trace into `run`; a failure is recorded in `run.error`, never raised.

    Waits up to `load_wait_s` for the load average to fall to `report.LOAD_LIMIT` first, and
    samples it during the replay: a run on a busy machine is flagged in its report."""
    before = wait_for_quiet(rep.LOAD_LIMIT, load_wait_s)
    if before > rep.LOAD_LIMIT:
        print(f"   {run.name} {trace.family}: load average {before:.1f} above "
              f"{rep.LOAD_LIMIT} after {load_wait_s:.0f} s; running, flagged as loaded",
              flush=True)
    cpu_before = process_tree_cpu_s(pid) if pid is not None else None
    try:
        with LoadSampler() as load:
            result = replay(trace, cfg, tokenizer)
    except Exception as e:  # the replay talks to a server: report it, keep the other systems
        run.error = f"{type(e).__name__}: {e}"
        print(f"   {run.name} {trace.family}: FAILED: {run.error.splitlines()[0]}", flush=True)
        return
    run.load_avg = [round(before, 2), round(os.getloadavg()[0], 2)]
    run.load_max = round(load.peak, 2) if load.peak is not None else None
    cpu_after = process_tree_cpu_s(pid) if pid is not None else None
    if cpu_before is not None and cpu_after is not None:
        run.server_cpu_s = round(cpu_after - cpu_before, 3)
    run.requests = result.requests
    run.cache_stats_route = result.cache_stats_route
    run.peak_snapshot_bytes_by_tier = result.peak_snapshot_bytes_by_tier
    run.overhead = result.overhead
    run.summary = rep.summarize(result.requests, result.wall_s, result.peak_snapshot_bytes)
    m = run.summary
    print(f"   {run.name} {trace.family}: {m.errors} errors, cached "
          f"{rep._fmt(m.cached_fraction, 'pct')} of {m.prompt_tokens:,} prompt tokens (ideal "
          f"{rep._fmt(m.ideal_fraction, 'pct')}), TTFT p50 {rep._fmt(m.ttft_p50_ms, 'ms')} ms, "
          f"replay {rep._fmt(m.e2e_s, 's')} s, server CPU {rep._fmt(run.server_cpu_s, 's')} s"
          + (f", plugin {rep._fmt(rep.overhead_share(run), 'pct')} of step time"
             if rep.overhead_share(run) is not None else "")
          + (f", LOADED (load up to {rep.peak_load(run):.1f})" if rep.loaded(run) else ""),
          flush=True)


def run_system(spec: SystemSpec, traces: list[Trace], settings: ServerSettings,
               cfg: ReplayConfig, tokenizer: PromptTokenizer, base_url: str | None,
               log_dir: Path, load_wait_s: float = LOAD_WAIT_S) -> list[rep.SystemRun]:
    """Replay every trace on one system, each from an empty cache.

    A started server replays its first trace fresh and the next ones after
    POST /reset_prefix_cache?reset_external=true (the connector's cache included); if a reset
    fails, the server is restarted instead, so no trace ever inherits another's cache. A remote
    server is reset if it allows it, and the report says whether it did.
    """
    runs = [rep.SystemRun(name=spec.name, description=spec.description) for _ in traces]
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    if base_url is not None:
        for run, trace in zip(runs, traces, strict=True):
            run.base_url = base_url
            run.cache_state = "reset" if reset_cache(base_url, headers) else "not reset"
            _measure(run, trace, msgspec.structs.replace(cfg, base_url=base_url), tokenizer,
                     load_wait_s=load_wait_s)
        return runs
    pending = list(range(len(traces)))
    while pending:
        log = log_dir / f"{traces[pending[0]].size}-{spec.name}-{len(traces) - len(pending)}.log"
        try:
            with running_server(spec, settings, log) as server:
                print(f"   {spec.name}: up in {server.startup_s:.0f} s at {server.base_url}",
                      flush=True)
                fresh = True
                while pending:
                    i = pending[0]
                    run = runs[i]
                    if fresh:
                        run.cache_state = "fresh server"
                    elif reset_cache(server.base_url, headers):
                        run.cache_state = "reset"
                    else:
                        print(f"   {spec.name}: cache reset refused; restarting", flush=True)
                        break
                    run.base_url, run.argv = server.base_url, server.argv
                    run.started_by_runner = True
                    run.log, run.startup_s = server.log_path, server.startup_s
                    _measure(run, traces[i],
                             msgspec.structs.replace(cfg, base_url=server.base_url), tokenizer,
                             server.pid, load_wait_s)
                    pending.pop(0)
                    fresh = False
        except ServerError as e:
            print(f"   {spec.name}: FAILED: {str(e).splitlines()[0]}", flush=True)
            for i in pending:
                runs[i].error = f"ServerError: {e}"
            return runs
    return runs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-next-tiny",
                   help="embedded model name, checkpoint folder or hub id")
    p.add_argument("--served-name", help="model name the server answers to "
                   "(default: --model; set it for remote servers that use another name)")
    p.add_argument("--trace", default="coding-agent",
                   help=f"comma list of families, or 'all' for the text families "
                        f"({', '.join(TEXT_FAMILIES)}; image families need a VL model: "
                        f"{', '.join(f for f in FAMILIES if f not in TEXT_FAMILIES)})")
    p.add_argument("--size", default="ci", help=f"comma list of sizes ({', '.join(SIZES)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="native,nocache,ours",
                   help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--base-url", action="append", default=[], metavar="[NAME=]URL",
                   help="replay against a running server instead of starting one")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for remote servers (default $OPENAI_API_KEY)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--history", choices=("scripted", "live"), default="scripted")
    p.add_argument("--tool-choice", default="none", choices=("none", "auto"),
                   help="'auto' needs --server-arg=--enable-auto-tool-choice and a parser")
    p.add_argument("--max-model-len", type=int, help="default: what the trace size needs")
    p.add_argument("--port", type=int, default=8100, help="first port to try for servers")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra vllm serve argument for every started server (repeat)")
    p.add_argument("--vllm", default="", help="the vllm command (default: ours, beside python)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--load-wait", type=float, default=LOAD_WAIT_S, metavar="S",
                   help="seconds each replay waits for the load average to fall to "
                        f"{rep.LOAD_LIMIT} before it runs anyway, flagged as loaded "
                        f"(default {LOAD_WAIT_S:.0f})")
    p.add_argument("--out", type=Path, default=REPLAY)
    p.add_argument("--log-dir", type=Path, default=None,
                   help="server logs (default bench-out/logs/<time>)")
    p.add_argument("--micro", help="run microbenchmark(s) instead: "
                   f"{', '.join(MICRO)}, comma list or 'all'")
    p.add_argument("--list", action="store_true", help="list traces, sizes, systems, micro")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = build_parser().parse_known_args(argv)
    if args.list:
        list_everything()
        return 0
    if args.micro:
        return run_micro(args.micro.split(","), rest)
    if rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")

    families = list(TEXT_FAMILIES) if args.trace == "all" else args.trace.split(",")
    sizes = args.size.split(",")
    systems = args.systems.split(",")
    for kind, names, known in (("system", systems, SYSTEMS), ("trace family", families, FAMILIES),
                               ("size", sizes, SIZES)):
        for name in names:
            if name not in known:
                raise SystemExit(f"benchmarks: unknown {kind} {name!r}; known: "
                                 f"{', '.join(known)}")
    base_urls = parse_base_urls(args.base_url, systems)
    command = "python -m benchmarks.run " + shlex.join(argv)
    log_dir = args.log_dir or REPO / "bench-out" / "logs" / dt.datetime.now(dt.UTC).strftime(
        "%Y%m%dT%H%M%SZ")

    model_path, served = resolve_model(args.model)
    served = args.served_name or served
    tokenizer = PromptTokenizer(model_path)
    cfg = ReplayConfig(base_url="", model=served, max_tokens=args.max_tokens,
                       history=args.history, tool_choice=args.tool_choice, api_key=args.api_key)
    status = 0
    for size in sizes:
        traces = [generate(family, size, args.seed) for family in families]
        local = {t.family: [len(tokenizer.prompt_ids(t.messages(r), t.tools(r)))
                            for r in t.requests] for t in traces}
        settings = ServerSettings(
            model_path=model_path, served_name=served, model_name=args.model,
            max_model_len=args.max_model_len or SIZES[size].max_model_len,
            port=args.port, seed=args.seed, extra_args=list(args.server_arg),
            startup_timeout_s=args.startup_timeout, vllm=args.vllm)
        print(f"== size {size} on {args.model}: "
              + ", ".join(f"{t.family} {len(t.requests)} requests / "
                          f"{sum(local[t.family]):,} prompt tokens" for t in traces), flush=True)
        started = _utc()
        by_system = {name: run_system(SYSTEMS[name], traces, settings, cfg, tokenizer,
                                      base_urls.get(name), log_dir, args.load_wait)
                     for name in systems}
        finished = _utc()
        for i, trace in enumerate(traces):
            runs = [by_system[name][i] for name in systems]
            if any(r.error or (r.summary and r.summary.errors) for r in runs):
                status = 1
            report = rep.Report(
                schema=rep.SCHEMA_VERSION, command=command, started_utc=started,
                finished_utc=finished, git_commit=git_commit(),
                vllm_version=vllm_version(), host=_host(),
                model={"name": args.model, "path": model_path, "served_name": served},
                trace={"family": trace.family, "size": size, "seed": args.seed,
                       "description": trace.description, "digest": trace.digest(),
                       "requests": len(trace.requests), "waves": len(trace.waves()),
                       "sessions": len(trace.sessions),
                       "prompt_tokens": sum(local[trace.family]),
                       "max_prompt_tokens": max(local[trace.family])},
                settings={"history": args.history, "max_tokens": args.max_tokens,
                          "tool_choice": args.tool_choice,
                          "max_model_len": settings.max_model_len,
                          "extra_server_args": list(args.server_arg),
                          "kv_cache_space_gib": settings.kv_cache_space_gib,
                          "remote": sorted(base_urls)},
                systems=runs)
            paths = rep.write(report, args.out)
            print(f"   report: {paths['markdown']}", flush=True)
        rep.write_index(args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
