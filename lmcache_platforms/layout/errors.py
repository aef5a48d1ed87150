"""The one exception the layout package raises, so callers can tell a bad layout from a bug."""

from __future__ import annotations


class LayoutError(ValueError):
    """A KV layout, layout file or slot request that cannot be served; the message names what and where."""
