"""Synthetic 4chan thread dumps of any size, for the determinism, compression and memory tests."""

from __future__ import annotations

import json
import os
import random

_WORDS = (
    "the of and to a in is that it was for on are as with they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which "
    "kek based cringe anon thread bump sage meme lurk post image board cope seethe"
).split()


def write_synthetic_dump(path: str | os.PathLike, target_bytes: int, *, seed: int = 0) -> int:
    """Write a plain ndjson dump of at least ``target_bytes`` in 4chan's shape; returns its thread count.

    Bodies mix what real ones hold — ``<br>``, quote links, greentext spans, ``<wbr>`` in URLs,
    escaped entities, non-ASCII text — and a few posts are empty or have no ``com`` (image-only).
    Deterministic in ``seed``; nothing is held beyond one thread.
    """
    rng = random.Random(seed)
    no = 10_000_000
    written = n_threads = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target_bytes:
            posts = []
            for _ in range(rng.randint(1, 40)):
                no += rng.randint(1, 5)
                post = {"no": no, "time": 1_500_000_000 + no}
                kind = rng.random()
                if kind < 0.05:
                    pass  # image-only: no com
                elif kind < 0.08:
                    post["com"] = ""
                else:
                    lines = []
                    for _ in range(rng.randint(1, 6)):
                        words = " ".join(rng.choices(_WORDS, k=rng.randint(1, 25)))
                        roll = rng.random()
                        if roll < 0.2:
                            lines.append(
                                f'<a href="#p{no - rng.randint(1, 50)}" class="quotelink">'
                                f"&gt;&gt;{no - rng.randint(1, 50)}</a>"
                            )
                        elif roll < 0.35:
                            lines.append(f'<span class="quote">&gt;{words}</span>')
                        elif roll < 0.4:
                            lines.append(f"https://example.com/{words.replace(' ', '_')[:40]}<wbr>/page")
                        elif roll < 0.45:
                            lines.append(f"{words} &quot;d&eacute;j&agrave; vu&quot; it&#039;s \u65e5\u672c \U0001f602")
                        else:
                            lines.append(words)
                    post["com"] = "<br>".join(lines)
                posts.append(post)
            line = json.dumps({"posts": posts}) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            n_threads += 1
    return n_threads
