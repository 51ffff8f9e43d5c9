"""Faust stream processors: trajectory builders, reward join, GRPO group assembly."""
