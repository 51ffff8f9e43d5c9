"""Benchmarks: each prints its figures as name=value lines, the key figure last."""
