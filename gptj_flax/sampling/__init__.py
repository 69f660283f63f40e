"""Sampling: samplers, the KV-cache generation loop, stop handling, and ``load`` → generate/stream/score."""

from gptj_flax.sampling.api import Completion, LanguageModel, Scored, load
from gptj_flax.sampling.decoding import Decoder, DecodeRun, DecodeState, Progress, bucket
from gptj_flax.sampling.samplers import SamplingError, SamplingParams, next_tokens, warp
from gptj_flax.sampling.stopping import TextTracker

__all__ = [
    "Completion", "DecodeRun", "DecodeState", "Decoder", "LanguageModel", "Progress", "SamplingError",
    "SamplingParams", "Scored", "TextTracker", "bucket", "load", "next_tokens", "warp",
]
