"""Operations on closed intervals (start, end): both ends belong to the interval."""


def length(interval):
    """How many integers the closed interval holds."""
    start, end = interval
    return end - start + 1


def overlaps(a, b):
    """Whether the closed intervals ``a`` and ``b`` share at least one point."""
    return a[0] < b[1] and b[0] < a[1]
