"""API keys: the GPT-4chan key file, checked in constant time, never kept or logged in clear."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading

from gptj_flax.errors import GptjFlaxError

logger = logging.getLogger(__name__)

MIN_KEY_CHARS = 16


class KeysFileError(GptjFlaxError, ValueError):
    """The API keys file cannot be used; the message names the file and the line, never a key."""


class KeysUnavailable(RuntimeError):
    """The keys file changed into something unusable: no key can be checked until it is fixed."""


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


def read_keys(path: str) -> tuple[bytes, ...]:
    """The digests of the keys in ``path``: the first whitespace-separated token of each line.

    Blank lines and lines whose first token starts with ``#`` are skipped. A key shorter than
    ``MIN_KEY_CHARS`` is refused with its line number, as is a file that is not UTF-8 text.
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise KeysFileError(f"API keys file not found: {path}") from None
    except IsADirectoryError:
        raise KeysFileError(f"API keys file {path} is a directory; give the file of keys") from None
    except UnicodeDecodeError as e:
        raise KeysFileError(f"API keys file {path} is not UTF-8 text (byte {e.start} cannot be decoded)") from None
    except OSError as e:
        raise KeysFileError(f"API keys file {path} cannot be read: {e.strerror}") from None
    digests = []
    for number, line in enumerate(lines, start=1):
        tokens = line.split()
        if not tokens or tokens[0].startswith("#"):
            continue
        if len(tokens[0]) < MIN_KEY_CHARS:
            raise KeysFileError(
                f"API keys file {path} line {number}: the key is shorter than {MIN_KEY_CHARS} "
                "characters; use a longer random key, or start the line with # to comment it out"
            )
        digests.append(key_digest(tokens[0]))
    return tuple(digests)


class KeyStore:
    """The valid keys of a keys file (the GPT-4chan format; see :func:`read_keys`).

    The file is looked at on every check and re-read when its modification time, size or inode
    changes, so keys are added or revoked without a restart. A file that vanishes refuses every
    key; one that becomes unusable (a directory, not UTF-8, a short key) is logged once and makes
    :meth:`is_valid` raise :class:`KeysUnavailable` until it is fixed. Only SHA-256 digests are
    held; a presented key's digest is compared with every valid one with ``hmac.compare_digest``
    and no early exit, so the time taken does not tell how much of a key matched, or which one.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._signature = self._stat()  # before reading: a change while it is read is seen next time
        self._digests = read_keys(self.path)  # at startup a bad file is an error, not a refusal
        self._problem: str | None = None
        logger.info("loaded %d API key(s) from %s", len(self._digests), self.path)

    def _stat(self) -> tuple | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    def _refresh(self) -> None:
        signature = self._stat()
        with self._lock:
            if signature == self._signature:
                return
            self._digests, self._problem, self._signature = (), None, signature
            if signature is None:
                logger.warning("API keys file %s is gone: every request is refused until it is back", self.path)
                return
            try:
                self._digests = read_keys(self.path)
            except KeysFileError as e:
                self._problem = str(e)
                logger.error("%s; every request is refused (503) until the file is fixed", e)
            else:
                logger.info("loaded %d API key(s) from %s", len(self._digests), self.path)

    def __len__(self) -> int:
        self._refresh()
        return len(self._digests)

    def is_valid(self, key: str | None) -> bool:
        """Whether ``key`` is one of the file's keys; :class:`KeysUnavailable` if the file is unusable."""
        self._refresh()
        if self._problem is not None:
            raise KeysUnavailable(self._problem)
        if not key:
            return False
        presented = key_digest(key)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)
        return matched
