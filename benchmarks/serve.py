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
``serve()`` on it in a child process (``--max-batch`` decode slots, ``--decode-steps`` steps a call, and
the compilation cache on in an empty directory, as a first ``gptj-serve`` starts: the "ready in" time
is a cold start; ``--compile-cache DIR`` keeps the programs in DIR for the next run), measures, and
stops it with SIGTERM. With ``--shared-prefix N`` every request starts with the same N token ids
(then a few of its own), and it measures a server with the prefix cache and then one without, side
by side. With ``--adapters 0,1,8,32`` it measures a server per count, holding that
many random rank-``ADAPTER_RANK`` LoRA adapters (``--adapter NAME=DIR``), each request naming one
of them at random (0: the base alone), and prints each one's tokens/s and decode step time side by
side, with the bytes on the device that an adapter takes. With a model this size one decode step costs far more than the
HTTP around it, and a step of 32 slots far less than 32 single steps: continuous batching is what
the table shows.

Beside each row it prints the bound for that occupancy (for the server it starts; with ``--url`` it
has no copy of the model): the mean busy slots (occupancy × slots) ÷ the time of one decode step of
that many busy slots *alone*, timed in this process once the server has stopped: the same model and
slots, rows filled as the round's requests fill them, ``ALONE_STEPS`` steps a call so that no host
work sits between steps. A server that lost no time between steps (dispatch, admissions, reading
tokens, HTTP) would generate that many tokens/s; the share reached is what the host leaves of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Callable, Iterator

import flax.linen as nn
import httpx
import jax
import jax.numpy as jnp

from benchmarks.common import BENCH_MODEL, REPO, load_average, machine_summary, xla_flags_with_devices
from gptj_flax import checkpoint
from gptj_flax.checkpoint import Checkpointer
from gptj_flax.cli.compile_cache import unwritable
from gptj_flax.config import Config, LoraConfig, ModelConfig, TrainConfig
from gptj_flax.convert import lora as lora_lib
from gptj_flax.data import train_bpe_tokenizer
from gptj_flax.data.corpus import stdlib_sources
from gptj_flax.model import GPTJ, AdapterSlots, abstract_adapter_slots, abstract_adapters
from gptj_flax.sampling import load
from gptj_flax.sampling.samplers import SamplingParams
from gptj_flax.sampling.slots import MAX_PREFILL_ROWS, Request
from gptj_flax.serving.schemas import MAX_LOGPROBS
from gptj_flax.serving.settings import DEFAULT_DECODE_STEPS, MAX_DECODE_STEPS, env_name

