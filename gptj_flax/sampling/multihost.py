"""Sampling and scoring on several processes (a multi-host slice), as JAX's multi-controller model runs them.

Every process makes the same call with the same arguments. Host inputs become global arrays that
each process fills with its own devices' pieces of the (identical) full value, and results come
back whole to every process, so every host-side decision that follows (stop strings, when to stop
decoding) is taken alike everywhere. Before any program runs, each call compares a fingerprint of
its arguments across processes, so processes called differently fail with an error instead of
running mismatched programs until one of them hangs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding

from gptj_flax.errors import GptjFlaxError, describe
from gptj_flax.sampling.samplers import SamplingError

# what process 0 read, for read_on_process_0
NOTHING, TEXT, ERROR = 0, 1, 2


def to_device(value, sharding: Sharding) -> jax.Array:
    """A global array of ``value`` (the same full value on every process) laid out as ``sharding``."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def to_host(tree: Any) -> Any:
    """Every array of ``tree`` whole, as numpy, on every process (gathered from the others if need be)."""
    leaves = jax.tree.leaves(tree)
    if all(x.is_fully_addressable or x.is_fully_replicated for x in leaves):
        return jax.device_get(tree)
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def _canonical(value) -> Any:
    """A representation of ``value`` whose ``repr`` is complete (numpy's abbreviates long arrays)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, dict):
        return tuple((repr(k), _canonical(v)) for k, v in sorted(value.items(), key=lambda kv: repr(kv[0])))
    if isinstance(value, np.generic):
        return value.item()
    return value


def fingerprint(value) -> bytes:
    return hashlib.sha256(repr(_canonical(value)).encode()).digest()


def check_same_call(what: str, arguments) -> None:
    """Raise :class:`SamplingError` on every process unless all processes passed equal ``arguments``."""
    if jax.process_count() == 1:
        return
    mine = np.frombuffer(fingerprint(arguments), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))
    differing = [p for p in range(len(every)) if not np.array_equal(every[p], every[0])]
    if differing:
        raise SamplingError(
            f"{what}: process(es) {differing} were called with other arguments (prompts or settings) than "
            f"process 0; on a multi-host slice every process must make the same call with the same arguments"
        )


def read_on_process_0(read: Callable[[], str | None]) -> str | None:
    """``read()``'s text (or ``None``) on process 0 — a file only it has, its terminal — on every
    process. When reading fails on process 0 (an ``OSError`` or a :class:`GptjFlaxError`), every
    process raises :class:`SamplingError` with its one-line description.

    Text travels as it was read, undecodable bytes included (as Python's lone surrogates), so every
    process refuses such text alike."""
    if jax.process_count() == 1:
        return read()
    kind, text = NOTHING, ""
    if jax.process_index() == 0:
        try:
            value = read()
        except (OSError, GptjFlaxError) as e:
            kind, text = ERROR, describe(e)
        else:
            kind, text = (NOTHING, "") if value is None else (TEXT, value)
    data = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    kind, size = (int(x) for x in multihost_utils.broadcast_one_to_all(np.array([kind, data.size], np.int64)))
    buffer = np.zeros(max(size, 1), np.uint8)
    buffer[: data.size] = data
    text = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size]).decode("utf-8", "surrogatepass")
    if kind == ERROR:
        raise SamplingError(text)
    return None if kind == NOTHING else text
