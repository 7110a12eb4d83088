"""Which op breaks split invariance first: prefill one prompt under two step patterns and compare
every module's and every kernel op's per-token outputs.

    python -m vllm_hybridcache.tools.split_invariance --ops cpu --dtype float32 --tokens 1024
    python -m vllm_hybridcache.tools.split_invariance --ops triton --tokens 320 --patterns one 64

Why this criterion finds the origin: a token's outputs can only depend on tokens at or before
it. So among all recorded outputs, the smallest token position at which any output differs
between the two patterns is where the first difference arose, and among the outputs that differ
at that position, the one computed first in the forward (module and op order of the first step)
is the op whose inputs still agreed; everything after it may just propagate it.

Flash-Next (`--ops reference|cpu|triton`) runs in-process through `tools.flash_next_steps`
(seconds per pattern; the Triton kernels through Triton's CPU interpreter, so keep prompts
short).

vLLM's own models (`--engine qwen3-next-tiny`) run in a vLLM engine, one child process per
pattern (an engine per step size: vLLM's chunked prefill with `max_num_batched_tokens` = the
step, `max_num_seqs` = 1); the child runs its engine in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor: without it the CPU worker is another
process and the hooks record there), so hooks installed through `LLM.apply_model` record in the
child itself, and it saves the recording for the parent to compare. Patterns there are
`one` or `N` (the token budget sets every step but the last).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Recording:
    """Per-token outputs of every hooked module/op, over all steps of one prefill.

    `order` is the first step's call order (the forward order of one token); `steps[name]` the
    outputs of each call, reshaped to [step tokens, -1] (calls whose output has no token axis,
    such as final states, are not recorded).
    """

    order: list[str] = field(default_factory=list)
    steps: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    tokens: int = 0  # tokens of the step being recorded
    calls: dict[str, int] = field(default_factory=dict)  # this step's calls per name

    def start_step(self, tokens: int) -> None:
        self.tokens = tokens
        self.calls = {}

    def add(self, name: str, value) -> None:
        # the k-th call of one module/op in a step (hc_inject runs twice per layer) is its own
        # output: name#k
        k = self.calls.get(name, 0)
        self.calls[name] = k + 1
        if k:
            name = f"{name}#{k}"
        values = value if isinstance(value, tuple | list) else (value,)
        for i, v in enumerate(values):
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or self.tokens == 0:
                continue
            if v.shape[0] % self.tokens or v.shape[0] == 0:
                continue
            key = name if len(values) == 1 else f"{name}[{i}]"
            if key not in self.steps:
                self.steps[key] = []
                self.order.append(key)
            self.steps[key].append(v.detach().reshape(self.tokens, -1).float().clone())

    def full(self, name: str) -> torch.Tensor:
        return torch.cat(self.steps[name])


@dataclass
class Divergence:
    """Where two recordings first differ: the op, the token position, and what else differs."""

    name: str | None
    position: int | None
    max_abs: float
    differing: list[tuple[str, int]]  # every output that differs, with its first position
    compared: int = 0  # outputs recorded in both runs with the same shape


def compare(a: Recording, b: Recording) -> Divergence:
    firsts: list[tuple[int, int, str, float]] = []
    compared = 0
    for rank, name in enumerate(a.order):
        if name not in b.steps:
            continue
        x, y = a.full(name), b.full(name)
        if x.shape != y.shape:
            continue
        compared += 1
        rows = (x != y).flatten(1).any(-1).nonzero()
        if rows.numel():
            firsts.append((int(rows[0]), rank, name, float((x - y).abs().max())))
    if not firsts:
        return Divergence(None, None, 0.0, [], compared)
    firsts.sort()
    pos, _, name, worst = firsts[0]
    return Divergence(name, pos, worst, [(n, p) for p, _, n, _ in firsts], compared)


class _RecordingOps:
    """Wraps a kernel backend for one module: every op call's outputs go to the recording."""

    def __init__(self, inner, prefix: str, rec: Callable[[], Recording]) -> None:
        self._inner, self._prefix, self._rec = inner, prefix, rec

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args, **kwargs):
            out = attr(*args, **kwargs)
            self._rec().add(f"{self._prefix}:{name}", out)
            return out

        return call


def record_flash_next(stepper, ids: list[int], steps: list[int]) -> tuple[Recording, object]:
    """Prefill with hooks on every module and every kernel op call of the Flash-Next model."""
    rec = Recording()
    handles = []
    originals = {}
    for name, module in stepper.model.named_modules():
        if name:
            handles.append(module.register_forward_hook(
                lambda _m, _i, out, name=name: rec.add(name, out)))
        if hasattr(module, "ops"):
            originals[name] = module.ops
            module.ops = _RecordingOps(module.ops, name or "model", lambda: rec)
    handles.append(stepper.model.model.register_forward_pre_hook(
        lambda _m, args: rec.start_step(args[0].shape[0])))
    try:
        result = stepper.prefill(ids, steps)
    finally:
        for h in handles:
            h.remove()
        for name, ops in originals.items():
            stepper.model.get_submodule(name).ops = ops
    rec.start_step(len(ids))
    rec.add("logits", result.logits)
    return rec, result