# Prompts stay under 16 tokens: the server's warm-up compiles that prompt bucket for every batch size.
PROMPT_WORDS = ("def", "return", "import", "class", "self", "for", "while", "print", "yield", "lambda")
TOKENIZER_VOCAB = 4096
# Decode steps a call when the step is timed alone: the host's share of a call, spread over this
# many steps, is a rounding error beside them.
ALONE_STEPS = 16
OWN_TOKENS = 6  # a request's own tokens after a shared prefix
TEMPERATURE = 0.8
ADAPTER_RANK, ADAPTER_TARGETS = 16, ("q_proj", "v_proj")  # --adapters: the example, a q/v adapter


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
        "--shared-prefix",
        type=int,
        default=0,
        help="every request starts with the same N tokens (then a few of its own): the benchmark runs a server "
        "with the prefix cache and one without, and prints both side by side (not with --url; default 0: "
        "prompts of six words, one server)",
    )
    parser.add_argument(
        "--adapters",
        help=f"comma-separated adapter counts such as 0,1,8,32: a server per count holding that many random rank-"
        f"{ADAPTER_RANK} {'/'.join(ADAPTER_TARGETS)} LoRA adapters, each request naming one at random (0: the "
        "base); prints tokens/s and the decode step time side by side (not with --url or --shared-prefix)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        help=f"--decode-steps of the server it starts (not with --url; default {DEFAULT_DECODE_STEPS}, the server's)",
    )
    parser.add_argument(
        "--max-len",
        type=int,
        help="--max-len of the server it starts: each slot's tokens (not with --url; default the model's context, "
        f"{BENCH_MODEL.max_len}); a shorter one compiles fewer programs",
    )
    parser.add_argument(
        "--prefill",
        choices=("beside", "between"),
        help="--prefill of the server it starts (not with --url; default between; with beside the server "
        "process gets two CPU devices, one for the decode slots and one to prefill on)",
    )
    parser.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="$GPTJ_FLAX_CACHE of the servers it starts, so that a second run loads the programs the first "
        "compiled: 'ready in' is then a warm start (not with --url; default: an empty directory for each "
        "server, a cold start)",
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
    slot_steps: float = math.nan  # decode steps run in the window, times the server's slots

    @staticmethod
    def percentile(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def _prompt(i: int) -> str:
    return " ".join(PROMPT_WORDS[(i + k) % len(PROMPT_WORDS)] for k in range(6))


def _prompts(shared: int) -> Callable[[int], str | list[int]]:
    """Request ``i``'s prompt: six words; or, with a ``shared`` prefix, the same ``shared`` token ids
    then six of its own."""
    if not shared:
        return _prompt
    prefix = random.Random(0).choices(range(TOKENIZER_VOCAB), k=shared)
    return lambda i: prefix + random.Random(i + 1).choices(range(TOKENIZER_VOCAB), k=OWN_TOKENS)


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
    http: httpx.AsyncClient,
    clients: int,
    warmup: float,
    seconds: float,
    lengths: tuple[int, int],
    seed: int,
    prompt: Callable[[int], str | list[int]] = _prompt,
    models: list[str] | None = None,
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
                "prompt": prompt(c + r),
                "max_tokens": draws.randint(*lengths),
                "temperature": TEMPERATURE,
                "seed": (seed + 1000 * c + r) % 2**31,
            }
            if models:
                body["model"] = draws.choice(models)
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
    return dataclasses.replace(_window(results, clients, opens, closes, occupancy), slot_steps=slot_steps)


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
    url: str,
    api_key: str | None,
    concurrency: list[int],
    warmup: float,
    seconds: float,
    lengths: tuple[int, int],
    prompt: Callable[[int], str | list[int]] = _prompt,
    models: list[str] | None = None,
) -> list[Round]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # one connection per client, and one more for the /metrics reads that open and close the window:
    # sharing the clients' connections, those reads waited for a free one and could miss the window
    limits = httpx.Limits(max_connections=max(concurrency) + 1)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as http:
        return [
            await _round(http, clients, warmup, seconds, lengths, seed=i, prompt=prompt, models=models)
            for i, clients in enumerate(concurrency)
        ]


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


def _steady_new_tokens(lengths: tuple[int, int]) -> int:
    """Tokens to generate in each row so that the rows' mean context over the run is the steady
    state's: a busy slot-step belongs to a request of ``m`` tokens in proportion to ``m``, at a
    uniform point of it, so its mean position is E[m²] / 2E[m]; a row run for E[m²] / E[m] tokens has
    the same mean."""
    values = range(lengths[0], lengths[1] + 1)
    return max(2, round(sum(m * m for m in values) / sum(values)))


def _time_steps(slots, rows: int, prompt: list[int], new_tokens: int, repeats: int = 2) -> float:
    """Seconds per decode step of ``rows`` busy slots (the first ones), each generating
    ``new_tokens`` tokens, nothing else running: best of ``repeats`` after an untimed run (it compiles)."""
    best = math.inf
    for attempt in range(repeats + 1):
        sampling = SamplingParams.build(1, temperature=TEMPERATURE)
        requests = [Request(list(prompt), new_tokens, -1, seed, sampling) for seed in range(rows)]
        for first in range(0, rows, MAX_PREFILL_ROWS):
            batch = requests[first : first + MAX_PREFILL_ROWS]
            slots.admit(batch, list(range(first, first + len(batch))))
        slots.wait()
        start, generated = time.perf_counter(), 1  # the first token came with the prompt's prefill
        while generated < new_tokens:
            generated = int(slots.decode([], ALONE_STEPS, rows - 1).num_generated.max())
        seconds = (time.perf_counter() - start) / (new_tokens - 1)
        slots.free(list(range(rows)))
        if attempt:
            best = min(best, seconds)
    return best


