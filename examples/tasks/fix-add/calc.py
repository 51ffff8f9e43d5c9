"""A tiny calculator."""


def add(a: int, b: int) -> int:
    """The sum of a and b."""
    return a - b


def multiply(a: int, b: int) -> int:
    """The product of a and b."""
    return a * b
