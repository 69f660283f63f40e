"""Scoring of echoed prompts: each prompt token's log-probability (and its most likely alternatives)
for ``/v1/completions`` with ``echo`` and ``logprobs``, as lm-eval's log-likelihood requests need.

Scoring is one forward pass of the whole prompt (``LanguageModel.score``), with no cache and no
decode loop, so it does not go through the generation worker: it runs on a thread of its own, one
batch at a time, beside it. The parameters are only read, and linen's axis rules and JAX's mesh
are per thread, so the two threads do not disturb each other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence

from gptj_flax.serving.worker import QueueFull


class PromptScorer:
    """Scores prompts on its own thread; at most ``max_rows`` prompts wait or run at once."""

    def __init__(self, model, max_rows: int):
        self.model, self.max_rows = model, max_rows
        self._pending = 0  # touched on the event loop only
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gptj-scorer")

    async def score(self, prompts: Sequence[Sequence[int]], top_logprobs: int) -> list:
        """Each prompt's ``Scored`` (``None`` for a one-token prompt: nothing to score it after);
        raises :class:`QueueFull` when ``max_rows`` prompts are already being scored."""
        if self._pending + len(prompts) > self.max_rows:
            raise QueueFull(1)
        scorable = [list(p) for p in prompts if len(p) >= 2]
        if not scorable:
            return [None] * len(prompts)
        self._pending += len(prompts)
        try:
            scored = iter(
                await asyncio.get_running_loop().run_in_executor(
                    self._executor, lambda: self.model.score(scorable, top_logprobs=top_logprobs)
                )
            )
        finally:
            self._pending -= len(prompts)
        return [next(scored) if len(p) >= 2 else None for p in prompts]

    def close(self) -> None:
        self._executor.shutdown(wait=True)
