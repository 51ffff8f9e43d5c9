"""Producers: the rollout server, gateway nodes, runtimes and harness adapters."""
