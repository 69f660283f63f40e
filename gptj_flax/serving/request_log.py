"""The request log: every answered completion, appended to a file that is rotated by size.

Two formats: ``jsonl`` (one JSON object per request: time, key id, endpoint, prompt, pre_prompt,
settings, response, latency) and ``transcript``, the GPT-4chan server's plain-text log, a block per
completion (per choice: a request with several prompts, or ``n`` completions of each, writes one
block for each, under its own prompt)::

    ##### key-3f2a9c01b7de ##### 1732886400 #####
    <pre_prompt>
    ###
    <prompt>
    #####
    <response>

Keys appear only as their key id (a short hash), never in clear. Writing the log never fails a
request: a log that cannot be written (a full disk, an I/O error) is reported once, as one ERROR
line naming the file and the reason, never a record, and the server goes on.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from logging.handlers import RotatingFileHandler
from typing import Any

logger = logging.getLogger(__name__)


def _reason(error: BaseException | None) -> str:
    """What went wrong, without anything of the record (an OSError's strerror, else its type)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return type(error).__name__ if error is not None else "unknown error"


class _Handler(RotatingFileHandler):
    """A rotating file handler that reports a failed write once (logging's own ``handleError``
    prints a traceback and the whole record on stderr, for every record), and says when writes
    work again."""

    def __init__(self, path: str, **kwargs):
        super().__init__(path, **kwargs)
        self.failing = False
        self._failed_now = False

    def emit(self, record: logging.LogRecord) -> None:
        self._failed_now = False
        super().emit(record)
        if self.failing and not self._failed_now:
            self.failing = False
            logger.warning("the request log %s is written again", self.baseFilename)

    def handleError(self, record: logging.LogRecord) -> None:
        self._failed_now = True
        self.report(sys.exc_info()[1])

    def report(self, error: BaseException | None) -> None:
        if not self.failing:
            self.failing = True
            logger.error(
                "the request log %s cannot be written (%s): requests are answered but not logged until it can",
                self.baseFilename,
                _reason(error),
            )


def transcript_blocks(prompt: str | list[str], response: str | list[str]) -> list[tuple[str, str]]:
    """Each completion with its own prompt: ``response`` holds one text per completion, the same
    number (``n``) for each of ``prompt``'s texts, in order (a single text for a single prompt)."""
    prompts = [prompt] if isinstance(prompt, str) else prompt
    responses = [response] if isinstance(response, str) else response
    if not prompts or len(responses) % len(prompts):
        raise ValueError(f"{len(responses)} responses cannot be shared among {len(prompts)} prompts")
    n = len(responses) // len(prompts)
    return [(prompts[i // n], text) for i, text in enumerate(responses)]


class RequestLog:
    def __init__(
        self, path: str | os.PathLike, *, log_format: str = "jsonl", max_bytes: int = 100 * 2**20, backups: int = 5
    ):
        path = os.fspath(path)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path, self.format = path, log_format
        self._handler = _Handler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        # A logger of its own, outside the logging tree: records never reach the console handlers.
        self._logger = logging.Logger(f"gptj_flax.serving.requests:{path}", logging.INFO)
        self._logger.propagate = False
        self._logger.addHandler(self._handler)

    def write(
        self,
        *,
        key_id: str | None,
        endpoint: str,
        prompt: str | list[str],
        pre_prompt: str,
        settings: dict[str, Any],
        response: str | list[str],
        latency_s: float,
    ) -> None:
        """One request: its prompt (a text, or a list prompt's texts) and its response (a text, or one
        per completion, ``n`` per prompt in order; see :func:`transcript_blocks`). Never raises."""
        now = time.time()
        try:
            if self.format == "transcript":
                record = "\n".join(
                    f"##### {key_id or '-'} ##### {int(now)} #####\n{pre_prompt}\n###\n{text}\n#####\n{completion}\n"
                    for text, completion in transcript_blocks(prompt, response)
                )
            else:
                record = json.dumps(
                    {
                        "time": round(now, 3),
                        "key_id": key_id,
                        "endpoint": endpoint,
                        "prompt": prompt,
                        "pre_prompt": pre_prompt,
                        "settings": settings,
                        "response": response,
                        "latency_s": round(latency_s, 4),
                    },
                    ensure_ascii=False,
                )
        except (ValueError, TypeError) as e:  # a record that cannot be formatted: reported as a failed write
            self._handler.report(e)
            return
        self._logger.info(record)

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        try:
            self._handler.close()  # flushes what is still buffered
        except OSError as e:
            self._handler.report(e)
