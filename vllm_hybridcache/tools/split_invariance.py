"""Which op breaks split invariance first: prefill one prompt under two step patterns and compare
every module's and every kernel op's per-token outputs.

    python -m vllm_hybridcache.tools.split_invariance --ops cpu --dtype float32 --tokens 1024
    python -m vllm_hybridcache.tools.split_invariance --ops triton --tokens 320 --step 64
    python -m vllm_hybridcache.tools.split_invariance --vllm-qwen3-next --tokens 1024

Why this criterion finds the origin: a token's outputs can only depend on tokens at or before
it. So among all recorded outputs, the smallest token position at which any output differs
between the two patterns is where the first difference arose, and among the outputs that differ
at that position, the one computed first in the forward (module and op order of the first step)
is the op whose inputs still agreed; everything after it may just propagate it.

Flash-Next (`--ops reference|cpu|triton`) runs in-process through `tools.flash_next_steps`
(seconds per pattern; the Triton kernels through Triton's CPU interpreter, so keep prompts
short). `--vllm-qwen3-next` drives vLLM's own Qwen3-Next CPU model through an in-process engine
per pattern (chunked prefill with `max_num_batched_tokens` = the step) and hooks every module of
its model; minutes per pattern.
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


def record_vllm(model_path, ids: list[int], step: int, dtype: str) -> Recording:
    """vLLM's own model for the checkpoint, prefilling `ids` in chunks of `step` tokens, with a
    forward hook on every module (in-process engine; the prompt runs alone)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # one short request: 1 GiB of KV cache, not vLLM's CPU default of most of the machine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model_path), dtype=dtype, enforce_eager=True, seed=0,
              enable_prefix_caching=False, max_model_len=max(len(ids) + 16, 2048),
              max_num_batched_tokens=step, max_num_seqs=1, enable_chunked_prefill=True)
    rec = Recording()
    handles: list = []

    def install(model) -> int:
        # runs on the model inside this process (in-process engine): vLLM's public apply_model
        for name, module in model.named_modules():
            if name:
                handles.append(module.register_forward_hook(
                    lambda _m, _i, out, name=name: rec.add(name, out)))
        handles.append(model.model.register_forward_pre_hook(
            lambda _m, args, kwargs: rec.start_step(
                (args[0] if args and args[0] is not None else kwargs["input_ids"]).shape[0]),
            with_kwargs=True))
        return len(handles)

    try:
        if not all(n > 0 for n in llm.apply_model(install)):
            raise RuntimeError("no module of vLLM's model could be hooked")
        params = SamplingParams(max_tokens=1, temperature=0)
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        for h in handles:
            h.remove()
        return _only_prompt(rec, len(ids))
    finally:
        # the next pattern builds another engine in this process: take this one down whole
        import gc

        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def _only_prompt(rec: Recording, n: int) -> Recording:
    """Keep the calls that covered the prompt (drop the decode step of the sampled token)."""
    out = Recording(order=list(rec.order))
    for name, parts in rec.steps.items():
        kept, total = [], 0
        for p in parts:
            if total >= n:
                break
            kept.append(p)
            total += p.shape[0]
        out.steps[name] = kept
    return out


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
    ap.add_argument("--model", default=None, help="embedded model name (default flash-next-tiny,"
                    " or qwen3-next-tiny with --vllm-qwen3-next)")
    ap.add_argument("--ops", default="cpu", choices=["reference", "cpu", "triton"])
    ap.add_argument("--dtype", default=None,
                    help="default float32 for Flash-Next, bfloat16 for vLLM's Qwen3-Next (its "
                    "CPU GDN kernel is bf16 only)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--patterns", nargs="+", default=["one", "256", "64", "64+256"],
                    help="step patterns; the first is the baseline (one, N, F+N)")
    ap.add_argument("--invariant", action="store_true",
                    help="Flash-Next with the split-invariant forward switched on")
    ap.add_argument("--vllm-qwen3-next", action="store_true",
                    help="vLLM's own CPU model (in-process engine per pattern)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.vllm_qwen3_next else "float32")

    from vllm_hybridcache.models import ensure_model

    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(10, 4000, (args.tokens,), generator=g).tolist()
    if args.vllm_qwen3_next:
        path = ensure_model(args.model or "qwen3-next-tiny")
        sizes = [args.tokens if p == "one" else int(p) for p in args.patterns]
        base = record_vllm(path, ids, max(sizes[0], 256), args.dtype)
        for p, size in zip(args.patterns[1:], sizes[1:], strict=True):
            print(f"== vLLM {path.name} {args.dtype}: one step vs steps of {size} ({p})")
            print(describe(compare(base, record_vllm(path, ids, size, args.dtype))))
        return 0

    if args.ops == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm_hybridcache.tools.flash_next_steps import FlashNextStepper

    path = ensure_model(args.model or "flash-next-tiny")
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


if __name__ == "__main__":
    raise SystemExit(main())
