"""Where a remote lookup asks the directory for links: the segmentation's cuts, and on an engine
in fine segmentation every 64-aligned position too (links are captured there inside a step, and
a lookup that never asked for them would never find them). No Ray, no engine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from vllm_hybridcache.adapter.segmentation_mode import segmentation_mode
from vllm_hybridcache.cluster.engine import remote_cuts
from vllm_hybridcache.segmentation import Segmentation


def test_fine_engines_ask_for_every_64_aligned_position(monkeypatch, embedded_model):
    from vllm.config import ModelConfig

    from vllm_hybridcache.flash_next import registration
    from vllm_hybridcache.flash_next.ops.split_invariant import ENV_VAR

    registration.register()
    cfg = SimpleNamespace(model_config=ModelConfig(model=str(embedded_model("flash-next-tiny")),
                                                   max_model_len=512),
                          speculative_config=None)
    seg = Segmentation(grid=256)
    toks = np.arange(10, 610, dtype=np.int64)
    monkeypatch.setenv(ENV_VAR, "1")
    assert remote_cuts(segmentation_mode(cfg)[0], seg)(toks) == list(range(64, 577, 64))
    monkeypatch.setenv(ENV_VAR, "0")
    assert remote_cuts(segmentation_mode(cfg)[0], seg)(toks) == [256, 512]
