"""Storage for the disk tier: the link file format and the directory of link files.

`linkfile` writes and verifies one link as a self-contained file; `directory` manages the files
of one engine fingerprint on a directory that several engines may share (naming, chain lookup,
eviction, sweeps). Both are pure (no vLLM) and single-threaded.
"""

from .directory import DirectoryStats, DiskLink, LinkDirectory
from .linkfile import (
    FORMAT_VERSION,
    LinkFileError,
    LinkFileHeader,
    LinkFileProblem,
    read_header,
    read_parts,
    write_link_file,
)

__all__ = [
    "FORMAT_VERSION",
    "DirectoryStats",
    "DiskLink",
    "LinkDirectory",
    "LinkFileError",
    "LinkFileHeader",
    "LinkFileProblem",
    "read_header",
    "read_parts",
    "write_link_file",
]
