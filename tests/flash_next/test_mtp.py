"""MTP speculative decoding with Flash-Next on CPU: greedy outputs are identical with and
without the draft; plus the indexing of speculative state columns."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .helpers import engine, prompt_ids


def test_section_batch_reads_the_last_accepted_column():
    """After a verify step with drafts, each decode resumes from the state written after its
    last accepted token (column num_accepted - 1); prefills read and write their one block."""
    from vllm_hybridcache.flash_next.common import section_batch

    meta = SimpleNamespace(
        num_decodes=2, num_prefills=1,
        query_start_loc_d=torch.tensor([0, 3, 6]),
        state_indices_tensor_d=torch.tensor([[10, 11, 12], [20, 21, 22]]),
        num_accepted_tokens=torch.tensor([3, 1]),
        query_start_loc_p=torch.tensor([0, 5]),
        state_indices_tensor_p=torch.tensor([30]),
        has_initial_states_p=torch.tensor([False]))
    b = section_batch(meta, 11)
    assert b.cu_seqlens.tolist() == [0, 3, 6, 11]
    assert b.read_slots.tolist() == [12, 20, 30]
    assert b.has_state.tolist() == [True, True, False]
    assert b.dec_cols.tolist() == [[10, 11, 12], [20, 21, 22]]


def _greedy(llm, prompts, n=32):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
def test_mtp_greedy_outputs_identical(embedded_model):
    path = embedded_model("flash-next-tiny")
    prompts = [prompt_ids(n, seed=200 + n) for n in (5, 70, 300)]
    with engine(path, max_model_len=2048) as plain:
        expected = _greedy(plain, prompts)
    for k in (1, 2):
        spec = {"method": "mtp", "num_speculative_tokens": k}
        with engine(path, max_model_len=2048, speculative_config=spec,
                    disable_log_stats=False) as llm:
            assert _greedy(llm, prompts) == expected, k
            drafts = [m for m in llm.get_metrics()
                      if m.name == "vllm:spec_decode_num_draft_tokens"]
            assert drafts and drafts[0].value > 0  # the draft really ran
