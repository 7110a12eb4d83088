"""The link format: one committed link as a self-contained, authenticated file or payload.

Shared by the disk tier (files in a folder, core/disk/) and the cluster tier (payloads moved
between replicas, core/tiers/cluster.py): `linkfile` writes and verifies one link (header with
fingerprint, domain, digests, token ids, shard tag; a CRC-32 per part; MACs keyed by the
secret), `job` is what a tier hands a writer, `tags` encodes a link's draft tag into its
header, `shard` names a tensor parallel rank's file of a link, `safeio` opens files below a
folder without following links, and `reader` (with `direct`, `inplace`, `hugepages`) stages a
chain of link files into the RAM store, every part checked. Pure (no vLLM).
"""

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
    "LinkFileError",
    "LinkFileHeader",
    "LinkFileProblem",
    "read_header",
    "read_parts",
    "write_link_file",
]
