"""The decode slots' prefix cache: hash-chain keys of full prompt pages, the page table keeping a
row's prompt pages cached after it ends, and least-recently-used eviction when the pool runs out
(host side); and, on the device, prompts that share cached pages come out token for token and
log-prob for log-prob as without the cache, with no program compiled after the warm-up."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptj_flax.model import GPTJ
from gptj_flax.sampling import LanguageModel
from gptj_flax.sampling.prefix_cache import PrefixCache, page_keys
from gptj_flax.sampling.samplers import SamplingParams
from gptj_flax.sampling.slots import PageTable, Request
from tests.helpers import tiny_config


def test_page_keys_chain_each_full_page_to_the_pages_before_it():
    a = page_keys(list(range(20)), 8)
    assert len(a) == 2  # the last 4 tokens are no full page
    assert page_keys(list(range(16)), 8) == a
    b = page_keys([*range(8), 99, *range(9, 16)], 8)
    assert b[0] == a[0] and b[1] != a[1]
    # the second page alone, after another first page, is another key: the chain names the prefix
    c = page_keys([*range(100, 108), *range(8, 16)], 8)
    assert c[1] != a[1]
    assert page_keys(list(range(16)), 8, salt=b"adapter")[0] != a[0]
    assert len(set(page_keys(list(range(8)) * 4, 8))) == 4  # equal pages at other depths differ


def test_match_takes_the_longest_cached_run_from_the_first_page():
    cache = PrefixCache(4)
    keys = cache.keys(list(range(16)))
    assert cache.add(keys[0], 7) and cache.add(keys[1], 3) and cache.add(keys[3], 5)
    assert not cache.add(keys[0], 9)  # cached already: the other page is no cached page
    assert cache.match(keys) == [7, 3]  # the third page is not cached: the fourth cannot be used
    assert cache.match(cache.keys([1, 2, 3, 4])) == []
    assert cache.pages == 3 and cache.idle == 0


def test_a_rows_prompt_pages_stay_cached_when_it_ends_and_are_evicted_least_recently_used_first():
    cache = PrefixCache(4)
    table = PageTable(rows=2, per_row=3, page=4, prefix=cache)  # 6 pages
    first, second = cache.keys(list(range(8))), cache.keys(list(range(50, 58)))
    table.start(0, 9, first)  # 9 slots: 3 pages, the first two of them full prompt pages
    table.start(1, 9, second)
    assert table.ids.tolist() == [[0, 1, 2], [3, 4, 5]] and cache.pages == 4
    table.free(0)
    table.free(1)
    assert sorted(table._free) == [2, 5] and cache.idle == 4  # the partial pages go back
    assert cache.match(first) == [0, 1]  # used again: the second prompt's pages are now the oldest
    table.start(0, 12)  # three pages: the two free ones, then the least recently used cached one
    assert table.ids[0].tolist() == [2, 5, 3]
    assert cache.match(second) == []  # its first page is gone, so its second cannot be found
    assert cache.match(first) == [0, 1]
    table.start(1, 9, first)  # evicts the rest; the row's new pages are cached in their place
    assert table.ids[1].tolist() == [4, 0, 1] and cache.match(first) == [4, 0]
    assert cache.pages == 2 and cache.idle == 0 and table.in_use == 6


def test_the_pool_never_runs_out_while_rows_hold_less_than_their_whole_length():
    rng = np.random.default_rng(0)
    cache = PrefixCache(4)
    table = PageTable(rows=4, per_row=4, page=4, prefix=cache)
    for _ in range(300):
        row = int(rng.integers(4))
        tokens = [int(t) for t in rng.integers(0, 3, int(rng.integers(1, 17)))]
        table.start(row, len(tokens), cache.keys(tokens))
        table.grow(row, int(rng.integers(0, 8)))
        held = table.ids[table.ids < table.pages]
        assert len(set(held.tolist())) == held.size  # no page in two rows
        assert held.size + cache.idle + len(table._free) == table.pages


CFG = tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=96, max_len=64, scan_layers=False)
PAGE, SLOTS, NEW = 8, 2, 4  # 2 rows of 64 slots: a pool of 16 pages


@pytest.fixture(scope="module")
def lm():
    lm = LanguageModel(CFG, GPTJ(CFG).init(jax.random.key(3), jnp.zeros((1, 4), jnp.int32))["params"])
    lm.decoder.page_columns = PAGE
    return lm


def _request(tokens, seed: int = 0) -> Request:
    return Request([int(t) for t in tokens], NEW, -1, seed, SamplingParams.build(1, temperature=0.0), want_top=True)


def _run(slots, batch: list[Request]) -> list:
    """Admit ``batch`` as the engine does (short prompts together, a long one alone, chunk by chunk),
    decode it to its end, free its rows: every row's tokens, log-probs and alternatives."""
    places = list(range(len(batch)))
    if all(slots.prompt_columns(len(r.tokens)) <= slots.chunk for r in batch):
        outs = [slots.admit(batch, places)]
    else:
        firsts = []
        for place, request in enumerate(batch):
            prefill = slots.start_prefill(request)
            while not prefill.done:
                slots.prefill_chunk(prefill)
            firsts.append(slots.insert(prefill, place))
        outs = [jax.tree.map(lambda *xs: np.concatenate(xs), *firsts)]
    for _ in range(NEW - 1):
        outs.append(slots.decode([], 1, highest=len(batch) - 1))
    slots.free(places)
    return [(o.tokens[: len(batch)], o.logprobs[: len(batch)], o.top_logprobs[: len(batch)]) for o in outs]


