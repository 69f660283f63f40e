"""API keys: the GPT-4chan key file, checked in constant time, never kept or logged in clear, and
:class:`KeyCheck`, which asks every request but those of ``PUBLIC_PATHS`` for one.

One rule for every route: a request is let in if its ``Authorization: Bearer KEY`` header or its
JSON body's ``api_key`` holds a valid key, before anything else reads or validates its body. A
header is read as UTF-8 (as clients send a non-ASCII key), or as Latin-1 where it is not UTF-8.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gptj_flax.errors import GptjFlaxError
from gptj_flax.serving.request_body import (
    BodyOverLimit,
    BodyTooLarge,
    answer_too_large,
    content_length,
    is_json,
    read_body,
    replaying,
)
from gptj_flax.serving.schemas import MAX_KEY_CHARS, MAX_TEXT_CHARS

logger = logging.getLogger(__name__)

MIN_KEY_CHARS = 16
# Open without a key: load balancers' health probes and Prometheus scrapers hold none, and neither
# route tells anything about a request's content (state, counts and latencies only).
PUBLIC_PATHS = ("/health", "/metrics")
KEY_ID = "gptj_flax.key_id"  # the request's key id, where KeyCheck leaves it in the ASGI scope
# The largest body read for an api_key field: one of the original servers' clients' (a prompt and a
# pre_prompt of MAX_TEXT_CHARS, JSON-escaped at worst) and room for the rest. Larger requests (a
# batch of prompts) send their key as Authorization: Bearer, as OpenAI's clients do.
BODY_KEY_BYTES = 2**16 + 2 * MAX_TEXT_CHARS * 6


class KeysFileError(GptjFlaxError, ValueError):
    """The API keys file cannot be used; the message names the file and the line, never a key."""


class KeysUnavailable(RuntimeError):
    """The keys file changed into something unusable: no key can be checked until it is fixed."""


def key_digest(key: str) -> bytes:
    # A lone surrogate (JSON can hold one) hashes to bytes no UTF-8 keys file holds: it never matches.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_id(key: str) -> str:
    """What logs show for a key: a short hash that identifies it without revealing it."""
    return "key-" + key_digest(key).hex()[:12]


def header_text(raw: bytes) -> str:
    """A header's value: UTF-8, or Latin-1 (HTTP's historical charset) where it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


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
    ``MIN_KEY_CHARS`` or longer than ``MAX_KEY_CHARS`` (the longest a request's ``api_key`` may
    be) is refused with its line number, as is a file that is not UTF-8 text.
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
        if len(tokens[0]) > MAX_KEY_CHARS:
            raise KeysFileError(
                f"API keys file {path} line {number}: the key is longer than {MAX_KEY_CHARS} characters, "
                "the most a request can send; use a shorter random key"
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
        if not key or len(key) > MAX_KEY_CHARS:
            return False
        presented = key_digest(key)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)
        return matched


def body_key(body: bytes) -> object:
    """The ``api_key`` member of a JSON object body (None where there is none).

    A body whose bytes hold neither ``api_key`` nor a ``\\u`` escape (which could spell it) cannot
    have the member, and is not parsed: a large body without a key costs a byte search, not a parse.
    """
    if b"api_key" not in body and b"\\u" not in body:
        return None
    try:  # as FastAPI parses it, so both read the same body
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return parsed.get("api_key") if isinstance(parsed, dict) else None


NO_KEY = "a valid API key is required (the api_key field or Authorization: Bearer)"
NO_KEY_UNREAD = (
    f"a valid API key is required as Authorization: Bearer KEY (a body over {BODY_KEY_BYTES} bytes is not "
    "read for its api_key field)"
)
KEYS_UNAVAILABLE = "the server cannot check API keys at the moment; try again later"


def refusal(status: int, detail: str, close: bool = False) -> JSONResponse:
    """A new 401 or 503; ``close``: the body was left unread, so the connection cannot be reused."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    return JSONResponse({"detail": detail}, status, headers=headers | ({"Connection": "close"} if close else {}))


def _authorization(scope: Scope) -> str | None:
    """The first Authorization header's text, read as UTF-8 where it is (see :func:`header_text`)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return header_text(value)
    return None


def _may_hold_key(scope: Scope) -> bool:
    """Whether the request has a JSON body, as FastAPI would parse it, that may hold an ``api_key``."""
    return scope["method"] in ("POST", "PUT", "PATCH") and is_json(Headers(scope=scope))


async def _key_in_body(scope: Scope, receive: Receive) -> tuple[object, Receive]:
    """The body's ``api_key`` (see :func:`body_key`) and a receive that gives the body again.
    Raises :class:`BodyOverLimit` for a body over ``BODY_KEY_BYTES``, unread (or read only so far)."""
    length = content_length(scope)
    if length is not None and length > BODY_KEY_BYTES:
        raise BodyOverLimit
    messages, body = await read_body(receive, BODY_KEY_BYTES)
    return body_key(body), replaying(messages, receive)


class KeyCheck:
    """Refuses (401) a request to any path but ``public`` that holds no valid key, before the app reads
    its body, and leaves the key's id in ``scope[KEY_ID]`` for the routes (the request log, and
    whose a docker-API qid is).

    The Bearer token is looked at first; the body only without a valid one, and only a body of up to
    ``BODY_KEY_BYTES``: a larger one without a valid Bearer token is refused unread (and its
    connection closed), so an unauthenticated request costs a few header lookups, or a byte search
    of a body no larger than the original servers' clients send.
    """

    def __init__(self, app: ASGIApp, keys: KeyStore | None, public: tuple[str, ...] = PUBLIC_PATHS):
        self.app, self.keys, self.public = app, keys, public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.keys is None or scope["path"] in self.public:
            return await self.app(scope, receive, send)
        key = bearer_token(_authorization(scope))
        try:
            valid = self.keys.is_valid(key)
            if not valid and _may_hold_key(scope):
                in_body, receive = await _key_in_body(scope, receive)
                if in_body is not None:  # not a string: a key that cannot be valid
                    key = in_body if isinstance(in_body, str) else ""
                    valid = self.keys.is_valid(key)
        except BodyOverLimit:
            logger.info("refused %s: no valid API key, and a body too large to be read for one", scope["path"])
            return await refusal(401, NO_KEY_UNREAD, close=True)(scope, receive, send)
        except BodyTooLarge as refused:
            return await answer_too_large(scope, receive, send, refused)
        except KeysUnavailable:  # the keys file changed into something unusable; its error is logged once
            return await refusal(503, KEYS_UNAVAILABLE)(scope, receive, send)
        if not valid:
            logger.info("refused %s: %s API key", scope["path"], "no" if key is None else "an invalid")
            return await refusal(401, NO_KEY)(scope, receive, send)
        await self.app({**scope, KEY_ID: key_id(key)}, receive, send)
