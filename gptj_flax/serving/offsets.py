"""OpenAI's ``text_offset``: where each token of a choice begins in the choice's ``text``.

A token's offset is the index in ``text`` of the character its first byte belongs to. Tokens
are not characters: a byte-level BPE splits a character it has not learned ("日", "é") into
tokens of one or two of its UTF-8 bytes, each of which decodes alone to U+FFFD (the token
strings the logprobs object shows). Such tokens share the offset of the character they are part
of; a token that completes one character and starts the next has the offset of the first. A
token that adds no character to ``text`` has the offset where ``text`` goes on: the end-of-text
token the server starts an empty prompt from is listed (``tokens[0]``, its log-prob null) at
offset 0, and one that ends a completion at the end of ``text``; neither is part of ``text``.

What is read is decoded text, not bytes (any tokenizer decodes): a token whose text ends in
U+FFFD may end in an incomplete character, and the next token belongs to that character where
decoding the two together differs from decoding each alone. That tells a character's last bytes
from a new character, and bytes that never form a character (a model can generate them; they show
as U+FFFD in ``text``) from those that do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gptj_flax.sampling.stopping import INCOMPLETE_CHARACTER

# Tokens decoded together while each ends inside a character (at most 4 go on with one character,
# but a token can end one and begin the next); past this many, as pathological as that is, a run is
# taken to form no character, so that decoding stays linear in the tokens.
MAX_PENDING_TOKENS = 8


class TextOffsets:
    """The offsets of tokens given in order, in one or several calls (a stream's pieces), for a text
    that begins at character ``start`` (the choice's prompt, where the tokens follow it)."""

    def __init__(self, decode: Callable[[list[int]], str], start: int = 0):
        self._decode = decode
        self.end = start  # where the text of the tokens taken so far ends (before the pending ones')
        self._pending: list[int] = []  # tokens whose text ends in an incomplete character

    def add(self, tokens: Sequence[int]) -> list[int]:
        """The offsets of ``tokens``, which follow the tokens given before."""
        return [self._take(token) for token in tokens]

    def _take(self, token: int) -> int:
        own = self._decode([token])
        if self._pending:
            before = self._decode(self._pending)
            joined = self._decode([*self._pending, token])
            if joined != before + own and len(self._pending) < MAX_PENDING_TOKENS:
                # its first bytes go on with the incomplete character, the last one of ``before``
                offset = self.end + len(before) - 1
                self._pending.append(token)
                if not joined.endswith(INCOMPLETE_CHARACTER):
                    self.end, self._pending = self.end + len(joined), []
                return offset
            self.end, self._pending = self.end + len(before), []  # the pending bytes form no character
        offset = self.end
        if own.endswith(INCOMPLETE_CHARACTER):
            self._pending = [token]
        else:
            self.end += len(own)
        return offset
