"""Copy kernels of the snapshot cache (csrc/ builds, a Triton twin) and the choice between them.

``segments`` turns block copies into a segment table, ``copy_select`` picks the backend for the
platform (``VLLM_HYBRIDCACHE_COPY_BACKEND`` forces one), ``csrc_build`` compiles csrc/ (the CPU
twin, the torch GPU extension, the AMD code objects CI inspects) and ``triton_copy`` is the
Triton kernel over the same table.
"""
