"""Triton kernels for Flash-Next (ROCm RDNA3.5/RDNA4 first; the same kernels run on CUDA).

Modules: ``conv`` (GDN causal conv and PLE dilated conv), ``gdn`` (chunked prefill, recurrent
step), ``indexer`` (QSA pooling, scoring, top-k), ``sparse_attn`` (attention over the
selection, packed or paged K/V), ``launch`` (launch parameters per architecture), ``backend``
(``TritonBackend``, the ``FlashNextOps`` implementation) and ``select`` (which backend a
platform uses).

Kernel modules are imported lazily: ``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is
defined, so importing this package (e.g. from ``select``) must not define kernels before a
test has switched the interpreter on.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TritonBackend", "TritonOps"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import backend

        return getattr(backend, name)
    raise AttributeError(name)