def _engine_child(model: str, dtype: str, tokens: int, step: int, seed: int, out: str) -> int:
    """One pattern in a vLLM engine of this process; saves (order, steps, prompt logprobs)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # a fixed KV cache, not a fraction
    from vllm import LLM, SamplingParams

    from vllm_hybridcache.models import ensure_model

    ids = prompt(tokens, seed)
    llm = LLM(model=str(ensure_model(model)), dtype=dtype, max_model_len=max(2048, tokens + 64),
              max_num_batched_tokens=step, max_num_seqs=1, enable_chunked_prefill=True,
              enable_prefix_caching=False, enforce_eager=True, seed=0,
              distributed_executor_backend="uni")  # the worker in this process: hooks record here
    rec = Recording()
    steps: list[int] = []

    def install(model) -> int:
        n = 0
        for name, module in model.named_modules():
            if name:
                module.register_forward_hook(lambda _m, _i, o, name=name: rec.add(name, o))
                n += 1

        def start(_m, args, kwargs):
            pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
            steps.append(int(pos.shape[-1]))
            rec.start_step(steps[-1])

        # on the outer model: vLLM's compile decorator replaces the inner model's __call__,
        # which skips that module's own hooks (its layers' hooks still run)
        model.register_forward_pre_hook(start, with_kwargs=True)
        return n

    hooked = llm.apply_model(install)
    res = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    lp = [float(next(iter(d.values())).logprob) for d in res.prompt_logprobs[1:]]
    torch.save({"order": rec.order, "steps": rec.steps, "sizes": steps, "hooked": hooked,
                "prompt_logprobs": lp}, out)
    llm.llm_engine.engine_core.shutdown()
    return 0


def prompt(tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 4000, (tokens,), generator=g).tolist()


def record_engine(model: str, dtype: str, tokens: int, step: int, seed: int,
                  workdir: str) -> tuple[Recording, dict]:
    """Run one pattern in a child process (a fresh engine) and load its recording."""
    import subprocess

    out = os.path.join(workdir, f"rec-{step}.pt")
    cmd = [sys.executable, "-m", "vllm_hybridcache.tools.split_invariance", "--engine", model,
           "--dtype", dtype, "--tokens", str(tokens), "--seed", str(seed),
           "--child-step", str(step), "--child-out", out]
    subprocess.run(cmd, check=True)
    data = torch.load(out)
    rec = Recording(order=data["order"], steps=data["steps"])
    return rec, data


def describe(div: Divergence, limit: int = 12) -> str:
    if div.name is None:
        return (f"identical: all {div.compared} recorded outputs agree bit for bit"
                if div.compared else "nothing compared: no output was recorded in both runs")
    lines = [f"first difference: {div.name} at token {div.position} (max |d| over the prompt "
             f"{div.max_abs:.3g})", "outputs that differ (first position):"]
    lines += [f"  {p:6d}  {n}" for n, p in div.differing[:limit]]
    if len(div.differing) > limit:
        lines.append(f"  ... {len(div.differing) - limit} more")
    return "\n".join(lines)


def parse_pattern(text: str, n: int) -> list[int]:
    """'one' -> [n]; '256' -> steps of 256; '64+256' -> a first step of 64, then 256s."""
    from vllm_hybridcache.tools.flash_next_steps import steps_of

    if text == "one":
        return [n]
    if "+" in text:
        first, size = text.split("+")
        return steps_of(n, int(size), first=int(first))
    return steps_of(n, int(text))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flash-next-tiny", help="embedded Flash-Next model")
    ap.add_argument("--ops", default="cpu", choices=["reference", "cpu", "triton"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--patterns", nargs="+", default=["one", "256", "64", "64+256"],
                    help="step patterns; the first is the baseline (one, N, F+N)")
    ap.add_argument("--invariant", action="store_true",
                    help="Flash-Next with the split-invariant forward switched on")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--engine", default=None,
                    help="a vLLM model (embedded name, e.g. qwen3-next-tiny) run in vLLM "
                         "engines instead of the in-process Flash-Next driver")
    ap.add_argument("--child-step", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_step is not None:
        return _engine_child(args.engine, args.dtype, args.tokens, args.child_step, args.seed,
                             args.child_out)
    if args.engine is not None:
        return main_engine(args)

    from vllm_hybridcache.models import ensure_model

    ids = prompt(args.tokens, args.seed)
    if args.ops == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm_hybridcache.tools.flash_next_steps import FlashNextStepper

    path = ensure_model(args.model)
    stepper = FlashNextStepper(path, dtype=args.dtype, ops=args.ops,
                               max_len=max(2048, args.tokens), split_invariant=args.invariant)
    patterns = [parse_pattern(p, args.tokens) for p in args.patterns]
    base, _ = record_flash_next(stepper, ids, patterns[0])
    for text, pat in zip(args.patterns[1:], patterns[1:], strict=True):
        print(f"== Flash-Next {args.ops} {args.dtype}{' invariant' if args.invariant else ''}: "
              f"{args.patterns[0]} vs {text} ({len(pat)} steps)")
        print(describe(compare(base, record_flash_next(stepper, ids, pat)[0])))
        sys.stdout.flush()
    return 0


def main_engine(args) -> int:
    import tempfile

    def step_of(text: str) -> int:
        if text == "one":
            return args.tokens
        if "+" in text:
            raise SystemExit("engine patterns are 'one' or N (the token budget sets the steps)")
        return int(text)

    with tempfile.TemporaryDirectory() as tmp:
        base, bdata = record_engine(args.engine, args.dtype, args.tokens,
                                    step_of(args.patterns[0]), args.seed, tmp)
        for text in args.patterns[1:]:
            rec, data = record_engine(args.engine, args.dtype, args.tokens, step_of(text),
                                      args.seed, tmp)
            print(f"== {args.engine} (vLLM engine) {args.dtype}: {args.patterns[0]} "
                  f"(steps {bdata['sizes']}) vs {text} (steps {data['sizes']}); "
                  f"{data['hooked']} modules hooked")
            print(describe(compare(base, rec)))
            a, b = bdata["prompt_logprobs"], data["prompt_logprobs"]
            diff = [i + 1 for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
            print(f"prompt logprobs: {len(diff)} of {len(a)} positions differ"
                  + (f", first at position {diff[0]}" if diff else ""))
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
