"""`Qwen4ExpForConditionalGeneration` checkpoints (multimodal layout, `model.language_model.*`
weights) serve their text path through our model; image requests are refused up front."""

from __future__ import annotations

import shutil

import pytest
import torch

from .helpers import MAX_TOL, MEAN_TOL, engine, logprob_distance, prompt_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cg_checkpoint(embedded_model, tmp_path_factory):
    """flash-next-tiny's text config inside a Qwen4ExpConfig with a 1-block vision tower."""
    from transformers import AutoConfig, Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    tiny = embedded_model("flash-next-tiny")
    text = AutoConfig.from_pretrained(str(tiny)).to_dict()
    vision = dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128,
                  out_hidden_size=text["hidden_size"], patch_size=16)
    cfg = Qwen4ExpConfig(text_config=text, vision_config=vision)
    cfg.architectures = ["Qwen4ExpForConditionalGeneration"]
    torch.manual_seed(0)
    model = Qwen4ExpForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ple.conv1d" in name:  # zero-initialised: make PLE's conv visible
                p.normal_(0, 0.3)
    out = tmp_path_factory.mktemp("flash-next-cg")
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json"):
        shutil.copy(tiny / f, out / f)
    return out, model


def test_text_path_matches_transformers_and_images_are_refused(cg_checkpoint):
    from PIL import Image
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    path, hf_model = cg_checkpoint
    ids = prompt_ids(300, seed=11)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    with engine(path, max_model_len=2048) as llm:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20, logprobs=20)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        with pytest.raises(ValueError, match="text-only"):
            llm.generate({"prompt": "hello",
                          "multi_modal_data": {"image": Image.new("RGB", (32, 32))}},
                         SamplingParams(max_tokens=1), use_tqdm=False)
    mean, worst, _ = logprob_distance(out, ref)
    assert mean < MEAN_TOL and worst < MAX_TOL, (mean, worst)
