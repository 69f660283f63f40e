"""The scoring prefix cache: prompts sharing full pages with earlier ones score only the rest, and
every log-probability and top alternative equals the uncached full pass (``LanguageModel.score``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptj_flax.model import GPTJ
from gptj_flax.sampling import LanguageModel
from gptj_flax.sampling.samplers import SamplingError
from gptj_flax.sampling.score_cache import ScoreCache, page_bytes
from tests.helpers import tiny_config

CFG = tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=96, max_len=128, scan_layers=False)


@pytest.fixture(scope="module")
def lm():
    return LanguageModel(CFG, GPTJ(CFG).init(jax.random.key(5), jnp.zeros((1, 4), jnp.int32))["params"])


def _same(cached, reference, k):
    lp, ids, lps = cached
    np.testing.assert_allclose(lp, reference.logprobs, rtol=0, atol=1e-5)
    if k:
        assert [list(row) for row in ids] == [list(d) for d in reference.top_logprobs]
        np.testing.assert_allclose(lps, [list(d.values()) for d in reference.top_logprobs], rtol=0, atol=1e-5)


def test_choices_after_a_shared_context_score_as_the_full_pass_with_fewer_tokens_run(lm):
    rng = np.random.default_rng(0)
    context = rng.integers(1, 96, 45).tolist()  # 5 full pages of 8 and a partial one
    choices = [rng.integers(1, 96, n).tolist() for n in (1, 3, 7, 12)]
    prompts = [context + c for c in choices]
    cache = ScoreCache(lm.decoder, max_pages=64, page=8)
    for k in (0, 3):
        got = cache.score(prompts, k)
        for prompt, scored in zip(prompts, got):
            _same(scored, lm.score(prompt, top_logprobs=k), k)
    # the first prompt ran whole; each later one from the last cached token of the context's 5 pages
    # (or of its own sixth, for the longest); the second round with k=3 ran from there too
    inputs = sum(len(p) - 1 for p in prompts)
    assert cache.counts.prompt == 2 * inputs
    assert cache.counts.prefilled < 0.5 * cache.counts.prompt


def test_a_prompt_that_ends_in_a_cached_page_and_an_int8_model_still_score_exactly(lm):
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 96, 33).tolist()  # inputs: exactly 4 full pages
    int8 = LanguageModel(dataclasses.replace(CFG, kv_cache="int8"), lm.decoder.params)
    cache = ScoreCache(int8.decoder, max_pages=64, page=8)
    for shorter in (prompt, prompt[:17], prompt[:9], prompt[:2]):
        _same(cache.score([shorter], 2)[0], lm.score(shorter, top_logprobs=2), 2)
    assert cache.counts.prefilled == 32 + 1 + 1 + 1


def test_the_least_recently_used_pages_go_beyond_the_bound(lm):
    rng = np.random.default_rng(2)
    a, b = (rng.integers(1, 96, 25).tolist() for _ in range(2))
    cache = ScoreCache(lm.decoder, max_pages=3, page=8)
    cache.score([a], 0)
    assert cache.pages == 3
    compiled = lm.decoder.compilations()
    cache.score([b], 0)
    assert cache.pages == 3
    assert lm.decoder.compilations() == compiled  # shapes are padded: a prompt like the last compiles nothing
    before = cache.counts.prefilled
    _same(cache.score([a], 0)[0], lm.score(a), 0)
    assert cache.counts.prefilled - before == 24  # a's pages were evicted: it ran whole again


def test_language_model_score_with_its_cache_sizes_pages_to_the_context_and_checks_prompts(lm):
    cache = lm.score_cache(max_bytes=10 * page_bytes(lm.decoder, 16))
    assert (cache.page, cache.max_pages) == (16, 10)  # a 128-token context holds 8 pages of 16
    rng = np.random.default_rng(3)
    context = rng.integers(1, 96, 40).tolist()
    prompts = [context + [5], context + [6, 7]]
    for got, expected in zip(lm.score(prompts, top_logprobs=2, cache=cache), lm.score(prompts, top_logprobs=2)):
        assert got.tokens == expected.tokens
        np.testing.assert_allclose(got.logprobs, expected.logprobs, rtol=0, atol=1e-5)
        assert [list(d) for d in got.top_logprobs] == [list(d) for d in expected.top_logprobs]
    assert cache.counts.prefilled == 40 + (41 - 31)
    with pytest.raises(SamplingError, match="sequence 1 has 1 token"):
        lm.score([[1, 2], [3]], cache=cache)
