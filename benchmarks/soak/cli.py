"""`python -m benchmarks.soak --duration 600 --seed 7 --model flash-next-tiny`

Starts one `vllm serve MODEL --plugin hybridcache` server (grid 256, message-end cuts, a RAM
budget of a few links so eviction never stops, a disk tier in a fresh folder, a KV cache of
`--kv-blocks` blocks so vLLM preempts under load), runs `--concurrency` session workers and the
fault schedule for `--duration` seconds (restarts included), then stops everything and writes
`soak-<model>-s<seed>.json` and `.png` to `--out`. Exit status 0 only when the verdict passes
(benchmarks/soak/report.py says what fails it); 2 when the server cannot start.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import requests

from benchmarks.servers import ServerError, ServerSettings
from benchmarks.soak.faults import DISK_ONLY, KINDS, FaultRunner
from benchmarks.soak.ledger import FaultRecord, Ledger
from benchmarks.soak.monitor import Monitor
from benchmarks.soak.report import plot, summarize
from benchmarks.soak.server import SoakServer
from benchmarks.soak.traffic import Context, session_worker
from benchmarks.traces import SIZES, TEXT_FAMILIES
from vllm_hybridcache.segmentation import Segmentation

# vLLM's CPU GDN kernels run only in bf16, so qwen3-next models cannot be checked in float32;
# Flash-Next runs float32 on CPU.
BF16_ONLY = ("qwen3-next",)
# Float32: the end-anchor gate's tolerance. bf16: the drift measured for qwen3-next-tiny by
# that gate (up to 0.16 nats on AVX2 kernels) with some room; the check is much weaker there.
DRIFT = {"float32": 1e-3, "bfloat16": 0.25}
# End-anchor hits: the end-anchor gate's tolerance in float32; in bf16 the decode-vs-prefill
# drift is the CPU kernels' (up to 0.16 nats at a first token, another pick over a 0.156-nat
# margin with AVX2 kernels), so anchor hits are reported there, not judged (as the gate test).
ANCHOR_DRIFT: dict[str, float | None] = {"float32": 1e-3, "bfloat16": None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0,
                   help="seconds of traffic and faults (restarts included)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--model", default="flash-next-tiny")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: float32, bfloat16 for models whose CPU kernels need it")
    p.add_argument("--drift-nats", type=float, default=None,
                   help=f"greedy-check tolerance (default by dtype: {DRIFT})")
    p.add_argument("--size", default="ci", choices=sorted(SIZES))
    p.add_argument("--families", default=",".join(TEXT_FAMILIES),
                   help="trace families (default: every text family; image-chat needs a "
                        "vision-language model)")
    p.add_argument("--concurrency", type=int, default=2, help="session workers")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--budget-bytes", type=int, default=24 << 20,
                   help="RAM tier budget: a few links, so eviction runs all the time")
    p.add_argument("--disk-budget-bytes", type=int, default=96 << 20)
    p.add_argument("--no-disk", action="store_true", help="no disk tier (no kill -9 fault)")
    p.add_argument("--kv-blocks", type=int, default=72,
                   help="vLLM KV cache blocks (--num-gpu-blocks-override): small = preemptions")
    p.add_argument("--grid", type=int, default=256)
    p.add_argument("--message-end-min", type=int, default=64)
    p.add_argument("--fault-every", type=float, default=20.0, help="mean seconds between faults")
    p.add_argument("--first-fault", type=float, default=10.0)
    p.add_argument("--kill-gap", type=float, default=300.0,
                   help="seconds between two kill -9 faults at least")
    p.add_argument("--min-life", type=float, default=30.0,
                   help="seconds a life serves before it may be killed")
    p.add_argument("--all-faults", action="store_true",
                   help="run past --duration (up to three times it) until every fault kind "
                        "ran once (restore_corruption: until it injected one) and a cache-side "
                        "request was answered from a tree hit (CI: a loaded machine must not "
                        "leave a kind out)")
    p.add_argument("--faults", default="all", help="comma-separated kinds or 'all'")
    p.add_argument("--corrupt-per-round", type=int, default=1,
                   help="restore_corruption faults per round of the schedule (each kind comes "
                        "once a round): more injected corruptions for the checker to catch")
    p.add_argument("--trace-seeds", type=int, default=3)
    p.add_argument("--arm-weights", default="0.55,0.2,0.25",
                   help="shares of cache, tenant and control (cache-off) traces")
    p.add_argument("--history-weights", default="0.4,0.3,0.3",
                   help="shares of scripted, live (the model's answers re-rendered) and tokens "
                        "(continued on token ids: end-anchor hits) traces")
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--rss-bound", type=float, default=16.0,
                   help="MiB/min of resident-memory growth allowed at steady state")
    p.add_argument("--min-window", type=float, default=300.0,
                   help="seconds of steady state needed to judge the RSS slope")
    p.add_argument("--port", type=int, default=8900)
    p.add_argument("--out", default="soak-out")
    return p.parse_args(argv)


def _source_state() -> dict[str, object]:
    """The commit the server ran and any uncommitted package files (a shared tree moves)."""
    import subprocess

    repo = Path(__file__).resolve().parents[2]

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--", "vllm_hybridcache").splitlines()}


def tree_hit_answered(ledger: Ledger) -> bool:
    """Whether a cache-side request (any arm but the control) was answered from a tree hit:
    what `--all-faults` waits for besides the faults, since on a loaded machine a short run
    may end with only misses and end-anchor hits answered (the report's `hit_requests`)."""
    requests, _ = ledger.snapshot()
    return any(r.outcome == "ok" and r.arm != "control" and r.hit_kind == "tree"
               for r in requests)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.run import resolve_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"soak-{args.model}-s{args.seed}"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if args.model.startswith(BF16_ONLY) else "float32"
    drift = args.drift_nats if args.drift_nats is not None else DRIFT[dtype]
    anchor_drift = ANCHOR_DRIFT[dtype] if args.drift_nats is None else args.drift_nats
    kinds = KINDS if args.faults == "all" else tuple(args.faults.split(","))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"soak: unknown fault kind(s) {unknown}; known: {', '.join(KINDS)}",
              file=sys.stderr)
        return 2
    if args.no_disk:
        kinds = tuple(k for k in kinds if k not in DISK_ONLY)
    families = tuple(args.families.split(","))
    weights = tuple(float(w) for w in args.arm_weights.split(","))

    path, served = resolve_model(args.model)
    disk_dir = None if args.no_disk else tempfile.mkdtemp(prefix="soak-disk-")
    env = {"VLLM_HYBRIDCACHE_GRID": str(args.grid),
           "VLLM_HYBRIDCACHE_MESSAGE_END_MIN": str(args.message_end_min),
           "VLLM_HYBRIDCACHE_BUDGET_BYTES": str(args.budget_bytes),
           "VLLM_HYBRIDCACHE_MEMORY_FLOOR_BYTES": str(256 << 20)}
    if disk_dir:
        env.update({"VLLM_HYBRIDCACHE_DISK_DIR": disk_dir,
                    "VLLM_HYBRIDCACHE_DISK_BUDGET_BYTES": str(args.disk_budget_bytes),
                    "VLLM_HYBRIDCACHE_DISK_MIN_FREE_BYTES": str(256 << 20)})
    settings = ServerSettings(
        model_path=path, served_name=served, max_model_len=SIZES[args.size].max_model_len,
        port=args.port, seed=args.seed,
        extra_args=["--dtype", dtype, "--num-gpu-blocks-override", str(args.kv_blocks),
                    "--worker-extension-cls",
                    "vllm_hybridcache.testing.instrumentation.FaultInjection"])
    server = SoakServer(settings, env, out / "logs")
    ledger = Ledger()
    interrupted = _stop_on_signals()
    source = _source_state()
    t_start = time.monotonic()
    try:
        server.start()
    except ServerError as e:
        print(f"soak: {e}", file=sys.stderr)
        server.stop()
        return 2
    try:
        r = requests.post(server.base_url + "/tokenize", timeout=30, json={
            "model": served, "prompt": "<|im_end|>", "add_special_tokens": False})
        ids = r.json()["tokens"]
        seg = Segmentation(grid=args.grid, message_end_ids=tuple(ids) if len(ids) == 1 else (),
                           message_end_min=args.message_end_min)
        ctx = Context(server, ledger, model=served, size=args.size, max_tokens=args.max_tokens,
                      drift_nats=drift, anchor_drift_nats=anchor_drift, segmentation=seg)
        summary, monitor = _run(args, ctx, kinds, families, weights, interrupted)
    finally:
        server.stop()
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    wall = time.monotonic() - t_start
    reqs, faults = ledger.snapshot()
    summary = summarize(reqs, faults, monitor.samples, wall_s=wall, startups=server.startups,
                        kinds=kinds,
                        rss_bound_mib_per_min=args.rss_bound, min_window_s=args.min_window)
    if interrupted.is_set():
        summary["interrupted"] = f"stopped by a signal after {wall:.0f} s of {args.duration:.0f}"
    command = "python -m benchmarks.soak " + shlex.join(argv if argv is not None
                                                        else sys.argv[1:])
    report = {"command": command, "model": args.model, "dtype": dtype, "drift_nats": drift,
              "anchor_drift_nats": anchor_drift,
              "source": source,
              "settings": {**vars(args), "server_argv": server.argv, "server_env": env},
              "summary": summary, "samples": monitor.samples,
              "faults": msgspec.to_builtins(faults), "requests": msgspec.to_builtins(reqs)}
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    plot(monitor.samples, reqs, faults, out / f"{stem}.png",
         f"{args.model} ({dtype}), seed {args.seed}, {wall / 60:.1f} min")
    print(json.dumps(summary, indent=1))
    print(f"soak: {summary['verdict']}; injected restore corruptions caught: "
          f"{summary['corrupt_caught']} of {summary['corrupt_injected']}; "
          f"report {out / stem}.json, plot {out / stem}.png")
    return 0 if summary["verdict"] == "pass" else 1


