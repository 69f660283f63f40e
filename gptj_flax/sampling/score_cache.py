"""A prefix cache for scoring: prompts that start with the same full pages of tokens score only
what follows them.

Scoring a prompt gives each token's log-probability after the tokens before it (and, if asked, the
most likely alternatives there). For a full page of the prompt's inputs (every token but the last),
named by the hash chain of :func:`gptj_flax.sampling.prefix_cache.page_keys`, both its keys and
values and the scores of the targets in it (the page shifted by one token) depend only on the tokens
up to the page's end. So the cache keeps, per page, its keys and values and those scores, on the
host. A prompt whose first ``m`` pages are cached runs only its tokens from the last cached one on
(that token again, so that the first new target is scored: the kept keys and values serve as the
past), and takes the scores before it from the cache; the new full pages it runs are kept in turn.

The cache is bounded in pages, the least recently used going first. It keeps float keys and values
whatever ``kv_cache`` the model serves with, so a cached score equals the full pass's.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from gptj_flax.sampling.decoding import Decoder
from gptj_flax.sampling.prefix_cache import PromptCounts, page_keys
from gptj_flax.sampling.samplers import top_bucket

SCORE_PAGE = 64  # tokens per cached page: lm-eval's shared contexts are often a few hundred tokens
DEFAULT_BYTES = 2**30  # host memory for the cached keys and values


class CachedPage(NamedTuple):
    """One full page of a scored prompt's inputs: per layer its keys [heads, head_dim, page] and
    values [heads, page, head_dim], and the scores of the targets one token on (each ``page`` long)."""

    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]
    logprobs: np.ndarray
    top_ids: np.ndarray  # [page, width]
    top_logprobs: np.ndarray


def page_bytes(decoder: Decoder, page: int) -> int:
    """Host bytes of one cached page's keys and values."""
    cfg = decoder.config
    return page * cfg.n_layers * 2 * cfg.n_heads * cfg.head_dim * np.dtype(cfg.compute_dtype).itemsize


def sized(decoder: Decoder, max_bytes: int = DEFAULT_BYTES) -> ScoreCache:
    """A cache of pages of :data:`SCORE_PAGE` tokens (fewer in a short context, so that a context
    holds at least 8) whose keys and values take at most ``max_bytes`` (but at least one page)."""
    page = max(1, min(SCORE_PAGE, decoder.config.max_len // 8))
    return ScoreCache(decoder, max_pages=max(1, max_bytes // page_bytes(decoder, page)), page=page)


@dataclasses.dataclass
class ScoreCache:
    """Scores prompts as :meth:`Decoder.score_with_alternatives` does, reusing cached full pages."""

    decoder: Decoder
    max_pages: int
    page: int = SCORE_PAGE
    salt: bytes = b""
    counts: PromptCounts = dataclasses.field(default_factory=PromptCounts)

    def __post_init__(self):
        self._pages: collections.OrderedDict[bytes, CachedPage] = collections.OrderedDict()  # LRU first

    @property
    def pages(self) -> int:
        return len(self._pages)

    def score(self, sequences: Sequence[Sequence[int]], top_logprobs: int) -> list[tuple[np.ndarray, ...]]:
        """Per sequence ``(logprobs [L-1], top_ids [L-1, k], top_logprobs [L-1, k])``; each sequence
        has at least two tokens and fits the model's context."""
        self.decoder.check_scorable(sequences)
        return [self._score_one(list(seq), top_logprobs) for seq in sequences]

    def _match(self, keys: Sequence[bytes], width: int) -> list[CachedPage]:
        found = []
        for key in keys:
            page = self._pages.get(key)
            if page is None or page.top_ids.shape[1] < width:
                break
            self._pages.move_to_end(key)
            found.append(page)
        return found

    def _score_one(self, seq: list[int], k: int) -> tuple[np.ndarray, ...]:
        width = top_bucket(k)
        keys = page_keys(seq[:-1], self.page, self.salt)
        cached = self._match(keys, width)
        start = max(len(cached) * self.page - 1, 0)  # the last cached token runs again: it scores the next
        out = self.decoder.score_after(self._past(cached, start), seq[start:], start, width)
        self.counts.prompt += len(seq) - 1
        self.counts.prefilled += len(seq) - 1 - start

        def joined(field: str) -> np.ndarray:
            """The cached pages' rows then the run's, from the prompt's second token on (a page's rows
            start at its first token; the run's at the token after ``start``)."""
            new = getattr(out, field)
            if not cached:
                return new
            return np.concatenate(
                [*(getattr(p, field)[:, :width] if new.ndim > 1 else getattr(p, field) for p in cached), new]
            )[1:]

        logprobs, ids, lps = joined("logprobs"), joined("top_ids"), joined("top_logprobs")
        self._keep(keys, len(cached), start, out, np.concatenate([[0.0], logprobs]), ids, lps)
        return logprobs, ids[:, :k], lps[:, :k]

    def _past(self, cached: list[CachedPage], length: int) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        """Per layer the keys and values of the first ``length`` tokens, from the cached pages."""
        if not cached:
            return (), ()
        layers = range(len(cached[0].k))
        k = tuple(np.concatenate([p.k[i] for p in cached], axis=-1)[..., :length] for i in layers)
        v = tuple(np.concatenate([p.v[i] for p in cached], axis=-2)[:, :length] for i in layers)
        return k, v

    def _keep(self, keys, first: int, start: int, out, logprobs, ids, lps) -> None:
        """Keep the new full pages (from ``first`` on) of a prompt that ran from token ``start``.
        ``logprobs`` has a 0 for the first token, so its row j scores token j; ``ids`` and ``lps``
        are one row behind (row j predicts token j + 1)."""
        n = self.page
        pad_ids = np.concatenate([np.zeros_like(ids[:1]), ids])
        pad_lps = np.concatenate([np.zeros_like(lps[:1]), lps])
        for i in range(first, len(keys)):
            lo, hi = i * n - start, (i + 1) * n - start  # the page's slots in the run's output
            self._pages[keys[i]] = CachedPage(
                k=tuple(x[..., lo:hi] for x in out.k),
                v=tuple(x[:, lo:hi] for x in out.v),
                logprobs=logprobs[i * n : (i + 1) * n].copy(),
                top_ids=pad_ids[i * n : (i + 1) * n].copy(),
                top_logprobs=pad_lps[i * n : (i + 1) * n].copy(),
            )
            self._pages.move_to_end(keys[i])
        while len(self._pages) > self.max_pages:
            self._pages.popitem(last=False)
