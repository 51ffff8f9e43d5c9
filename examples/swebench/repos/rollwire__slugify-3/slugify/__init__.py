"""URL slugs from titles."""

from slugify.core import slugify

__all__ = ["slugify"]
