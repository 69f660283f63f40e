"""Scoring of echoed prompts: each prompt token's log-probability (and its most likely alternatives)
for ``/v1/completions`` with ``echo`` and ``logprobs``, as lm-eval's log-likelihood requests need.

Scoring is a forward pass of the prompt (``LanguageModel.score``) with no decode loop, so it does not
go through the generation worker: it runs on a thread of its own, one batch at a time, beside it.
The parameters are only read, and linen's axis rules and JAX's mesh are per thread, so the two
threads do not disturb each other. A prompt for an adapter is scored with it, from the server's
adapter bank, as generation applies it.

With the prefix cache (:mod:`gptj_flax.sampling.score_cache`), a prompt for the base model that
starts with the same full pages as an earlier one (lm-eval's choices after one context) runs only
the rest. Prompts for adapters never use it, so no prompt's scores come from another adapter's.
A scored prompt's inputs (every token but the last) count in the prompt-token metrics, and those
run through the model in the prefilled ones.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Sequence

from gptj_flax.sampling.adapter_bank import AdapterBank
from gptj_flax.sampling.api import Completion, Scored
from gptj_flax.sampling.prefix_cache import PromptCounts
from gptj_flax.sampling.stopping import TextTracker
from gptj_flax.serving.metrics import Metrics
from gptj_flax.serving.worker import QueueFull

# Scored after a prompt to read the distribution that follows it; its own score is dropped.
PLACEHOLDER = 0


class PromptScorer:
    """Scores prompts on its own thread; at most ``max_rows`` prompts wait or run at once.
    ``adapters``: the server's bank of adapters, which :meth:`score`'s ``adapter`` names one of. With
    ``prefix_cache``, a cache of :meth:`LanguageModel.score_cache` serves the base model's prompts'
    shared full pages."""

    def __init__(
        self, model, max_rows: int, metrics: Metrics, adapters: AdapterBank | None = None, prefix_cache: bool = True
    ):
        self.model, self.max_rows, self.metrics, self.adapters = model, max_rows, metrics, adapters
        self.cache = model.score_cache() if prefix_cache else None
        metrics.scoring_cache_pages.set_function(lambda: 0 if self.cache is None else self.cache.pages)
        self.counts = PromptCounts()  # scored prompts' inputs, and those run through the model
        self._pending = 0  # touched on the event loop only
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gptj-scorer")

    async def score(self, prompts: Sequence[Sequence[int]], top_logprobs: int, adapter: str | None = None) -> list:
        """Each prompt's ``Scored`` (``None`` for a one-token prompt: nothing to score it after)
        under the adapter named ``adapter`` (None: the base); raises :class:`QueueFull` when
        ``max_rows`` prompts are already being scored."""
        if self._pending + len(prompts) > self.max_rows:
            raise QueueFull(1)
        scorable = [list(p) for p in prompts if len(p) >= 2]
        if not scorable:
            return [None] * len(prompts)
        self._pending += len(prompts)
        try:
            scored = iter(
                await asyncio.get_running_loop().run_in_executor(
                    self._executor, lambda: self._score(scorable, top_logprobs, adapter)
                )
            )
        finally:
            self._pending -= len(prompts)
        return [next(scored) if len(p) >= 2 else None for p in prompts]

    def _score(self, prompts: list[list[int]], top_logprobs: int, adapter: str | None) -> list:
        """Score on the scorer's thread, and count the prompt tokens."""
        cached = self.cache is not None and adapter is None
        before = self._cache_counts()
        scored = self.model.score(
            prompts, top_logprobs=top_logprobs, adapter=adapter, adapters=self.adapters, cache=self.cache
        )
        after = self._cache_counts()
        inputs = sum(len(p) - 1 for p in prompts)
        prefilled = after.prefilled - before.prefilled if cached else inputs
        self.counts = PromptCounts(self.counts.prompt + inputs, self.counts.prefilled + prefilled)
        self.metrics.prompt_tokens.inc(inputs)
        self.metrics.prefilled_tokens.inc(prefilled)
        return scored

    def _cache_counts(self) -> PromptCounts:
        return PromptCounts() if self.cache is None else dataclasses.replace(self.cache.counts)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def next_token(scored: Scored, top_logprobs: int, eos_id: int | None, tokenizer) -> tuple[Scored | None, Completion]:
    """Split a prompt scored with :data:`PLACEHOLDER` after it (and at least one alternative per
    position) into the prompt's own scores (``None`` for a one-token prompt) and the one token that
    greedy generation gives after it: the most likely one there, with its log-probability and, where
    ``top_logprobs`` > 0, that position's alternatives, as the decode slots report them."""
    prompt, tops = scored.tokens[:-1], scored.top_logprobs
    assert tops, "score the prompt with at least one alternative per position"
    after = tops[-1]
    token, logprob = next(iter(after.items()))  # the most likely comes first
    own = Scored(prompt, scored.logprobs[:-1], tops[:-1] if top_logprobs > 0 else None) if len(prompt) >= 2 else None
    eos = token == eos_id
    text = None
    if tokenizer is not None:
        tracker = TextTracker(tokenizer)
        tracker.update([] if eos else [token], final=True)  # generation's text leaves the EOS out
        text = tracker.text
    completion = Completion(
        text=text,
        finish_reason="eos" if eos else "length",
        prompt_tokens=len(prompt),
        completion_tokens=1,
        tokens=[token],
        logprobs=[logprob],
        top_logprobs=[after] if top_logprobs > 0 else None,
    )
    return own, completion
