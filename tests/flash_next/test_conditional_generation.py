"""`Qwen4ExpForConditionalGeneration` (flash-next-vl-tiny) through vLLM against transformers:
text prompts, and image prompts fed the same pixel values (float32 prompt logprobs within the
text path's tolerance). The engine prefills in steps of 96 tokens, so image placeholder ranges
are cut across steps and later steps read earlier tokens' M-RoPE tables from the QSA rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .helpers import MAX_TOL, MEAN_TOL, engine, logprob_distance, prompt_ids

pytestmark = pytest.mark.slow


def _image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vl(embedded_model):
    """(checkpoint, transformers model in float32, outputs of one vLLM engine)."""
    from transformers import Qwen4ExpForConditionalGeneration
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    path = embedded_model("flash-next-vl-tiny")
    hf = Qwen4ExpForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    ph = "<|vision_start|><|image_pad|><|vision_end|>"
    text = ("<|im_start|>user\n" + "Here is a picture of the house we talked about: " + ph
            + " and here is the garden behind it, seen from the kitchen window: " + ph
            + " Which one would you paint first, and with which colours? Answer in detail."
            + "<|im_end|>\n<|im_start|>assistant\n")
    images = [_image(256, 160, 1), _image(96, 128, 2)]
    other = [_image(256, 160, 3), images[1]]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20, logprobs=20)
    with engine(path, max_model_len=2048, max_num_batched_tokens=96) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids(300, seed=11)),
                             {"prompt": text, "multi_modal_data": {"image": images}},
                             {"prompt": text, "multi_modal_data": {"image": other}}],
                            params, use_tqdm=False)
    return path, hf, outs, images


@torch.no_grad()
def _hf_logprobs(hf, ids: list[int], images=None) -> torch.Tensor:
    from vllm_hybridcache.flash_next.vision_model import image_settings
    from vllm_hybridcache.flash_next.vision_processor import process_images

    t = torch.tensor([ids])
    kw = {}
    if images:
        pv, grid = process_images(images, image_settings(hf.config))
        kw = dict(pixel_values=torch.from_numpy(pv), image_grid_thw=torch.from_numpy(grid),
                  mm_token_type_ids=(t == hf.config.image_token_id).int())
    return torch.log_softmax(hf(input_ids=t, **kw).logits[0].float(), -1)


def test_text_path_matches_transformers(vl):
    _, hf, outs, _ = vl
    ref = _hf_logprobs(hf, list(outs[0].prompt_token_ids))
    mean, worst, _ = logprob_distance(outs[0], ref)
    assert mean < MEAN_TOL and worst < MAX_TOL, (mean, worst)


def test_image_prompt_matches_transformers(vl):
    _, hf, outs, images = vl
    ids = list(outs[1].prompt_token_ids)
    pad = hf.config.image_token_id
    assert ids.count(pad) == 40 + 12  # 16x10 and 6x8 patches, 2x2 merged
    assert len(ids) > 96  # prefilled in several steps, the cut inside an image
    ref = _hf_logprobs(hf, ids, images)
    mean, worst, n = logprob_distance(outs[1], ref)
    assert mean < MEAN_TOL and worst < MAX_TOL, (mean, worst, n)
    # negative control: the other first image is a different prompt to transformers ...
    mean_other, _, _ = logprob_distance(outs[2], ref)
    assert mean_other > 100 * MEAN_TOL, mean_other
    # ... and vLLM's answer for it matches transformers fed that image
    other = [_hf_logprobs(hf, list(outs[2].prompt_token_ids), [_image(256, 160, 3), images[1]])]
    mean2, worst2, _ = logprob_distance(outs[2], other[0])
    assert mean2 < MEAN_TOL and worst2 < MAX_TOL, (mean2, worst2)
