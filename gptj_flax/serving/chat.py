"""The chat template of ``/v1/chat/completions``: the Jinja template that turns a conversation into
the prompt's text, read and checked when the server starts, and rendered per request by
transformers' own ``apply_chat_template`` (its sandboxed Jinja environment, ``raise_exception``,
and the tokenizer's special tokens as variables), so a template behaves here as it does there.

Also the raw bytes of a token, which OpenAI's chat logprobs report beside its text.
"""

from __future__ import annotations

import functools
import logging

import jinja2
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.utils.chat_template_utils import render_jinja_template

from gptj_flax.errors import GptjFlaxError

logger = logging.getLogger(__name__)

FLAG, VARIABLE = "--chat-template", "GPTJ_FLAX_CHAT_TEMPLATE"


class ChatTemplateError(GptjFlaxError, ValueError):
    """The chat template cannot be used; the message names the file (or the tokenizer) and the problem."""


class RenderError(ValueError):
    """The template could not render a request's messages; the message says why, never what they hold."""


def read_chat_template(path: str) -> str:
    """The text of the ``--chat-template`` file, once it is known to be a Jinja template."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ChatTemplateError(f"{FLAG} file not found: {path} (set {FLAG} or {VARIABLE})") from None
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"{FLAG} {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ChatTemplateError(f"{FLAG} {path} cannot be read: {e.strerror}") from None
    if not text.strip():
        raise ChatTemplateError(f"{FLAG} {path} is empty: it must be a Jinja chat template")
    check_template(text, f"{FLAG} {path}")
    return text


def check_template(text: str, where: str) -> None:
    """Compile ``text`` as apply_chat_template does (an empty conversation list compiles the template
    and renders nothing), so a syntax error is found at start-up, not at the first request."""
    try:
        render_jinja_template(conversations=[], chat_template=text)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"{where} is not a valid Jinja template: line {e.lineno}: {e.message or type(e).__name__}"
        ) from None


def chat_template(path: str | None, tokenizer) -> str | None:
    """The template to render with: the ``--chat-template`` file's, else the tokenizer's own (checked
    too), else None (``/v1/chat/completions`` then answers 400)."""
    if path is not None:
        return read_chat_template(path)
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        text = tokenizer.get_chat_template()  # one of several named templates: the "default"
    except ValueError as e:
        raise ChatTemplateError(f"the tokenizer's chat template cannot be used ({e}); give one with {FLAG}") from None
    check_template(text, f"the tokenizer's chat template (or give one with {FLAG})")
    return text


def render(tokenizer, template: str, messages: list[dict]) -> str:
    """The prompt text of ``messages`` followed by the start of the assistant's reply."""
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except jinja2.TemplateError as e:  # raise_exception in the template, or a sandbox refusal
        raise RenderError(f"the chat template refused these messages: {e.message or type(e).__name__}") from None
    except Exception as e:  # noqa: BLE001 - a template's own failure on these messages, not the server's
        logger.warning("the chat template failed on a request's messages: %s", type(e).__name__)
        raise RenderError(f"the chat template failed on these messages ({type(e).__name__})") from None


@functools.cache
def _byte_of_char() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, token: int, text: str) -> list[int]:
    """The bytes of ``token`` (whose decoded text is ``text``). A byte-level BPE token that holds part
    of a character decodes to U+FFFD: its bytes then come from its vocabulary entry, which spells each
    byte as one character (GPT-2's byte-to-unicode table)."""
    if "\ufffd" in text:
        spelt = tokenizer.convert_ids_to_tokens(token)
        byte_of = _byte_of_char()
        if spelt and all(char in byte_of for char in spelt):
            return [byte_of[char] for char in spelt]
    return list(text.encode("utf-8"))
