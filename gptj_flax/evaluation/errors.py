"""The error of the evaluation package."""

from __future__ import annotations

from gptj_flax.errors import GptjFlaxError


class EvaluationError(GptjFlaxError, ValueError):
    """An evaluation input (a results file, a task name) is missing or malformed; the message names it."""
