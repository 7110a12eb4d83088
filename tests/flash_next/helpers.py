"""Shared helpers of the Flash-Next correctness tests: prompts, the transformers oracle, the
logprob distance, engines."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from tests.conftest import vllm_engine

# Float32 tolerance on the mean |d logprob| over each position's vLLM top-20 plus the prompt
# token. Measured: ~3e-7 (max ~2e-6) on 1000 tokens; dropping PLE or the indexer selection
# moves it by orders of magnitude more (see test_negative_controls).
MEAN_TOL = 1e-4
MAX_TOL = 5e-3


def prompt_ids(n: int, seed: int = 0, vocab: int = 4096) -> list[int]:
    """Deterministic token ids avoiding the special tokens at the bottom of the vocabulary."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


class HFOracle:
    """transformers' Qwen4ExpForCausalLM in float32: full next-token logprobs and greedy."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab]: row p is log p(token | ids[:p + 1])."""
        logits = self.model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def greedy(self, ids: list[int], n: int) -> list[int]:
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                  min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()


def logprob_distance(request_output, ref: torch.Tensor) -> tuple[float, float, int]:
    """(mean, max) |vLLM - reference| over every logprob vLLM returned: prompt positions
    (its top-k plus the prompt token) and the first generated position."""
    diffs: list[float] = []
    prompt_lps = request_output.prompt_logprobs or []
    for p, entry in enumerate(prompt_lps):
        if entry is None:
            continue
        diffs += [abs(v.logprob - ref[p - 1, tok].item()) for tok, v in entry.items()]
    gen = request_output.outputs[0].logprobs
    if gen:
        diffs += [abs(v.logprob - ref[-1, tok].item()) for tok, v in gen[0].items()]
    return sum(diffs) / len(diffs), max(diffs), len(diffs)


@contextmanager
def engine(path: Path, *, dtype: str = "float32", env: dict[str, str] | None = None, **kw):
    """A vLLM engine for the Flash-Next checkpoint; shut down (and env restored) on exit."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    args = dict(dtype=dtype, enable_prefix_caching=False,
                max_model_len=6144, max_num_batched_tokens=2048, max_num_seqs=8,
                enforce_eager=True, seed=0)
    args.update(kw)
    try:
        with vllm_engine(path, **args) as llm:
            yield llm
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class DenseSelectionOps:
    """Kernel ops whose indexer keeps every visible token: QSA without its top-k selection.

    Only for the negative control (a model with a dropped component must fail the tolerance);
    it lives here, not in the model, so production code has no test-only path.
    """

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def indexer_topk(self, q, raw_keys, key_cu_seqlens, query_seq_idx, query_pos, *args,
                     budget, compress_ratio, **kw) -> torch.Tensor:
        n = int(query_pos.max()) + 1 if query_pos.numel() else 1
        idx = torch.arange(n, dtype=torch.int32).expand(q.shape[0], n).clone()
        idx[idx > query_pos[:, None].to(torch.int32)] = -1
        return idx


def drop_indexer_selection(model) -> int:
    """Rewire a loaded Flash-Next model (`llm.apply_model(drop_indexer_selection)`, run in the
    worker) onto `DenseSelectionOps`; returns how many modules now use them.

    Every module that calls kernels reads `self.ops` at forward time, so swapping the attribute
    after loading is the same as building the model with these ops.
    """
    dense = DenseSelectionOps(model.ops)
    model.ops = dense
    n = 0
    for module in model.model.modules():
        if hasattr(module, "ops"):
            module.ops = dense
            n += 1
    return n
