"""The request log: every answered completion, appended to a file that is rotated by size.

Two formats: ``jsonl`` (one JSON object per request: time, key id, endpoint, prompt, pre_prompt,
settings, response, latency) and ``transcript``, the GPT-4chan server's plain-text log::

    ##### key-3f2a9c01b7de ##### 1732886400 #####
    <pre_prompt>
    ###
    <prompt>
    #####
    <response>

Keys appear only as their key id (a short hash), never in clear.
"""

from __future__ import annotations

import json
import logging
import os
import time
from logging.handlers import RotatingFileHandler
from typing import Any


class RequestLog:
    def __init__(
        self, path: str | os.PathLike, *, log_format: str = "jsonl", max_bytes: int = 100 * 2**20, backups: int = 5
    ):
        path = os.fspath(path)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path, self.format = path, log_format
        self._handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
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
        """One request; a list prompt comes with a list of responses (one transcript block each)."""
        now = time.time()
        if self.format == "transcript":
            pairs = zip(prompt, response, strict=True) if isinstance(prompt, list) else [(prompt, response)]
            record = "\n".join(
                f"##### {key_id or '-'} ##### {int(now)} #####\n{pre_prompt}\n###\n{text}\n#####\n{completion}\n"
                for text, completion in pairs
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
        self._logger.info(record)

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._handler.close()
