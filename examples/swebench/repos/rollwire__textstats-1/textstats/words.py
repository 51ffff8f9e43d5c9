"""Counting words and lines."""


def word_count(text):
    """The number of words in ``text``: runs of characters between whitespace."""
    return len(text.split(" "))


def line_count(text):
    """The number of lines in ``text``; a final newline does not start another line."""
    return len(text.splitlines())
