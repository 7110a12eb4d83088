"""Flash-Next (HF `qwen4_exp`) as a vLLM model: layers, kernel backends, registration."""
