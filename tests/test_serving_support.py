"""Shared by the test_serving* modules (it holds no tests): a tiny checkpoint with its tokenizer, a
real uvicorn server on a free loopback port in a thread, a model wrapper that can hold generation,
and the leak scan: an autouse fixture (``no_key_leaks``, imported by every serving test module)
that fails a test if any API key it used appears in a log record or a response body."""

import functools
import logging
import os
import socket
import tempfile
import threading
import time

import flax.linen as nn
import httpx
import jax
import jax.numpy as jnp
import pytest
import requests
import uvicorn

import gptj_flax
from gptj_flax.checkpoint import Checkpointer
from gptj_flax.config import Config, TrainConfig
from gptj_flax.data.tokenizer import train_bpe_tokenizer
from gptj_flax.model import GPTJ
from gptj_flax.serving import DrainingServer, ServeSettings, create_app
from tests.helpers import CORPUS, tiny_config

# A 64-token context keeps every compiled shape small; the vocabulary is padded past the tokenizer's.
CONFIG = tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=320, max_len=64)
KEYS = ("sk-alpha-0123456789", "sk-bravo-9876543210")
STARTUP_TIMEOUT_S = 300


def write_checkpoint(directory: str) -> None:
    """A tiny random GPT-J and a locally trained byte-level BPE tokenizer, as a training run leaves them."""
    params = nn.meta.unbox(GPTJ(CONFIG).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    checkpointer = Checkpointer(directory)
    checkpointer.save(1, params=params, config=Config(model=CONFIG, train=TrainConfig(batch_size=2)))
    checkpointer.close()
    tokenizer = train_bpe_tokenizer(CORPUS, vocab_size=300, from_files=False, min_frequency=1)
    tokenizer.save_pretrained(os.path.join(directory, "tokenizer"))


_checkpoint: tempfile.TemporaryDirectory | None = None


def checkpoint_dir() -> str:
    """One checkpoint per test process (removed at exit), shared by every serving test module."""
    global _checkpoint
    if _checkpoint is None:
        _checkpoint = tempfile.TemporaryDirectory(prefix="serving-ckpt-")
        write_checkpoint(_checkpoint.name)
    return _checkpoint.name


@functools.cache
def tiny_model():
    """The loaded model, shared so that its compiled programs are too."""
    return gptj_flax.load(checkpoint_dir())


def write_keys(path, keys=KEYS) -> None:
    """A keys file as an operator writes one: a comment, then each key with a note, blank lines between."""
    with open(path, "w") as f:
        f.write("# API keys, one per line; the rest of a line is a note\n")
        for i, key in enumerate(keys):
            f.write(f"{key}   client-{i} added 2024-01-0{i + 1}\n\n")


# -- the leak scan ------------------------------------------------------------------------------------
SECRETS: set[str] = set(KEYS)  # every key text a serving test sends, valid or not


def secret(text: str) -> str:
    """Register ``text`` (a key a test uses) with the leak scan; returns it."""
    SECRETS.add(text)
    return text


class LeakScan:
    """What one test's logs and HTTP clients saw: every log record of any logger (formatted, with its
    traceback), every response's headers and body as its client received it, and the outputs that
    tests hand over with :meth:`add` (a server process's stdout and stderr)."""

    def __init__(self):
        self.seen: list[tuple[str, object]] = []  # (where, str or a bytearray still being filled)
        self.records: list[logging.LogRecord] = []

    def add(self, where: str, text) -> None:
        self.seen.append((where, text))

    def texts(self) -> list[tuple[str, str]]:
        return [
            (where, bytes(text).decode("utf-8", "replace") if isinstance(text, bytearray) else text)
            for where, text in list(self.seen)
        ]

    def leaks(self) -> list[str]:
        return [
            f"a key registered with secret() ({sorted(SECRETS).index(key)}) in {where}"
            for where, text in self.texts()
            for key in SECRETS
            if key in text
        ]

    def forget(self) -> None:
        self.seen.clear()
        self.records.clear()


_scan: LeakScan | None = None


def scanned(text: str, where: str = "a server process's output") -> str:
    """Hand ``text`` to the current test's leak scan; returns it."""
    if _scan is not None:
        _scan.add(where, text)
    return text


def _formatted(record: logging.LogRecord) -> str:
    try:
        return logging.Formatter("%(name)s %(levelname)s %(message)s").format(record)
    except Exception:  # noqa: BLE001 - a record that cannot be formatted is still scanned
        return f"{record.msg} {record.args}"


class _RecordedStream(httpx.SyncByteStream):
    def __init__(self, stream, body: bytearray):
        self._stream, self._body = stream, body

    def __iter__(self):
        for chunk in self._stream:
            self._body += chunk
            yield chunk

    def close(self):
        self._stream.close()


class _AsyncRecordedStream(httpx.AsyncByteStream):
    def __init__(self, stream, body: bytearray):
        self._stream, self._body = stream, body

    async def __aiter__(self):
        async for chunk in self._stream:
            self._body += chunk
            yield chunk

    async def aclose(self):
        await self._stream.aclose()


def _headers_text(response) -> str:
    return "\n".join(f"{name}: {value}" for name, value in response.headers.items())


@pytest.fixture(autouse=True)
def no_key_leaks(monkeypatch):
    """Record every log record and response body of the test; fail it if a registered key is in one."""
    global _scan
    scan = _scan = LeakScan()
    handle = logging.Logger.handle

    def recording_handle(logger, record):
        scan.records.append(record)
        scan.add(f"a log record of {record.name}", _formatted(record))
        return handle(logger, record)

    def recorded(response, client: str):
        body = bytearray()
        scan.add(f"a response's headers ({client})", _headers_text(response))
        scan.add(f"a response body ({client})", body)
        return body

    sync_request = httpx.HTTPTransport.handle_request
    async_request = httpx.AsyncHTTPTransport.handle_async_request
    requests_send = requests.adapters.HTTPAdapter.send

    def handle_request(transport, request):
        response = sync_request(transport, request)
        response.stream = _RecordedStream(response.stream, recorded(response, "httpx"))
        return response

    async def handle_async_request(transport, request):
        response = await async_request(transport, request)
        response.stream = _AsyncRecordedStream(response.stream, recorded(response, "httpx async"))
        return response

    def send(adapter, request, **kwargs):
        response = requests_send(adapter, request, **kwargs)
        recorded(response, "requests").extend(response.content)  # reading it here keeps it for the caller
        return response

    monkeypatch.setattr(logging.Logger, "handle", recording_handle)
    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", handle_request)
    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", handle_async_request)
    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", send)
    package_logger = logging.getLogger("gptj_flax")
    level = package_logger.level
    package_logger.setLevel(logging.DEBUG)  # the server's info and debug records are scanned too
    try:
        yield scan
    finally:
        package_logger.setLevel(level)
        _scan = None
    leaks = scan.leaks()
    assert not leaks, "API keys leaked: " + "; ".join(leaks)


class HeldModel:
    """A LanguageModel whose decode slots wait while ``gate`` is closed before each prefill (and the
    warm-up), recording the prompts of every prefill; ``step_delay_s`` slows each decode call down,
    ``fail_next`` fails the next prefill, as a lost device would; ``decode_calls`` counts decode calls."""

    def __init__(self, model):
        self._model = model
        self.gate = threading.Event()
        self.gate.set()
        self.batches: list[list[list[int]]] = []  # every prefill's prompts, the warm-up's ([[0]]) included
        self.decode_calls = 0
        self.step_delay_s = 0.0
        self.waiting = False  # a prefill has started and is held at the gate
        self.fail_next = False

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _enter(self, prompts) -> None:
        self.batches.append([list(p) for p in prompts])
        self.waiting = True
        self.gate.wait()
        self.waiting = False
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device lost")

    def slots(self, **kwargs):
        return _HeldSlots(self, self._model.slots(**kwargs))


class _HeldSlots:
    """The model's decode slots, passing each prefill through the holder's gate."""

    def __init__(self, holder: HeldModel, slots):
        self._holder, self._slots = holder, slots

    def __getattr__(self, name):
        return getattr(self._slots, name)

    def warm_up(self, **kwargs):
        self._holder._enter([[0]])
        return self._slots.warm_up(**kwargs)

    def dispatch_admit(self, requests, slots):
        self._holder._enter([r.tokens for r in requests])
        return self._slots.dispatch_admit(requests, slots)

    def dispatch_prefill(self, requests):
        self._holder._enter([r.tokens for r in requests])
        return self._slots.dispatch_prefill(requests)

    def start_prefill(self, request):
        self._holder._enter([request.tokens])
        return self._slots.start_prefill(request)

    def dispatch_decode(self, *args, **kwargs):
        self._holder.decode_calls += 1
        time.sleep(self._holder.step_delay_s)
        return self._slots.dispatch_decode(*args, **kwargs)


def wait_until(condition, timeout_s: float = 30.0, what: str = "condition", interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class RunningServer:
    """``create_app(model, settings)`` under a real uvicorn on 127.0.0.1 (a free port), in a thread.

    As a context manager: started and warmed up on entry, stopped on exit. ``drain()`` does what
    SIGTERM does to the CLI's server.
    """

    def __init__(self, model, **settings):
        settings.setdefault("checkpoint", checkpoint_dir())
        self.settings = ServeSettings(**settings)
        self.app = create_app(model, self.settings)
        self.service = self.app.state.service
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        # log_config=None: uvicorn's own dictConfig would close every handler in the process, absl's among
        # them, which closes the stream it holds: pytest's capture of stderr.
        config = uvicorn.Config(
            self.app, log_config=None, log_level="warning", access_log=False, timeout_graceful_shutdown=30
        )
        self.server = DrainingServer(config, self.service)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def health(self) -> int | None:
        """/health's status code, or None while nothing listens."""
        try:
            return httpx.get(self.url + "/health", timeout=10).status_code
        except httpx.TransportError:
            return None

    def start(self, wait_ready: bool = True) -> "RunningServer":
        """Start the thread; wait until /health says ready (or, without ``wait_ready``, until it answers)."""
        self.thread.start()
        expected = (200,) if wait_ready else (200, 503)
        wait_until(
            lambda: self.health() in expected or not self.thread.is_alive(),
            STARTUP_TIMEOUT_S,
            "the server to start",
            interval_s=0.1,
        )
        assert self.thread.is_alive(), f"the server stopped: {self.service.worker.error}"
        return self

    def __enter__(self) -> "RunningServer":
        return self.start()

    def drain(self) -> None:
        self.server.handle_exit(15, None)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop"

    def __exit__(self, *exc) -> None:
        self.stop()
