"""The tests' servers on real loopback sockets: the same helpers the benchmarks use (``bench/serving.py``)."""

from bench.serving import free_port, serve

__all__ = ["free_port", "serve"]
