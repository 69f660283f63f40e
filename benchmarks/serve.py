"""``bench.py serve``: generated tokens/s, time to first token, inter-token latency and decode-slot
occupancy of a running server, by concurrency.

Each of N concurrent clients streams ``/v1/completions`` requests one after another (sampling at
temperature 0.8, its own seed and a ``max_tokens`` drawn from ``--new-tokens`` each time); tokens
are counted and timed as they arrive. The figures are those of a window of ``--seconds`` that opens
after ``--warmup`` seconds of the same load, so that they show the server in its steady state: the
burst of every client's first request (all sent at the same moment) falls in the warm-up, and the
tail after the window, where clients stop sending and the slots empty, is not counted. The
occupancy is read from the server's ``/metrics`` as the window opens and closes.

With ``--url`` it measures that server. Without it, it builds a ~25M-parameter random GPT-J and a
byte-level BPE trained on the standard library's sources in a temporary directory, starts
``serve()`` on it in a child process (``--max-batch`` decode slots, and the compilation cache on in
an empty directory, as a first ``gptj-serve`` starts: the "ready in" time is a cold start),
measures, and stops it with SIGTERM. With a model this size one decode step costs far more than the HTTP around it, and a
step of 32 slots far less than 32 single steps: continuous batching is what the table shows.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time

import flax.linen as nn
import httpx
import jax
import jax.numpy as jnp

from benchmarks.common import BENCH_MODEL, REPO, machine_summary
from gptj_flax.checkpoint import Checkpointer
from gptj_flax.config import Config, ModelConfig
from gptj_flax.data import train_bpe_tokenizer
from gptj_flax.data.corpus import stdlib_sources
from gptj_flax.model import GPTJ
from gptj_flax.serving.settings import env_name

# Prompts stay under 16 tokens: the server's warm-up compiles that prompt bucket for every batch size.
PROMPT_WORDS = ("def", "return", "import", "class", "self", "for", "while", "print", "yield", "lambda")
TOKENIZER_VOCAB = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running server (default: start one on a random ~25M-parameter model)")
    parser.add_argument("--api-key", help="sent as Authorization: Bearer, for a server with keys")
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client counts (default 1,8,32,64)")
    parser.add_argument("--seconds", type=float, default=20, help="measured time per concurrency (default 20)")
    parser.add_argument(
        "--warmup",
        type=float,
        default=5,
        help="seconds the clients run at each concurrency before the measured window opens (default 5)",
    )
    parser.add_argument(
        "--new-tokens",
        default="8,128",
        help="max_tokens of each request: N, or MIN,MAX drawn uniformly per request (default 8,128)",
    )
    parser.add_argument(
        "--max-batch", type=int, help="--max-batch of the server it starts (not with --url; default 32)"
    )
    parser.add_argument(
        "--prefill",
        choices=("beside", "between"),
        help="--prefill of the server it starts (not with --url; default between; with beside the server "
        "process gets two CPU devices, one for the decode slots and one to prefill on)",
    )


@dataclasses.dataclass
class Round:
    clients: int
    requests: int  # requests sent inside the window
    seconds: float  # the window's length
    tokens: int  # tokens that arrived inside the window
    ttft: list[float]  # per request sent inside the window: time to its first token
    itl: list[float]  # per token that arrived inside the window after its request's first: time since the previous one
    occupancy: float  # mean busy fraction of the server's decode slots in the window (nan: no such metrics)

    @staticmethod
    def percentile(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def _prompt(i: int) -> str:
    return " ".join(PROMPT_WORDS[(i + k) % len(PROMPT_WORDS)] for k in range(6))


def _slot_steps(metrics: str) -> tuple[float, float]:
    """(busy, all) slot-steps the server has run, from its /metrics (0, 0 where it has none)."""
    values = []
    for name in ("gptj_busy_slot_steps_total", "gptj_slot_steps_total"):
        match = re.search(rf"^{name} (\S+)$", metrics, re.MULTILINE)
        values.append(float(match.group(1)) if match else 0.0)
    return values[0], values[1]


def _counts(spec: str) -> list[int] | None:
    """The comma-separated whole numbers of ``spec``, or None if it holds anything else."""
    try:
        return [int(x) for x in spec.split(",")]
    except ValueError:
        return None


def _lengths(spec: str) -> tuple[int, int]:
    parts = _counts(spec)
    if parts is None or len(parts) not in (1, 2) or min(parts) < 1 or parts[0] > parts[-1]:
        raise SystemExit(f"error: --new-tokens must be N or MIN,MAX with 1 <= MIN <= MAX, got {spec!r}")
    return parts[0], parts[-1]


@dataclasses.dataclass
class _Timed:
    """One streamed completion as it arrived: when it was sent, and when each of its tokens came."""

    sent: float
    arrivals: list[float]  # one per token (a chunk of k tokens gives k equal times)
    gaps: list[float]  # per token after the first: the wait since the previous token
    ended: float = float("nan")  # when the stream closed

    @property
    def first(self) -> float:
        """When the first token came (the end of the stream, for one that brought none)."""
        return self.arrivals[0] if self.arrivals else self.ended


async def _stream(http: httpx.AsyncClient, body: dict) -> _Timed:
    """One streamed completion, timed as it arrives.

    ``logprobs: 0`` makes every chunk carry its tokens, so tokens are counted and timed one by one
    (a chunk of k tokens counts k gaps of a k-th of the wait each).
    """
    sent = last = time.perf_counter()
    timed = _Timed(sent, [], [])
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True, "logprobs": 0}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            logprobs = json.loads(line[len("data: ") :])["choices"][0]["logprobs"]
            n = len(logprobs["tokens"]) if logprobs else 0
            if not n:
                continue
            now = time.perf_counter()
            timed.gaps += [(now - last) / n] * (n - 1 if not timed.arrivals else n)
            timed.arrivals += [now] * n
            last = now
    timed.ended = time.perf_counter()
    return timed


async def _round(
    http: httpx.AsyncClient, clients: int, warmup: float, seconds: float, lengths: tuple[int, int], seed: int
) -> Round:
    """Clients stream requests one after another from the start; what happens in the window of
    ``seconds`` that opens ``warmup`` seconds later is measured.

    The warm-up takes in every client's first request (all of which are sent at the same moment)
    and lets the mix of request lengths settle; after the window each client finishes the request it
    is on (unmeasured), so neither the start nor the end of the round counts, only the steady state.
    """
    results: list[_Timed] = []
    start = time.perf_counter()
    opens, closes = start + warmup, start + warmup + seconds

    async def client(c: int) -> None:
        draws = random.Random(seed * 7919 + c)
        for r in itertools.count():
            body = {
                "prompt": _prompt(c + r),
                "max_tokens": draws.randint(*lengths),
                "temperature": 0.8,
                "seed": (seed + 1000 * c + r) % 2**31,
            }
            results.append(await _stream(http, body))
            if time.perf_counter() >= closes:
                return

    async def slot_steps_at(moment: float) -> tuple[float, float]:
        await asyncio.sleep(max(0.0, moment - time.perf_counter()))
        return _slot_steps((await http.get("/metrics")).text)

    # a task group: on an error or Ctrl-C every task is cancelled and awaited, none left behind
    try:
        async with asyncio.TaskGroup() as tasks:
            at_open, at_close = tasks.create_task(slot_steps_at(opens)), tasks.create_task(slot_steps_at(closes))
            for c in range(clients):
                tasks.create_task(client(c))
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None  # the first failure, named as it was raised
    before, after = at_open.result(), at_close.result()
    slot_steps = after[1] - before[1]
    occupancy = (after[0] - before[0]) / slot_steps if slot_steps else float("nan")
    return _window(results, clients, opens, closes, occupancy)


def _window(results: list[_Timed], clients: int, opens: float, closes: float, occupancy: float) -> Round:
    """The figures of the requests sent, and the tokens that arrived, in ``[opens, closes)``."""
    inside = [r for r in results if opens <= r.sent < closes]
    tokens, itl = 0, []
    for r in results:
        for i, at in enumerate(r.arrivals):
            if opens <= at < closes:
                tokens += 1
                if i:
                    itl.append(r.gaps[i - 1])
    ttft = [r.first - r.sent for r in inside]
    return Round(clients, len(inside), closes - opens, tokens, ttft, itl, occupancy)


async def _measure(
    url: str, api_key: str | None, concurrency: list[int], warmup: float, seconds: float, lengths: tuple[int, int]
) -> list[Round]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # one connection per client, and one more for the /metrics reads that open and close the window:
    # sharing the clients' connections, those reads waited for a free one and could miss the window
    limits = httpx.Limits(max_connections=max(concurrency) + 1)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as http:
        return [await _round(http, clients, warmup, seconds, lengths, seed=i) for i, clients in enumerate(concurrency)]


def _write_model(directory: str, config: ModelConfig = BENCH_MODEL) -> str:
    """A random GPT-J checkpoint of ``config`` (default: the ~25M-parameter benchmark model) and a BPE
    tokenizer; returns a description."""
    params = nn.meta.unbox(GPTJ(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    checkpointer = Checkpointer(directory)
    checkpointer.save(0, params=params, config=Config(model=config))
    checkpointer.close()
    train_bpe_tokenizer(stdlib_sources()[:300], vocab_size=min(TOKENIZER_VOCAB, config.vocab_size)).save_pretrained(
        os.path.join(directory, "tokenizer")
    )
    return (
        f"random GPT-J, {config.param_count() / 1e6:.1f}M parameters ({config.n_layers} layers, d_model "
        f"{config.d_model}, vocab {config.vocab_size}, context {config.max_len}), {config.dtype}"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(checkpoint: str, max_batch: int, prefill: str, cache: str) -> tuple[subprocess.Popen, str]:
    """``serve()`` of this checkout in a child process (no GIL shared with the clients), configured by
    environment variables as a deployment would be, with the compilation cache as gptj-serve has it,
    in ``cache`` (an empty directory: a cold start)."""
    port = _free_port()
    settings = {
        "checkpoint": checkpoint,
        "port": port,
        "max_batch": max_batch,
        "prefill": prefill,
        "log_level": "warning",
    }
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, **{env_name(name): str(v) for name, v in settings.items()}}
    env = {
        k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR" and not k.startswith("JAX_PERSISTENT_CACHE")
    }
    env["GPTJ_FLAX_CACHE"] = cache
    if prefill == "beside":  # on the CPU, a spare device to prefill on; the decode slots keep the first
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from gptj_flax.cli.compile_cache import use_compile_cache; "
            "from gptj_flax.serving import serve, settings_from; use_compile_cache([]); sys.exit(serve(settings_from()))",
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=10).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the benchmark server did not become ready")


def run(args: argparse.Namespace) -> None:
    concurrency = _counts(args.concurrency)
    if concurrency is None or min(concurrency) < 1:
        raise SystemExit(f"error: --concurrency must be client counts >= 1, such as 1,8,32; got {args.concurrency!r}")
    lengths = _lengths(args.new_tokens)
    if not (0 < args.seconds < math.inf and 0 <= args.warmup < math.inf):
        raise SystemExit("error: --seconds must be a finite number > 0 and --warmup a finite number >= 0")
    if args.url and (args.max_batch is not None or args.prefill is not None):
        raise SystemExit(
            "error: --max-batch and --prefill set up the server the benchmark starts; with --url the server is yours"
        )
    max_batch = 32 if args.max_batch is None else args.max_batch
    prefill = args.prefill or "between"
    machine = machine_summary()  # before the server it starts adds its own load
    if args.url:
        machine = f"clients' {machine} (the server's may differ)"

    def measure(url: str, api_key: str | None) -> list[Round]:
        return asyncio.run(_measure(url, api_key, concurrency, args.warmup, args.seconds, lengths))

    if args.url:
        target = f"server {args.url}"
        rounds = measure(args.url.rstrip("/"), args.api_key)
    else:
        with (
            tempfile.TemporaryDirectory(prefix="bench-serve-") as directory,
            tempfile.TemporaryDirectory(prefix="bench-serve-cache-") as cache,
        ):
            start = time.perf_counter()
            target = _write_model(directory)
            process, url = _start_server(directory, max_batch, prefill, cache)
            target += (
                f"; server --max-batch {max_batch} --prefill {prefill}, ready in {time.perf_counter() - start:.0f} s"
            )
            try:
                rounds = measure(url, None)
            finally:
                process.terminate()  # SIGTERM: the server drains and exits
                process.wait(120)
    print(machine)
    spread = f"{lengths[0]}" if lengths[0] == lengths[1] else f"{lengths[0]} to {lengths[1]} (uniform)"
    print(
        f"{target}\n/v1/completions, streamed: prompts of ~12 tokens, max_tokens {spread}, temperature 0.8; each "
        f"client sends its next request when answered; measured: a {args.seconds:g} s window that opens after "
        f"{args.warmup:g} s of the same load (requests sent, and tokens that arrived, inside it); TTFT: time to a "
        f"request's first token; ITL: time between its tokens; occupancy: the mean share of busy decode slots\n"
    )
    header = (
        "clients",
        "requests",
        "gen tokens/s",
        "TTFT p50 s",
        "TTFT p99 s",
        "ITL p50 ms",
        "ITL p99 ms",
        "occupancy",
    )
    pct = Round.percentile
    body = [
        (
            str(r.clients),
            str(r.requests),
            f"{r.tokens / r.seconds:,.0f}",
            f"{pct(r.ttft, 0.5):.3f}",
            f"{pct(r.ttft, 0.99):.3f}",
            f"{1000 * pct(r.itl, 0.5):.1f}",
            f"{1000 * pct(r.itl, 0.99):.1f}",
            f"{r.occupancy:.0%}",
        )
        for r in rounds
    ]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(header)]
    for line in (header, ["-" * w for w in widths], *body):
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))
    single = next((r for r in rounds if r.clients == 1), None)
    if single is not None and single.tokens:
        lone_ttft = pct(single.ttft, 0.5)
        for r in rounds:
            if r.clients > 1:
                print(
                    f"{r.clients} clients: {r.tokens / single.tokens:.1f}x the generated tokens/s of 1 client; "
                    f"TTFT p99 {pct(r.ttft, 0.99) / lone_ttft:.1f}x a lone request's (p50 of 1 client)"
                )