def _compiled(slots) -> dict[str, int]:
    """How many times each slot program has been compiled."""
    return {name: f._cache_size() for name, f in vars(slots.programs).items() if hasattr(f, "_cache_size")}


def test_prompts_sharing_cached_pages_come_out_as_without_the_cache(lm):
    rng = np.random.default_rng(1)
    shared = rng.integers(1, CFG.vocab_size, 24)  # three pages

    def tail(n):
        return rng.integers(1, CFG.vocab_size, n)

    batches = [
        [_request([*shared, *tail(5)]), _request([*shared, *tail(5)], 1)],  # shared across rows of one call
        # across calls: a prompt ending at a page boundary (its last page is run again, for the
        # logits) and one just past it; the whole shared prefix and a token
        [_request(shared[:16]), _request(shared[:17])],
        [_request([*shared, *tail(1)])],
        [_request([*shared, *tail(30)])],  # a long prompt: its first chunk (32 columns) is cached
        [_request(tail(60), seed) for seed in range(2)],  # two rows of eight pages: the whole pool
        [_request([*shared, *tail(3)])],  # evicted: prefilled whole
    ]
    batches.append([_request([*batches[4][1].tokens[:56], 5])])  # cached by the rows that evicted the rest
    plain = lm.slots(slots=SLOTS, length=64, chunk=32, top_logprobs=3)
    cached = lm.slots(slots=SLOTS, length=64, chunk=32, top_logprobs=3, prefix_cache=True)
    cached.warm_up()  # the same shape: plain's programs are these
    wanted = [_run(plain, batch) for batch in batches]
    assert plain.counts.prefilled == plain.counts.prompt
    compiled = _compiled(cached)
    prefilled = []
    for batch, want in zip(batches, wanted, strict=True):
        got = _run(cached, batch)
        for (tokens, logprobs, top), (tokens2, logprobs2, top2) in zip(want, got, strict=True):
            np.testing.assert_array_equal(tokens2, tokens)
            np.testing.assert_allclose(logprobs2, logprobs, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(top2, top, rtol=1e-5, atol=1e-6)
        prefilled.append(cached.counts.prefilled)
    assert _compiled(cached) == compiled  # no window or count of cached pages compiles anything new
    # the second and third calls prefill the last 16 columns of their prompts, the long one its
    # second chunk; the last one its second chunk too, its first seven pages found again
    assert np.diff([0, *prefilled]).tolist() == [58, 32, 16, 32, 120, 27, 32]
    assert cached.counts.prompt == plain.counts.prompt
    # the last prompt took the least recently used pages: all but one of the shared prefix's,
    # and the first evicting row's; the second row's, which it read, stay
    assert cached.prefix.pages == 8


def test_an_int8_cache_copies_the_cached_pages_scales_with_them(lm):
    """An int8 pool's pages are copied with their scales: a prompt on cached pages (a short one in
    a window, a long one past its first chunk) comes out as without the cache."""
    int8 = LanguageModel(dataclasses.replace(CFG, kv_cache="int8"), lm.decoder.params)
    int8.decoder.page_columns = PAGE
    rng = np.random.default_rng(2)
    shared = rng.integers(1, CFG.vocab_size, 24)
    batches = [
        [_request([*shared, *rng.integers(1, CFG.vocab_size, 5)])],
        [_request([*shared, 7])],
        [_request([*shared, *rng.integers(1, CFG.vocab_size, 30)])],
    ]
    plain = int8.slots(slots=SLOTS, length=64, chunk=32, top_logprobs=3)
    cached = int8.slots(slots=SLOTS, length=64, chunk=32, top_logprobs=3, prefix_cache=True)
    for batch in batches:
        for (tokens, logprobs, top), (tokens2, logprobs2, top2) in zip(
            _run(plain, batch), _run(cached, batch), strict=True
        ):
            np.testing.assert_array_equal(tokens2, tokens)
            np.testing.assert_allclose(logprobs2, logprobs, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(top2, top, rtol=1e-5, atol=1e-6)
    assert cached.counts.prefilled == 29 + 16 + 32 < plain.counts.prefilled
