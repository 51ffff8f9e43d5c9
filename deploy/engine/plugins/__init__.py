"""Modules the embedded vLLM server imports by name (this directory is on its ``PYTHONPATH``).

They run inside vLLM's own environment (torch, vllm), never in the project's: import them only there.
``rollwire_forced_tokens``: a logits processor that makes a request sample exactly the token ids it
names (``vllm_xargs: {"rollwire_forced_tokens": [id, ...]}``), how tests script a model's turns.
"""

FORCED_TOKENS_ARG = "rollwire_forced_tokens"  # the same key as in rollwire_forced_tokens.py
FORCED_TOKENS_PROCESSOR = "rollwire_forced_tokens:ForcedTokensLogitsProcessor"  # vLLM's --logits-processors
