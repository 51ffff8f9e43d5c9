"""The embedded default engine: the real vLLM CPU build serving a tiny Qwen3 model built locally."""
