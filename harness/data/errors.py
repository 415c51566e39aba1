"""The exception type of harness.data, and its warning."""

from __future__ import annotations


class DataError(ValueError):
    """A data problem, phrased for the user: it names the file, field or config key and what is allowed."""


class DataWarning(UserWarning):
    """Data that is used, but not all of it: e.g. rows of a .jsonl without the text field, which are dropped."""
