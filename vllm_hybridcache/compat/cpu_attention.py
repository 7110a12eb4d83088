"""vLLM's CPU attention computed by our split-invariant kernel (ops/cpu_attention.py).

Why a bend: fine segmentation of vLLM's Qwen3-Next on CPU needs each query's attention output
to be the same whatever prefill step computes it, and vLLM 0.32's CPU attention blocks a
query's reductions by the step (docs/split-invariance.md). vLLM has no extension point for a
plugin's attention kernel on its CPU backend, so two of its methods are wrapped:

- `CPUAttentionMetadataBuilder.__init__` (start-up, once per attention group): where
  `split_attention_plan` says the engine runs the kernel, every decoder layer of the group is
  marked for it after checking that the kernel computes exactly what vLLM's op would be asked
  (vLLM's `vec` layout, no window, ALiBi, soft cap or sinks); a group it cannot serve in such
  an engine stops the start-up with the reason (a silent fallback would make fine links
  inexact).
- `CPUAttentionBackendImpl.forward`: a marked layer's causal attention runs the kernel over
  the same KV cache views and metadata; every other layer runs vLLM's forward unchanged.

The KV cache writes (`do_kv_cache_update`) and the metadata stay vLLM's.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_hybridcache.compat.cpu_kernels import CPU_GDN_INNER_MODELS
from vllm_hybridcache.compat.registry import checked
from vllm_hybridcache.config import (
    CPU_ATTN_AUTO,
    CPU_ATTN_KERNEL,
    CPU_ATTN_SPLIT_INVARIANT_ENV,
    connector_cache_off,
    cpu_attention_setting,
)

logger = logging.getLogger("vllm_hybridcache")

MARK = "_hybridcache_split_attention"


@checked("0.32.0", "0.33.0")
def split_attention_plan(vllm_config: Any) -> tuple[bool, str]:
    """(whether this engine's vLLM attention layers run the split-invariant kernel, why).

    Yes when the setting allows it (`auto`, the default, in an engine that runs the plugin's
    connector with the cache on, so that installing the package, or turning the cache off,
    changes nothing an engine without it computes;
    `kernel`, in any engine), on vLLM's CPU platform,
    for a model whose whole forward is otherwise split-invariant (`CPU_GDN_INNER_MODELS`),
    where vLLM would lay its KV cache out for its `vec` kernel (no AMX for bf16: vLLM's AMX
    layout is packed for its tiles) and the kernel takes the dtype, head size, block size and
    KV cache dtype, and where the kernel builds on this host. The same answer in every process
    of an engine: it reads only the engine's config, the setting and the host."""
    setting = cpu_attention_setting()
    if setting not in (CPU_ATTN_AUTO, CPU_ATTN_KERNEL):
        return False, f"{CPU_ATTN_SPLIT_INVARIANT_ENV}={setting}"
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as e:
        return False, f"vLLM's CPU attention is not importable ({e})"
    if not current_platform.is_cpu():
        return False, "not vLLM's CPU platform"
    if setting == CPU_ATTN_AUTO and (off := connector_cache_off(vllm_config)):
        return False, off  # off means off: the engine computes as without the plugin
    mc = getattr(vllm_config, "model_config", None)
    cc = getattr(vllm_config, "cache_config", None)
    if mc is None or cc is None:
        return False, "no model or cache config"
    try:
        cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    except Exception as e:
        return False, f"model class not resolved ({type(e).__name__})"
    if cls.__name__ not in CPU_GDN_INNER_MODELS:
        return False, f"{cls.__name__}'s forward is not known to be split-invariant on CPU"
    from vllm_hybridcache.ops import cpu_attention

    head, block, kv_dtype = mc.get_head_size(), cc.block_size, cc.cache_dtype
    why = cpu_attention.supports(mc.dtype, head, block or 0, kv_dtype)
    if why:
        return False, f"the kernel does not take {why}"
    try:
        isa = _get_attn_isa(mc.dtype, block, head, kv_dtype)
    except Exception as e:
        return False, f"vLLM's CPU attention ISA not resolved ({e})"
    if isa != "vec":
        return False, f"vLLM's CPU attention runs its `{isa}` kernel here (the kernel reads `vec`)"
    if not cpu_attention.available():
        return False, "the kernel did not build on this host (see the warning above)"
    return True, "vLLM's CPU attention computed by the split-invariant kernel"


def _unsupported(impl: Any) -> str:
    """'' when the kernel computes what vLLM's op computes for this layer, else why not."""
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi"
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    if getattr(impl, "logits_soft_cap", 0):
        return "a logits soft cap"
    if getattr(impl, "sliding_window", -1) not in (-1, None):
        return "a sliding window"
    return ""


@checked("0.32.0", "0.33.0")
def install_split_invariant_cpu_attention(builder_cls: Any = None, impl_cls: Any = None) -> bool:
    """Wrap vLLM's CPU attention builder and forward (module docstring); False when already
    wrapped. `builder_cls` / `impl_cls`: subclasses in tests."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends import cpu_attn

    builder = builder_cls or cpu_attn.CPUAttentionMetadataBuilder
    impl = impl_cls or cpu_attn.CPUAttentionBackendImpl
    if getattr(impl.forward, "_hybridcache_split", False):
        return False
    init, forward = builder.__init__, impl.forward

    def builder_init(self: Any, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                     device: Any) -> None:
        init(self, kv_cache_spec, layer_names, vllm_config, device)
        if self.is_cross_attention or self.is_encoder_only_attention:
            return
        use, why = split_attention_plan(vllm_config)
        if not use:
            if cpu_attention_setting() == CPU_ATTN_KERNEL:
                raise RuntimeError(f"{CPU_ATTN_SPLIT_INVARIANT_ENV}=kernel, but {why}")
            return
        from vllm.model_executor.layers.attention import Attention

        from vllm_hybridcache.ops import cpu_attention

        problem = "" if self.isa == "vec" else f"vLLM chose its `{self.isa}` kernel"
        problem = problem or cpu_attention.supports(self.dtype, self.head_dim, self.block_size,
                                                    self.kv_cache_dtype)
        layers = cpu_attn.get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        for name, layer in layers.items():
            if layer.impl.attn_type != AttentionType.DECODER:
                continue
            problem = problem or _unsupported(layer.impl)
            if problem:
                raise RuntimeError(
                    f"hybridcache: layer {name} cannot run the split-invariant CPU attention "
                    f"({problem}) although the engine's plan says it does; set "
                    f"{CPU_ATTN_SPLIT_INVARIANT_ENV}=0 to serve with vLLM's attention")
            setattr(layer, MARK, True)

    def split_forward(self: Any, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                      attn_metadata: Any, output: Any, output_scale: Any = None,
                      output_block_scale: Any = None) -> Any:
        if (attn_metadata is None or not getattr(layer, MARK, False)
                or output_scale is not None or output_block_scale is not None):
            return forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                           output_scale, output_block_scale)
        if attn_metadata.causal is not True or attn_metadata.dynamic_causal is not None:
            raise RuntimeError("hybridcache: a decoder layer marked for the split-invariant "
                               "CPU attention got non-causal metadata")
        from vllm_hybridcache.ops.cpu_attention import split_invariant_attention

        n = attn_metadata.num_actual_tokens
        blocks, kv_heads, block_size, _ = kv_cache.size()
        key_cache, value_cache = kv_cache.view(
            (blocks, kv_heads, block_size * 2, -1)).chunk(2, dim=2)
        split_invariant_attention(query[:n], key_cache, value_cache, output[:n],
                                  attn_metadata.query_start_loc, attn_metadata.seq_lens,
                                  attn_metadata.block_table, self.scale)
        return output

    builder_init._hybridcache_split = True  # type: ignore[attr-defined]
    split_forward._hybridcache_split = True  # type: ignore[attr-defined]
    split_forward._hybridcache_original = forward  # type: ignore[attr-defined]
    builder.__init__ = builder_init
    impl.forward = split_forward
    return True
