"""Scoring of echoed prompts: each prompt token's log-probability (and its most likely alternatives)
for ``/v1/completions`` with ``echo`` and ``logprobs``, as lm-eval's log-likelihood requests need.

Scoring is one forward pass of the whole prompt (``LanguageModel.score``), with no cache and no
decode loop, so it does not go through the generation worker: it runs on a thread of its own, one
batch at a time, beside it. The parameters are only read, and linen's axis rules and JAX's mesh
are per thread, so the two threads do not disturb each other. A prompt for an adapter is scored
with it, from the server's adapter bank, as generation applies it; with no cache, no prompt's
scores come from another adapter's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence

from gptj_flax.sampling.adapter_bank import AdapterBank
from gptj_flax.serving.worker import QueueFull


class PromptScorer:
    """Scores prompts on its own thread; at most ``max_rows`` prompts wait or run at once.
    ``adapters``: the server's bank of adapters, which :meth:`score`'s ``adapter`` names one of."""

    def __init__(self, model, max_rows: int, adapters: AdapterBank | None = None):
        self.model, self.max_rows, self.adapters = model, max_rows, adapters
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
                    self._executor,
                    lambda: self.model.score(
                        scorable, top_logprobs=top_logprobs, adapter=adapter, adapters=self.adapters
                    ),
                )
            )
        finally:
            self._pending -= len(prompts)
        return [next(scored) if len(p) >= 2 else None for p in prompts]

    def close(self) -> None:
        self._executor.shutdown(wait=True)
