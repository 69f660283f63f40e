"""The prefix cache of the decode slots: full prompt pages kept in the page pool, found again by
what they hold.

A page of a prompt holds the keys and values of its tokens, and they depend on every token before
them (and on the weights). So a full page is named by a hash chain: its key hashes its own token
ids with the key of the page before it, the first page's with a *salt* that stands for anything
else that changes the keys and values (the weights, an adapter). Two prompts whose first ``k``
pages have equal keys share those pages' contents exactly.

Only full pages of prompts are kept, and a sequence never writes into the pages of its prompt
after its prefill (a decode step writes at the sequence's length, past them). A row holds its
own copy of every page of its prompt: its prefill copies the cached pages it shares into its own
(the decode step scores each page in view against the one row that owns it, so a page is never in
two rows' tables). A cached page is held while the row that wrote it runs; once no row holds it, it
stays cached, idle, until the pool needs it, the least recently used first.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16  # 128-bit keys: collisions are out of reach for any number of pages a pool holds


def page_keys(tokens: Sequence[int], page: int, salt: bytes = b"") -> list[bytes]:
    """The hash-chain keys of the full pages of ``tokens`` (pages of ``page`` tokens)."""
    key = hashlib.blake2b(salt, digest_size=KEY_BYTES).digest()
    ids = np.asarray(tokens, np.int64)
    keys = []
    for i in range(len(ids) // page):
        key = hashlib.blake2b(key + ids[i * page : (i + 1) * page].tobytes(), digest_size=KEY_BYTES).digest()
        keys.append(key)
    return keys


@dataclasses.dataclass
class PromptCounts:
    """Prompt tokens admitted, and how many of them were prefilled (the rest came from the cache)."""

    prompt: int = 0
    prefilled: int = 0

    @property
    def cached(self) -> int:
        return self.prompt - self.prefilled

    @property
    def hit_rate(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0


class PrefixCache:
    """Which pool pages hold which full prompt pages (by :func:`page_keys`), and which of them no
    row holds (evictable, least recently used first). Host-side bookkeeping only."""

    def __init__(self, page: int, salt: bytes = b""):
        self.page, self.salt = page, salt
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first

    def keys(self, tokens: Sequence[int], salt: bytes = b"") -> list[bytes]:
        """The keys of ``tokens``' full pages, for a prompt run with ``salt`` besides the cache's own
        (its adapter's, so that pages of different adapters are never shared)."""
        return page_keys(tokens, self.page, self.salt + salt)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The pages holding the longest run of ``keys`` from the first; each is used now (the
        most recently used of the idle ones)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
            if page in self._idle:
                self._idle.move_to_end(page)
        return pages

    def add(self, key: bytes, page: int) -> bool:
        """A row's ``page`` is being written with the page named ``key``: keep it, held by that row
        (False if that key is cached already: the row's copy is then a page like any other)."""
        if key in self._page_of:
            return False
        self._page_of[key], self._key_of[page] = page, key
        return True

    def release(self, page: int) -> bool:
        """The row holding ``page`` has ended: a cached page stays cached, idle (True); any other
        page is the caller's to free (False)."""
        if page not in self._key_of:
            return False
        self._idle[page] = None
        return True

    def evict(self) -> int | None:
        """Forget the least recently used idle page and hand it out (None: every cached page is held)."""
        if not self._idle:
            return None
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        return page

    @property
    def pages(self) -> int:
        """Pages cached now, held by a row or idle."""
        return len(self._key_of)

    @property
    def idle(self) -> int:
        return len(self._idle)
