"""The disk tier's storage: the directory of link files one engine fingerprint owns on a folder
that several engines may share (naming, chain lookup, eviction, sweeps), its writer thread,
admission, read cost, session spill and the per-rank sets of a tensor parallel engine.

The file format itself (one self-contained, authenticated file per link, and the reader that
stages a chain of them into the RAM store) is core/linkformat/, which the cluster tier uses for
its payloads too. Pure (no vLLM).
"""

from .directory import DirectoryStats, DiskLink, LinkDirectory

__all__ = ["DirectoryStats", "DiskLink", "LinkDirectory"]
