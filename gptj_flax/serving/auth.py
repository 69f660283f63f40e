"""API keys: the GPT-4chan key file, checked in constant time, never kept or logged in clear."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading

logger = logging.getLogger(__name__)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def key_id(key: str) -> str:
    """What logs show for a key: a short hash that identifies it without revealing it."""
    return "key-" + key_digest(key).hex()[:12]


def bearer_token(authorization: str | None) -> str | None:
    """The key in an ``Authorization: Bearer KEY`` header (scheme in any case), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class KeyStore:
    """The valid keys: the first whitespace-separated token of each line of a file (the original format).

    The file is looked at on every check and re-read when its modification time, size or inode
    changes, so keys are added or revoked without a restart. Only SHA-256 digests are held; a
    presented key's digest is compared with every valid one with ``hmac.compare_digest`` and no
    early exit, so the time taken does not tell how much of a key matched, or which one.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._signature: tuple | None = None
        self._digests: tuple[bytes, ...] = ()
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"API keys file not found: {self.path}")
        self._refresh()

    def _refresh(self) -> None:
        try:
            stat = os.stat(self.path)
            signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        except OSError:
            signature = None
        with self._lock:
            if signature == self._signature:
                return
            digests: tuple[bytes, ...] = ()
            if signature is None:
                logger.warning("API keys file %s is gone: every request is refused until it is back", self.path)
            else:
                with open(self.path, encoding="utf-8") as f:
                    digests = tuple(key_digest(line.split()[0]) for line in f if line.split())
                logger.info("loaded %d API key(s) from %s", len(digests), self.path)
            self._digests, self._signature = digests, signature

    def __len__(self) -> int:
        self._refresh()
        return len(self._digests)

    def is_valid(self, key: str | None) -> bool:
        self._refresh()
        if not key:
            return False
        presented = key_digest(key)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)
        return matched
