"""Closed integer intervals, written as (start, end) tuples with start <= end."""

from intervals.ops import length, overlaps

__all__ = ["length", "overlaps"]