def _alone_step_seconds(
    checkpoint: str, slots: int, length: int, busy: list[int], lengths: tuple[int, int]
) -> tuple[dict[int, float], int, int]:
    """The decode step time alone of each count of busy slots in ``busy``, on the server's model
    and slots; with the prompt's tokens and the tokens each row generated."""
    model = load(checkpoint)
    decode_slots = model.slots(slots=slots, length=length, steps=ALONE_STEPS, top_logprobs=MAX_LOGPROBS)
    prompt = model.encode(_prompt(0))
    new_tokens = min(_steady_new_tokens(lengths), length - len(prompt))
    times = {n: _time_steps(decode_slots, n, prompt, new_tokens) for n in sorted(set(busy))}
    return times, len(prompt), new_tokens


@contextlib.contextmanager
def _server_cache(directory: str | None) -> Iterator[str]:
    """The $GPTJ_FLAX_CACHE of a server this starts: ``--compile-cache``, else a new empty directory
    (removed after), so that "ready in" is a cold start."""
    if directory is not None:
        yield os.path.abspath(directory)
        return
    with tempfile.TemporaryDirectory(prefix="bench-serve-cache-") as cache:
        yield cache


def _cache_note(directory: str | None) -> str:
    """What "ready in" adds when the start may have been warm."""
    return "" if directory is None else f" (compilation cache under {directory})"


def _start_server(checkpoint: str, settings: dict, cache: str) -> tuple[subprocess.Popen, str]:
    """``serve()`` of this checkout in a child process (no GIL shared with the clients), configured by
    environment variables as a deployment would be, with the compilation cache as gptj-serve has it,
    under ``cache`` (an empty directory: a cold start)."""
    port = _free_port()
    prefill = settings["prefill"]
    settings = {"checkpoint": checkpoint, "port": port, **settings, "log_level": "warning"}
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, **{env_name(name): str(v) for name, v in settings.items()}}
    env = {
        k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR" and not k.startswith("JAX_PERSISTENT_CACHE")
    }
    env["GPTJ_FLAX_CACHE"] = cache
    if prefill == "beside":  # on the CPU, a spare device to prefill on; the decode slots keep the first
        env["XLA_FLAGS"] = xla_flags_with_devices(env.get("XLA_FLAGS", ""), 2)
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
    if process.poll() is not None:
        raise RuntimeError(
            f"the benchmark server exited with status {process.returncode} before it was ready (its error is above)"
        )
    process.kill()
    raise RuntimeError("the benchmark server did not become ready in 30 minutes")


@dataclasses.dataclass
class _Bounds:
    """Each round's bound (tokens/s; nan where none was measured) and how it was measured."""

    tokens_per_s: list[float]
    how: str


def _bounds(rounds: list[Round], checkpoint: str, slots: int, length: int, lengths: tuple[int, int]) -> _Bounds:
    """Each round's mean busy slots ÷ the step time alone of that many busy slots."""
    busy = {r.clients: r.occupancy * slots for r in rounds if r.occupancy == r.occupancy}
    counts = {clients: max(1, round(b)) for clients, b in busy.items()}
    times, prompt, new_tokens = _alone_step_seconds(checkpoint, slots, length, list(counts.values()), lengths)
    steps = ", ".join(f"{n} busy {1000 * t:.1f} ms" for n, t in times.items())
    how = (
        f"bound: mean busy slots (occupancy x {slots}) / the decode step time of that many busy slots alone, timed "
        f"in this process after the server stopped ({ALONE_STEPS} steps a call, rows of {prompt} prompt tokens "
        f"generating {new_tokens}, the steady state's mean context; best of 2): {steps}"
    )
    return _Bounds([busy[r.clients] / times[counts[r.clients]] if r.clients in busy else math.nan for r in rounds], how)


def _server_settings(args: argparse.Namespace) -> dict:
    """The settings of the server the benchmark starts, checked; {} with --url."""
    if args.url:
        if args.shared_prefix or any(
            v is not None
            for v in (args.max_batch, args.prefill, args.decode_steps, args.max_len, args.adapters, args.compile_cache)
        ):
            raise SystemExit(
                "error: --max-batch, --prefill, --decode-steps, --max-len, --shared-prefix, --adapters and "
                "--compile-cache set up the servers the benchmark starts; with --url the server is yours"
            )
        return {}
    own = {
        "max_batch": 32 if args.max_batch is None else args.max_batch,
        "prefill": args.prefill or "between",
        "decode_steps": DEFAULT_DECODE_STEPS if args.decode_steps is None else args.decode_steps,
        "max_len": BENCH_MODEL.max_len if args.max_len is None else args.max_len,
    }
    if not 1 <= own["decode_steps"] <= MAX_DECODE_STEPS:
        raise SystemExit(f"error: --decode-steps must be in 1..{MAX_DECODE_STEPS}, got {own['decode_steps']}")
    if not 16 <= own["max_len"] <= BENCH_MODEL.max_len:
        raise SystemExit(f"error: --max-len must be in 16..{BENCH_MODEL.max_len}, got {own['max_len']}")
    if args.compile_cache is not None:
        why = unwritable(os.path.join(args.compile_cache, "jax")) if args.compile_cache else "an empty path"
        if why:
            raise SystemExit(
                f"error: --compile-cache {args.compile_cache!r}: cannot hold the compilation cache ({why})"
            )
    return own


