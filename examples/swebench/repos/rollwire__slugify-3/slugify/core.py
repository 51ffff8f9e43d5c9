"""Turning a title into a URL slug: lowercase ASCII words joined by hyphens."""

import re

_WORD = re.compile(r"[A-Za-z0-9]+")


def slugify(title):
    """The slug of ``title``: its ASCII letters and digits, word by word, joined by '-'."""
    words = _WORD.findall(title)
    return "-".join(words)
