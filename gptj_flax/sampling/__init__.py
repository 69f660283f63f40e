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
from gptj_flax.sampling.samplers import Sampling, SamplingError, SamplingParams

__all__ = [
    "CheckedSettings",
    "Completion",
    "LanguageModel",
    "MissingTokenizer",
    "Sampling",
    "SamplingError",
    "SamplingParams",
    "Scored",
    "TextStream",
    "check_settings",
    "check_text",
    "load",
]
