"""Turning titles into URL slugs."""

import re


def slugify(title: str) -> str:
    """Lower-case words of the title joined by single hyphens, without punctuation."""
    words = re.findall(r"[A-Za-z0-9]+", title)
    return "-".join(words)