def _stop_on_signals() -> threading.Event:
    """SIGTERM or Ctrl-C ends the traffic early and the run still writes its report (marked
    ``interrupted``) with everything measured so far; a second signal stops it at once."""
    event = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        if event.is_set():
            raise KeyboardInterrupt
        print(f"soak: signal {signum}: stopping the traffic and writing the report so far",
              file=sys.stderr)
        event.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return event


def _run(args, ctx: Context, kinds, families, weights, interrupted: threading.Event):
    ledger, server = ctx.ledger, ctx.server

    def restart() -> float:
        ctx.killing.set()
        try:
            server.kill9()
            return server.start()
        finally:
            ctx.killing.clear()

    monitor = Monitor(ctx, args.sample_every)
    monitor.sample()
    monitor.start()
    faults = FaultRunner(ctx, args.seed, args.fault_every, args.first_fault, kinds, restart,
                         min_life_s=args.min_life, kill_gap_s=args.kill_gap,
                         corrupt_per_round=args.corrupt_per_round)
    threads = [threading.Thread(target=faults.run, name="soak-faults", daemon=True)]
    threads += [threading.Thread(target=session_worker, name=f"soak-worker-{i}", daemon=True,
                                 args=(ctx, i, args.seed, args.trace_seeds, families, weights,
                                       tuple(float(w) for w in args.history_weights.split(","))))
                for i in range(args.concurrency)]
    for t in threads:
        t.start()
    start = time.monotonic()
    deadline = start + args.duration

    def more() -> bool:
        if interrupted.is_set():
            return False
        now = time.monotonic()
        if now < deadline:
            return True
        return (args.all_faults and now < start + 3 * args.duration
                and not (faults.done >= set(kinds) and tree_hit_answered(ledger)))

    while more():
        time.sleep(1.0)
        if not server.alive() and not ctx.killing.is_set():
            # the server died on its own: the worst finding; record it and bring it back
            ledger.fault(FaultRecord(t=ctx.now(), life=server.life, kind="server_died",
                                     expected=False, detail=f"exit {server.proc.returncode}"))
            ctx.killing.set()
            try:
                server.kill9()
                server.start()
            except ServerError as e:
                print(f"soak: restart after a crash failed: {e}", file=sys.stderr)
                break
            finally:
                ctx.killing.clear()
    ctx.stop.set()
    for t in threads:
        t.join(timeout=ctx.timeout_s)
    monitor.stop()
    monitor.sample()
    return None, monitor
