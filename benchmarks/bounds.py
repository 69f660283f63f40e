"""The machine's own limits, measured in the benchmark's process, and the speed they allow a GPT-J.

Two figures bound every benchmark here: how fast the cores read a model's weights as a decode step
does (a matrix-vector product reads each byte once and does 2 FLOPs per 4 bytes, so reading is all
it waits for) and how fast they multiply large matrices (the practical FLOP/s ceiling of JAX's
matmul in a given dtype). A benchmark's figure divided by the bound its work implies is the
fraction of the machine it uses, which unlike a ratio against PyTorch does not move with the CPU.

Where the weights fit the last-level cache, decoding step after step reads them from there, not
from memory: the read speed is then measured the same way, over the same weights again and again,
warmed (a cache bound); where they do not, the same reads stream from memory (a memory bound).
A figure over its bound means the bound was not measured as the work reads, and is reported as
a failed measurement, not as a share.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from gptj_flax.config import ModelConfig, jnp_dtype


def _best_seconds(fn, repeats: int) -> float:
    fn()  # compile and warm the caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


CPU_CACHES = "/sys/devices/system/cpu/cpu0/cache"
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def _size_bytes(text: str) -> int | None:
    """``32768K``, ``32 MiB``, ``300M`` → bytes; None where it is no size."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text, re.IGNORECASE)
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()]) if match else None


def last_level_cache_bytes(caches: str = CPU_CACHES) -> int | None:
    """The size of the last-level cache the first CPU uses: sysfs's highest cache level, or
    ``lscpu``'s (its total over instances, divided by them); None where neither says."""
    sizes = {}
    try:
        for entry in os.listdir(caches):
            with open(os.path.join(caches, entry, "level")) as level, open(os.path.join(caches, entry, "size")) as size:
                sizes[int(level.read())] = _size_bytes(size.read())
    except (OSError, ValueError):
        sizes = {}
    if sizes and sizes[max(sizes)]:
        return sizes[max(sizes)]
    try:
        listing = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10, env={**os.environ, "LC_ALL": "C"}
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return _lscpu_last_level(listing.stdout)


def _lscpu_last_level(listing: str) -> int | None:
    """The last-level cache of one instance, from ``lscpu``'s ``L3 cache: 32 MiB (1 instance)`` lines."""
    found = {}
    for level, size, instances in re.findall(
        r"^L(\d)\S* cache:\s*([^(\n]+?)\s*(?:\((\d+) instances?\))?$", listing, re.M
    ):
        total = _size_bytes(size)
        if total:
            found[int(level)] = total // int(instances or 1)
    return found[max(found)] if found else None


@dataclasses.dataclass(frozen=True)
class ReadSpeed:
    """How fast a decode step's weights are read: bytes/s, and from where ("cache" or "memory")."""

    bytes_per_s: float
    where: str
    weight_bytes: int
    cache_bytes: int | None

    def describe(self) -> str:
        cache = "unknown" if self.cache_bytes is None else f"{self.cache_bytes / 2**20:.0f} MiB"
        fits = "fit" if self.where == "cache" else "do not fit"
        return (
            f"  weights read at {self.bytes_per_s / 1e9:.1f} GB/s from {self.where}: float32 matvecs over the "
            f"decode step's {self.weight_bytes / 1e6:.0f} MB of weight matrices, again and again, warmed (they "
            f"{fits} the {cache} last-level cache): a {self.where} bound"
        )


def _weight_matrices(config: ModelConfig) -> list[tuple[int, int]]:
    """The (in, out) shapes of the matrices a decode step multiplies a row by, in order."""
    d, f = config.d_model, config.ff_dim
    return [(d, d)] * 4 * config.n_layers + [(d, f), (f, d)] * config.n_layers + [(d, config.vocab_size)]


def decode_read_speed(config: ModelConfig, repeats: int = 10, cache_bytes: int | None = -1) -> ReadSpeed:
    """The speed a batch-1 decode step of ``config`` can read its weight matrices: matvecs over
    matrices of the same shapes (float32), each feeding the next as a step's do, run again and
    again over the same matrices after a warm-up; ``cache_bytes`` (default: the machine's last
    level, :func:`last_level_cache_bytes`) says whether they stay in the cache or stream from memory."""
    cache_bytes = last_level_cache_bytes() if cache_bytes == -1 else cache_bytes
    shapes = _weight_matrices(config)
    keys = jax.random.split(jax.random.key(0), len(shapes))
    weights = [jax.random.normal(k, s, jnp.float32) / np.sqrt(s[0]) for k, s in zip(keys, shapes, strict=True)]
    x = jax.random.normal(jax.random.key(1), (config.d_model,), jnp.float32)

    @jax.jit
    def matvecs(weights, x):
        for w in weights:  # each shape's input is the one before's output
            x = x @ w
        return x.sum()  # every output used: no part of a matrix goes unread

    nbytes = sum(a * b for a, b in shapes) * 4
    seconds = _best_seconds(lambda: matvecs(weights, x).block_until_ready(), repeats)
    where = "cache" if cache_bytes is not None and nbytes <= cache_bytes else "memory"
    return ReadSpeed(nbytes / seconds, where, nbytes, cache_bytes)


