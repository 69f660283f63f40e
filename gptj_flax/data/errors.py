"""The errors and warnings of the data pipeline."""

from __future__ import annotations

from gptj_flax.errors import GptjFlaxError


class DataError(GptjFlaxError, ValueError):
    """Input data is missing, malformed or inconsistent.

    Messages name the file (and the record or line) at fault, so a user can find it without a
    debugger.
    """


class DataWarning(UserWarning):
    """The input is usable but probably not what the user meant (e.g. a corpus under one sequence)."""
