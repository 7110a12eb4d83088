"""Embedded tiny models: random-weight checkpoints the package writes itself (no model hub)."""

from vllm_hybridcache.models.build import ensure_model, model_dir, model_names
from vllm_hybridcache.models.store import ModelStoreError

__all__ = ["ModelStoreError", "ensure_model", "model_dir", "model_names"]
