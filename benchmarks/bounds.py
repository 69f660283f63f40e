"""The machine's own limits, measured in the benchmark's process, and the speed they allow a GPT-J.

Two figures bound every benchmark here: how fast one core set streams a weight-sized array from
memory (a matrix-vector product reads each byte once and does 2 FLOPs per 4 bytes, so memory is all
it waits for) and how fast it multiplies large matrices (the practical FLOP/s ceiling of JAX's
matmul in a given dtype). A benchmark's figure divided by the bound its work implies is the
fraction of the machine it uses, which unlike a ratio against PyTorch does not move with the CPU.
"""

from __future__ import annotations

import dataclasses
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


def streaming_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of a float32 matrix-vector product over a ``nbytes`` matrix: memory streaming speed.

    Size it like the model's weights, so that it sees the same caches as decoding does.
    """
    cols = 1024
    rows = max(1, nbytes // (4 * cols))
    w = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (cols,), jnp.float32)
    matvec = jax.jit(lambda w, x: w @ x)
    return rows * cols * 4 / _best_seconds(lambda: matvec(w, x).block_until_ready(), repeats)


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
    config: ModelConfig, batch: int, context: float, bandwidth: float, flops: float, itemsize: int = 4
) -> Bound:
    """Tokens/s of one-token decode steps at ``batch`` rows attending to ``context`` cached tokens.

    A step reads every matmul weight once, each row's embedding and its K/V cache, and does 2 FLOPs
    per weight per row plus the attention's 4·d_model per cached token per layer; at best the step
    takes the longer of its reads at ``bandwidth`` and its arithmetic at ``flops`` (a roofline).
    With ``config.quantize == "int8"`` the block projections are read at one byte per weight, and
    with ``config.kv_cache == "int8"`` the cache at one byte per entry plus a float32 scale per head.
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
        batch / max(memory_s, compute_s), "memory" if memory_s >= compute_s else "compute", step_bytes, step_flops
    )


def train_bound(config: ModelConfig, seq_len: int, flops: float) -> Bound:
    """Tokens/s of training steps if every FLOP (6·N plus attention, per token) ran at ``flops``."""
    per_token = config.flops_per_token(seq_len)
    return Bound(flops / per_token, "compute", float("nan"), per_token)


def describe_limits(bandwidth: float, ceilings: dict[str, float], weight_bytes: int) -> str:
    """One line per measured limit, as the benchmarks print them."""
    lines = [f"  streaming: {bandwidth / 1e9:.1f} GB/s (float32 matvec over {weight_bytes / 1e6:.0f} MB)"]
    lines += [f"  matmul ceiling, {name}: {value / 1e9:.1f} GFLOP/s" for name, value in ceilings.items()]
    return "\n".join(lines)


def weight_bytes(config: ModelConfig, itemsize: int = 4) -> int:
    return int(np.int64(config.param_count()) * itemsize)
