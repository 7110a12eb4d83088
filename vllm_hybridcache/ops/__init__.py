"""Copy kernels of the snapshot cache (csrc/ builds, a Triton twin) and the choice between them.

``segments`` turns block and slot copies into a segment table, ``copy_select`` picks the backend
for the platform (``VLLM_HYBRIDCACHE_COPY_BACKEND`` forces one), ``link_copy`` runs a whole link
in one launch, ``csrc_build`` compiles csrc/ (the CPU twin, the torch GPU extension, the AMD
code objects CI inspects), ``codeobj`` reads those code objects, ``triton_copy`` is the Triton
kernel over the same table and ``selfcheck`` checks and times every backend on a device.
"""
