"""Reading a request's body in a middleware, before the app does, and handing it on unchanged.

Two middlewares look at a body before FastAPI validates it: the API key check (a key may be the
body's ``api_key``) and ``/complete``'s dispatch between its two kinds of body. Each reads the body
with :func:`read_body` and calls the app with :func:`replaying`, so the app reads the same messages.
"""

from __future__ import annotations

import collections

from fastapi.exception_handlers import http_exception_handler
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send


def is_json(headers: Headers) -> bool:
    """Whether FastAPI parses this body as JSON (its strict content-type rule)."""
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    subtype = kind.partition("/")[2]
    return kind.startswith("application/") and (subtype == "json" or subtype.endswith("+json"))


def content_length(scope: Scope) -> int | None:
    """The request's Content-Length, or None (a chunked body, or a header that is not a number)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class BodyTooLarge(Exception):
    """The app's body size limit stopped the read; ``error`` is the 413 to answer with."""

    def __init__(self, error: HTTPException):
        super().__init__(error.detail)
        self.error = error


class BodyOverLimit(Exception):
    """The body is longer than the reader's own ``limit``; what is left of it is unread."""


async def read_body(receive: Receive, limit: int | None = None) -> tuple[list[Message], bytes]:
    """The request's messages (to replay) and its body. Raises :class:`BodyOverLimit` once it is
    longer than ``limit`` bytes, and :class:`BodyTooLarge` past the app's own limit."""
    messages: list[Message] = []
    body = bytearray()
    try:
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away; the route finds out too
                break
            body += message.get("body", b"")
            if limit is not None and len(body) > limit:
                raise BodyOverLimit
            if not message.get("more_body", False):
                break
    except HTTPException as e:  # raised by the body size limit, which wraps receive
        raise BodyTooLarge(e) from None
    return messages, bytes(body)


def replaying(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives ``messages`` again, then what ``receive`` gives."""
    pending = collections.deque(messages)

    async def replay() -> Message:
        return pending.popleft() if pending else await receive()

    return replay


async def answer_too_large(scope: Scope, receive: Receive, send: Send, refused: BodyTooLarge) -> None:
    """Answer the 413 as any route answers it."""
    response = await http_exception_handler(Request(scope), refused.error)
    await response(scope, receive, send)