def matmul_ceiling(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n×n by n×n matmul in ``dtype`` (accumulating as XLA does for that dtype)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(jnp_dtype(dtype))
    mm = jax.jit(lambda a: a @ a)
    return 2 * n**3 / _best_seconds(lambda: mm(a).block_until_ready(), repeats)


@dataclasses.dataclass(frozen=True)
class Bound:
    """The best tokens/s the work allows, and which limit sets it."""

    tokens_per_s: float
    limit: str  # "memory" or "compute"
    bytes_per_step: float
    flops_per_step: float

    def reached(self, tokens_per_s: float) -> float:
        return tokens_per_s / self.tokens_per_s


def _matmul_params(config: ModelConfig) -> int:
    return config.param_count() - config.vocab_size * config.d_model  # the embedding is a lookup


def _block_projection_params(config: ModelConfig) -> int:
    d, f = config.d_model, config.ff_dim
    return config.n_layers * (4 * d * d + 2 * d * f)


def decode_bound(
    config: ModelConfig,
    batch: int,
    context: float,
    bandwidth: float,
    flops: float,
    itemsize: int = 4,
    reads: str = "memory",
) -> Bound:
    """Tokens/s of one-token decode steps at ``batch`` rows attending to ``context`` cached tokens.

    A step reads every matmul weight once, each row's embedding and its K/V cache, and does 2 FLOPs
    per weight per row plus the attention's 4·d_model per cached token per layer; at best the step
    takes the longer of its reads at ``bandwidth`` and its arithmetic at ``flops`` (a roofline).
    With ``config.quantize == "int8"`` the block projections are read at one byte per weight, and
    with ``config.kv_cache == "int8"`` the cache at one byte per entry plus a float32 scale per head.
    ``reads``: where ``bandwidth`` reads from (a :class:`ReadSpeed`'s ``where``), the limit's name
    when reading is the longer.
    """
    per_token = config.d_model + 4 * config.n_heads if config.kv_cache == "int8" else config.d_model * itemsize
    kv_bytes = 2 * config.n_layers * batch * context * per_token
    weight_bytes = _matmul_params(config) * itemsize
    if config.quantize == "int8":
        weight_bytes -= _block_projection_params(config) * (itemsize - 1)
    step_bytes = weight_bytes + batch * config.d_model * itemsize + kv_bytes
    step_flops = batch * (2.0 * _matmul_params(config) + 4.0 * config.n_layers * config.d_model * context)
    memory_s, compute_s = step_bytes / bandwidth, step_flops / flops
    return Bound(
        batch / max(memory_s, compute_s), reads if memory_s >= compute_s else "compute", step_bytes, step_flops
    )


FAILED = "failed"
FAILED_WHY = (
    "failed: a figure over its bound means the bound was not measured as the work reads and computes (its "
    "read speed or ceiling timed at a busier moment of a shared machine, or read from a slower level of memory "
    "than the work did), so no share is given"
)


def share(tokens_per_s: float, bound: Bound) -> str:
    """The share of ``bound`` reached, as printed; over 100% the bound did not bound: ``FAILED``."""
    reached = bound.reached(tokens_per_s)
    return f"{100 * reached:.0f}%" if reached <= 1 else FAILED


def train_bound(config: ModelConfig, seq_len: int, flops: float) -> Bound:
    """Tokens/s of training steps if every FLOP (6·N plus attention, per token) ran at ``flops``."""
    per_token = config.flops_per_token(seq_len)
    return Bound(flops / per_token, "compute", float("nan"), per_token)


def describe_limits(read: ReadSpeed, ceilings: dict[str, float]) -> str:
    """One line per measured limit, as the benchmarks print them."""
    lines = [read.describe()]
    lines += [f"  matmul ceiling, {name}: {value / 1e9:.1f} GFLOP/s" for name, value in ceilings.items()]
    return "\n".join(lines)


def weight_bytes(config: ModelConfig, itemsize: int = 4) -> int:
    return int(np.int64(config.param_count()) * itemsize)