def _check(args: argparse.Namespace) -> tuple[list[int], tuple[int, int], dict]:
    """The client counts, the ``max_tokens`` range and the server's settings; one ``error:`` line for
    anything out of range."""
    concurrency = _counts(args.concurrency)
    if concurrency is None or min(concurrency) < 1:
        raise SystemExit(f"error: --concurrency must be client counts >= 1, such as 1,8,32; got {args.concurrency!r}")
    lengths = _lengths(args.new_tokens)
    if not (0 < args.seconds < math.inf and 0 <= args.warmup < math.inf):
        raise SystemExit("error: --seconds must be a finite number > 0 and --warmup a finite number >= 0")
    settings = _server_settings(args)
    if args.adapters is not None:
        counts = _counts(args.adapters)
        if counts is None or min(counts) < 0 or args.shared_prefix or settings.get("prefill") == "beside":
            raise SystemExit(
                f"error: --adapters must be adapter counts >= 0 such as 0,1,8,32, without --shared-prefix or "
                f"--prefill beside; got {args.adapters!r}"
            )
    if settings and lengths[1] + 16 > settings["max_len"]:
        raise SystemExit(f"error: --max-len must hold a prompt (up to 16 tokens) and --new-tokens' {lengths[1]}")
    context = settings.get("max_len", BENCH_MODEL.max_len)
    room = context - OWN_TOKENS - lengths[1]
    if not 0 <= args.shared_prefix <= room:
        raise SystemExit(
            f"error: --shared-prefix must be in [0, {room}] (the server's context of {context} less "
            f"{OWN_TOKENS} tokens of each request's own and the most new tokens), got {args.shared_prefix}"
        )
    return concurrency, lengths, settings


def _own_servers(
    args: argparse.Namespace, settings: dict, lengths: tuple[int, int], measure: Callable[[str], list[Round]]
) -> tuple[str, list[list[Round]], _Bounds | None]:
    """Measure servers this starts on a random model: with a shared prefix, one with the prefix cache
    and then one without (no bounds then). A description of the setup, each server's rounds, the bounds."""
    results, bounds = [], None
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as directory:
        target = _write_model(directory)
        for prefix_cache in (True, False) if args.shared_prefix else (True,):
            with _server_cache(args.compile_cache) as cache:
                start = time.perf_counter()
                process, url = _start_server(directory, {**settings, "no_prefix_cache": not prefix_cache}, cache)
                target += "; server " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items())
                target += "" if prefix_cache else " --no-prefix-cache"
                target += f", ready in {time.perf_counter() - start:.0f} s{_cache_note(args.compile_cache)}"
                try:
                    results.append(measure(url))
                finally:
                    process.terminate()  # SIGTERM: the server drains and exits
                    process.wait(120)
        if not args.shared_prefix:
            bounds = _bounds(results[0], directory, settings["max_batch"], settings["max_len"], lengths)
    return target, results, bounds


def _write_adapters(base: str, directory: str, n: int) -> dict[str, str]:
    """``n`` LoRA runs of random rank-``ADAPTER_RANK`` adapters for the base at ``base``, as training
    leaves them (the base's identity recorded); name → directory."""
    lora = LoraConfig(rank=ADAPTER_RANK, alpha=2.0 * ADAPTER_RANK, targets=ADAPTER_TARGETS)
    shapes = nn.meta.unbox(abstract_adapters(BENCH_MODEL, lora))
    meta = {checkpoint.LORA_BASE_KEY: lora_lib.identify_base(base).to_json()}
    run = Config(model=BENCH_MODEL, train=TrainConfig(batch_size=1, lora=lora))
    paths = {}
    for i in range(n):
        key = jax.random.key(i)
        adapters = jax.tree.map(lambda s, k=key: 0.02 * jax.random.normal(k, s.shape, s.dtype), shapes)
        paths[f"adapter-{i}"] = path = os.path.join(directory, f"adapter-{i}")
        saver = Checkpointer(path)
        saver.save(0, params=adapters, config=run, meta=meta)
        saver.close()
    return paths


