"""vllm-hybridcache: make hybrid (Gated DeltaNet + attention) models cheap to serve to agents.

The package is a vLLM plugin. Importing it is cheap and imports no vLLM; the plugin entry point
(`vllm_hybridcache.plugin:register`) does the registrations.
"""

__version__ = "0.1.0"
