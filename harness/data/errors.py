"""The one exception type of harness.data."""

from __future__ import annotations


class DataError(ValueError):
    """A data problem, phrased for the user: it names the file, field or config key and what is allowed."""
