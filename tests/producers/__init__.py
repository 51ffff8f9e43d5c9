"""Tests of the producers: rollout server, gateway nodes, runtimes, harness adapters."""
