"""The gateway proxy: provider detection, normalization, upstream engines, completion events."""
