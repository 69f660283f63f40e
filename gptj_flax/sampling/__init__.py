"""Sampling: ``load`` a model, then generate, stream and score with a :class:`LanguageModel`."""

from gptj_flax.sampling.api import Completion, LanguageModel, Scored, TextStream
from gptj_flax.sampling.decoding import Decoder
from gptj_flax.sampling.loading import load
from gptj_flax.sampling.samplers import SamplingError, SamplingParams

__all__ = ["Completion", "Decoder", "LanguageModel", "SamplingError", "SamplingParams", "Scored", "TextStream", "load"]