def adapter_bytes(config: ModelConfig = BENCH_MODEL) -> int:
    """Bytes on the device one adapter of ``--adapters`` takes in a server's adapter bank."""
    shapes = jax.tree.leaves(abstract_adapter_slots(config, AdapterSlots(2, ADAPTER_RANK, ADAPTER_TARGETS)))
    return sum(s.size * s.dtype.itemsize for s in shapes) // 2


def _adapter_servers(
    settings: dict, counts: list[int], measure: Callable[..., list[Round]], compile_cache: str | None
) -> tuple[str, list[tuple[int, list[Round]]]]:
    """A server per count of adapters on a random model, each request naming one of them at random
    (``compile_cache``: the servers' $GPTJ_FLAX_CACHE, None for a new empty one each)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as base, tempfile.TemporaryDirectory() as adapters:
        target = _write_model(base)
        paths = _write_adapters(base, adapters, max(counts))
        target += "; server " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items())
        for n in counts:
            names = list(paths)[:n]
            served = dict(settings)
            if n:
                served.update(adapter=",".join(f"{name}={paths[name]}" for name in names), max_adapters=n)
            with _server_cache(compile_cache) as cache:
                start = time.perf_counter()
                process, url = _start_server(base, served, cache)
                target += f"; {n} adapters: ready in {time.perf_counter() - start:.0f} s{_cache_note(compile_cache)}"
                try:
                    results.append((n, measure(url, None, names or None)))
                finally:
                    process.terminate()
                    process.wait(120)
    return target, results


def _print_adapters(results: list[tuple[int, list[Round]]], slots: int) -> None:
    """Each count of adapters' tokens/s and decode step time, by concurrency, beside the base alone's."""
    base = {r.clients: r.tokens / r.seconds for n, rounds in results if n == 0 for r in rounds}
    pct = Round.percentile
    body = [
        (
            str(n),
            str(r.clients),
            f"{r.tokens / r.seconds:,.0f}",
            f"{r.tokens / r.seconds / base[r.clients]:.0%}" if base.get(r.clients) else "n/a",
            f"{1000 * r.seconds * slots / r.slot_steps:.1f}" if r.slot_steps else "n/a",
            f"{r.occupancy:.0%}",
            f"{pct(r.ttft, 0.5):.3f}",
        )
        for n, rounds in results
        for r in rounds
    ]
    header = ("adapters", "clients", "gen tokens/s", "of base", "step ms", "occupancy", "TTFT p50 s")
    _print_cells(header, body)
    print(
        f"step ms: the window's length / the decode steps run in it; each adapter (rank {ADAPTER_RANK} on "
        f"{', '.join(ADAPTER_TARGETS)}) takes {adapter_bytes():,} bytes on the device"
    )


def run(args: argparse.Namespace) -> None:
    concurrency, lengths, settings = _check(args)
    machine = machine_summary()  # before the server it starts adds its own load
    prompt = _prompts(args.shared_prefix)

    def measure(url: str, api_key: str | None = None, models: list[str] | None = None) -> list[Round]:
        return asyncio.run(_measure(url, api_key, concurrency, args.warmup, args.seconds, lengths, prompt, models))

    if args.adapters is not None:
        target, by_count = _adapter_servers(settings, _counts(args.adapters) or [], measure, args.compile_cache)
        print(f"{machine}\n{target}\n/v1/completions, streamed, each request naming one adapter at random\n")
        _print_adapters(by_count, settings["max_batch"])
        print(f"load average after: {load_average():.2f}")
        return
    if args.url:
        machine = f"clients' {machine} (the server's may differ)"
        target, results = f"server {args.url}", [measure(args.url.rstrip("/"), args.api_key)]
        bounds = _Bounds([math.nan] * len(results[0]), "bound: not measured (with --url the benchmark has no model)")
    else:
        target, results, bounds = _own_servers(args, settings, lengths, measure)
    print(machine)
    spread = f"{lengths[0]}" if lengths[0] == lengths[1] else f"{lengths[0]} to {lengths[1]} (uniform)"
    prompts = (
        f"prompts of the same {args.shared_prefix} token ids and {OWN_TOKENS} of each request's own"
        if args.shared_prefix
        else "prompts of six words" + ("" if args.url else " (6 or 7 tokens of the benchmark's model)")
    )
    print(
        f"{target}\n/v1/completions, streamed: {prompts}, max_tokens {spread}, temperature {TEMPERATURE}; each "
        f"client sends its next request when answered; measured: a {args.seconds:g} s window that opens after "
        f"{args.warmup:g} s of the same load (requests sent, and tokens that arrived, inside it); TTFT: time to a "
        f"request's first token; ITL: time between its tokens; occupancy: the mean share of busy decode slots\n"
    )
    if bounds is None:
        _print_compared(*results)
    else:
        _print_table(results[0], bounds)
    print(f"load average after: {load_average():.2f}")


def _print_cells(header: tuple[str, ...], body: list[tuple[str, ...]]) -> None:
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(header)]
    for line in (header, ["-" * w for w in widths], *body):
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))


def _share(tokens_per_s: float, bound: float) -> str:
    """The share of the bound reached; over 100% the bound did not bound: a failed measurement."""
    if bound != bound:
        return "n/a"
    share = tokens_per_s / bound
    return f"{share:.0%}" if share <= 1 else "failed"


def _print_table(rounds: list[Round], bounds: _Bounds) -> None:
    header = (
        "clients",
        "requests",
        "gen tokens/s",
        "bound tokens/s",
        "of bound",
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
            "n/a" if bound != bound else f"{bound:,.0f}",
            _share(r.tokens / r.seconds, bound),
            f"{pct(r.ttft, 0.5):.3f}",
            f"{pct(r.ttft, 0.99):.3f}",
            f"{1000 * pct(r.itl, 0.5):.1f}",
            f"{1000 * pct(r.itl, 0.99):.1f}",
            f"{r.occupancy:.0%}",
        )
        for r, bound in zip(rounds, bounds.tokens_per_s, strict=True)
    ]
    _print_cells(header, body)
    print(bounds.how)
    if any(row[4] == "failed" for row in body):
        print(
            "failed: generated tokens/s above the bound means the bound was not one: the step alone was timed "
            "at a busier moment than the server ran (a shared machine), or the occupancy read from /metrics is off"
        )
    single = next((r for r in rounds if r.clients == 1), None)
    if single is not None and single.tokens:
        lone_ttft = pct(single.ttft, 0.5)
        for r in rounds:
            if r.clients > 1:
                print(
                    f"{r.clients} clients: {r.tokens / single.tokens:.1f}x the generated tokens/s of 1 client; "
                    f"TTFT p99 {pct(r.ttft, 0.99) / lone_ttft:.1f}x a lone request's (p50 of 1 client)"
                )


def _print_compared(cached: list[Round], plain: list[Round]) -> None:
    """Each concurrency's tokens/s and TTFT with the prefix cache and without, side by side."""
    pct = Round.percentile
    header = (
        "clients",
        "gen tokens/s cache",
        "no cache",
        "TTFT p50 s cache",
        "no cache",
        "TTFT p99 s cache",
        "no cache",
    )
    body = [
        (
            str(a.clients),
            f"{a.tokens / a.seconds:,.0f}",
            f"{b.tokens / b.seconds:,.0f}",
            f"{pct(a.ttft, 0.5):.3f}",
            f"{pct(b.ttft, 0.5):.3f}",
            f"{pct(a.ttft, 0.99):.3f}",
            f"{pct(b.ttft, 0.99):.3f}",
        )
        for a, b in zip(cached, plain, strict=True)
    ]
    _print_cells(header, body)
    for a, b in zip(cached, plain, strict=True):
        if a.ttft and b.ttft:
            print(
                f"{a.clients} clients: TTFT p50 {pct(b.ttft, 0.5) / pct(a.ttft, 0.5):.1f}x shorter with the cache, "
                f"{(a.tokens / a.seconds) / max(b.tokens / b.seconds, 1e-9):.1f}x the generated tokens/s"
            )
