"""Sampling: ``load`` a model, then generate, stream and score with a :class:`LanguageModel`."""

from gptj_flax.sampling.api import (
    CheckedSettings,
    Completion,
    LanguageModel,
    MissingTokenizer,
    Scored,
    TextStream,
    check_settings,
    check_text,
)
from gptj_flax.sampling.loading import load
from gptj_flax.sampling.samplers import SamplingError, SamplingParams

__all__ = [
    "CheckedSettings",
    "Completion",
    "LanguageModel",
    "MissingTokenizer",
    "SamplingError",
    "SamplingParams",
    "Scored",
    "TextStream",
    "check_settings",
    "check_text",
    "load",
]
