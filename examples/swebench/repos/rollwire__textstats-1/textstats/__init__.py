"""Small statistics over plain text."""

from textstats.words import line_count, word_count

__all__ = ["line_count", "word_count"]
