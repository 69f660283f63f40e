"""Stop strings, matched on decoded text (not on token ids: a string can end in the middle of a
token, and one string has many tokenizations), and the text that is safe to stream.
"""

from __future__ import annotations

from collections.abc import Sequence

# What decoding shows for the bytes of a character whose remaining bytes are still to come.
INCOMPLETE_CHARACTER = "\ufffd"


def decode(tokenizer, tokens: Sequence[int]) -> str:
    """Text of ``tokens`` exactly as generated: special tokens kept, no space clean-up, so that
    decoding a longer prefix only ever extends the text."""
    return tokenizer.decode(list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False)


class TextTracker:
    """The text of one generated sequence so far, cut before the first stop string.

    ``update`` returns the newly *final* text: text that no later token can turn into the start of
    a stop string or change (an incomplete UTF-8 character is held back until it completes).
    Concatenating its returns gives ``text``.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stop = list(stop)
        self.text = ""  # everything decoded so far, trimmed at a stop string once one is found
        self.stopped = False
        self.num_tokens = 0  # tokens the text comes from: once stopped, up to the one completing the stop
        self._emitted = 0

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def update(self, tokens: Sequence[int], final: bool) -> str:
        """Decode ``tokens`` (the whole output so far); ``final``: no more tokens will come."""
        if self.stopped:
            return ""
        text = decode(self._tokenizer, tokens)
        if self._first_stop(text) is None:
            self.num_tokens = len(tokens)
        else:
            # Generation ends at the first token that completes a stop string; the output is cut
            # before that string, and tokens after it are not part of the output.
            for n in range(self.num_tokens + 1, len(tokens) + 1):
                text = decode(self._tokenizer, tokens[:n])
                hit = self._first_stop(text)
                if hit is not None:
                    break
            text, self.num_tokens, self.stopped = text[:hit], n, True
        self.text = text
        end = len(text) if final or self.stopped else len(text) - self._held_back(text)
        piece = text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return piece

    def _held_back(self, text: str) -> int:
        """How many trailing characters might still change or begin a stop string."""
        body = text.rstrip(INCOMPLETE_CHARACTER)
        incomplete = len(text) - len(body)
        prefix = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(body)), prefix, -1):
                if body.endswith(stop[:n]):
                    prefix = n
                    break
        return incomplete + prefix
