"""From logits to the next token, per example, inside ``jit``.

A :class:`Sampling` is one sequence's settings, checked as it is made; :class:`SamplingParams` is
a batch of them on their way to the device: every setting an array with one value per batch row, so
one compiled program serves a batch whose requests all want different things. A value that switches
a filter off (``top_k`` 0, ``top_p``/``typical_p`` 1, ``min_p`` 0, ``repetition_penalty`` 1) leaves
that row untouched, and a filter no row uses is skipped at run time (``lax.cond``), so greedy
decoding runs none of them. No filter sorts the vocabulary: each finds its threshold by bisection
(:func:`_largest`).

Order (HuggingFace ``generate``): repetition penalty → temperature → top-k → top-p → min-p →
typical-p → sample. ``original_order=True`` moves temperature after the filters, as
mesh-transformer-jax did (it chose the top-p set on the untempered distribution). Temperature 0 is
greedy: the argmax after the repetition penalty, as HuggingFace's ``do_sample=False``.

Filters remove tokens by setting their logits to -inf. Where several tokens tie with the last one
kept, all of them are kept (a threshold, not a sort position), so the result never depends on how
a sort breaks ties.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from gptj_flax.errors import GptjFlaxError
from gptj_flax.losses import first_argmax, mask_vocab

Array = jax.Array
_DTYPES = {int: np.int32, float: np.float32}


class SamplingError(GptjFlaxError, ValueError):
    """A generation request is malformed: the message names the setting and the accepted range."""


# Each setting's kind, its range, and how an error states the range.
SETTINGS = {
    "temperature": (float, lambda x: x >= 0, ">= 0 (0 is greedy)"),
    "top_k": (int, lambda x: x >= 0, "an integer >= 0 (0 is off)"),
    "top_p": (float, lambda x: 0 < x <= 1, "in (0, 1] (1 is off)"),
    "typical_p": (float, lambda x: 0 < x <= 1, "in (0, 1] (1 is off)"),
    "min_p": (float, lambda x: 0 <= x <= 1, "in [0, 1] (0 is off)"),
    "repetition_penalty": (float, lambda x: x > 0, "> 0 (1 is off)"),
}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one sequence chooses its tokens: temperature (0 is greedy) and the filters, whose
    defaults switch them off.

    Every value is checked as the Sampling is made (:class:`SamplingError` names the first one out
    of its range), so any Sampling is one the device programs can run.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        for name, (kind, valid, accepted) in SETTINGS.items():
            value = check_value(name, getattr(self, name), kind, valid, accepted, _DTYPES[kind])
            object.__setattr__(self, name, kind(value))  # one spelling per value: 0 and 0.0 alike


def sampling_rows(n: int, sampling: Sampling | Sequence[Sampling] | None = None, **settings) -> list[Sampling]:
    """One :class:`Sampling` per row of a batch of ``n``: ``sampling`` (one for every row, or one per
    row), or else made of ``settings`` (each one value or one per row; ``None`` or absent: the
    default), as :meth:`LanguageModel.generate` takes them."""
    unknown = sorted(set(settings) - SETTINGS.keys())
    if unknown:
        raise TypeError(f"unknown sampling setting(s) {', '.join(unknown)}; the settings are {', '.join(SETTINGS)}")
    given = {name: value for name, value in settings.items() if value is not None}
    if sampling is None:
        spread = {name: _per_row(name, value, n, *SETTINGS[name]) for name, value in given.items()}
        return [Sampling(**{name: values[i] for name, values in spread.items()}) for i in range(n)]
    if given:
        raise SamplingError(
            f"got sampling and {', '.join(given)}: give the sampling settings as a Sampling or as keywords, not both"
        )
    if isinstance(sampling, Sampling):
        return [sampling] * n
    rows = list(sampling) if isinstance(sampling, Sequence) and not isinstance(sampling, str) else None
    if rows is None or not all(isinstance(s, Sampling) for s in rows):
        raise SamplingError(f"sampling must be a Sampling, or a list of one per prompt; got {_shown(sampling)}")
    if len(rows) != n:
        raise SamplingError(f"sampling: got {len(rows)} for {n} prompts; give one Sampling or one per prompt")
    return rows


@flax.struct.dataclass
class SamplingParams:
    """Per-example sampling settings on their way to the device: each field has shape [batch]."""

    temperature: Array  # float32; 0 → greedy
    top_k: Array  # int32; 0 → off
    top_p: Array  # float32 in (0, 1]; 1 → off
    typical_p: Array  # float32 in (0, 1]; 1 → off
    min_p: Array  # float32 in [0, 1]; 0 → off
    repetition_penalty: Array  # float32 > 0; 1 → off

    @classmethod
    def of(cls, rows: Sequence[Sampling]) -> SamplingParams:
        """Host-side numpy settings with one row per :class:`Sampling`."""
        return cls(
            **{
                name: np.asarray([getattr(row, name) for row in rows], _DTYPES[kind])
                for name, (kind, _, _) in SETTINGS.items()
            }
        )

    @classmethod
    def build(cls, batch: int, **settings) -> SamplingParams:
        """Host-side numpy settings for ``batch`` rows, each setting one value or one per row (see
        :func:`sampling_rows`); raises :class:`SamplingError` naming the first value out of its range."""
        return cls.of(sampling_rows(batch, **settings))

    @classmethod
    def logical_axes(cls) -> SamplingParams:
        batch = PartitionSpec("batch")
        return cls(*(batch,) * 6)

    def pad_to(self, batch: int) -> SamplingParams:
        """Extend host settings to ``batch`` rows with neutral values (for batch-padding rows)."""
        neutral = SamplingParams.of([Sampling(temperature=0.0)])
        return jax.tree.map(lambda x, n: np.concatenate([x, np.repeat(n, batch - len(x))]), self, neutral)


def top_logprobs(logits: Array, k: int, valid_vocab: int | None = None) -> tuple[Array, Array]:
    """The ``k`` most likely ids of every row of ``logits`` [..., V] and their log-probabilities, each
    [..., k] (``k`` static), most likely first.

    The log-probabilities are normalised over the whole vocabulary, as :func:`token_log_probs`'s
    are, so a chosen token's entry equals its reported log-probability; ids at or above
    ``valid_vocab`` (a padded embedding's rows, which no tokenizer can show) are never among them.
    """
    logits = logits.astype(jnp.float32)
    # token_log_probs's own formula, so that the chosen token's two log-probabilities are one value
    log_probs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    candidates = log_probs if valid_vocab is None else mask_vocab(log_probs, valid_vocab)
    values, ids = lax.top_k(candidates, k)
    return ids.astype(jnp.int32), values


def top_bucket(k: int) -> int:
    """The static width a request for ``k`` alternatives compiles with: 0, or a power of two ≥ ``k``,
    so that asking for 3 or 4 (or 5 to 8) alternatives shares one program."""
    return 0 if k <= 0 else 1 << (k - 1).bit_length()


def per_example(name: str, value, batch: int, kind: type, valid, accepted: str, dtype=None) -> np.ndarray:
    """``value`` (a scalar, or a sequence of ``batch`` values) → validated numpy array [batch] of
    ``dtype`` (default int32 or float32 by ``kind``); a value the dtype cannot hold is refused."""
    dtype = np.dtype(dtype or _DTYPES[kind])
    return np.asarray(_per_row(name, value, batch, kind, valid, accepted, dtype), dtype)


def _per_row(name: str, value, batch: int, kind: type, valid, accepted: str, dtype=None) -> list:
    """``value`` (a scalar, or a sequence of ``batch`` values) → ``batch`` values, each checked."""
    if isinstance(value, (str, bytes)) or value is None:
        raise SamplingError(f"{name} must be {accepted}, or a list of one per prompt; got {value!r}")
    values = list(value) if isinstance(value, (Sequence, np.ndarray)) else [value] * batch
    if len(values) != batch:
        raise SamplingError(f"{name}: got {len(values)} values for {batch} prompts; give one value or one per prompt")
    listed = isinstance(value, (Sequence, np.ndarray))
    dtype = np.dtype(dtype or _DTYPES[kind])
    return [
        check_value(f"{name}[{i}]" if listed else name, x, kind, valid, accepted, dtype) for i, x in enumerate(values)
    ]


def check_value(where: str, x, kind: type, valid, accepted: str, dtype):
    """``x`` if it is a number of ``kind`` that ``valid`` accepts and ``dtype`` holds; otherwise a
    :class:`SamplingError` saying that ``where`` must be ``accepted``."""
    dtype = np.dtype(dtype)
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise SamplingError(f"{where} must be {accepted}, got {x!r}")
    if kind is int and int(x) != x:
        raise SamplingError(f"{where} must be {accepted}, got {x!r}")
    if not (isinstance(x, (int, np.integer)) or math.isfinite(x)) or not valid(x):
        raise SamplingError(f"{where} must be {accepted}, got {x!r}")
    if kind is int and not np.iinfo(dtype).min <= int(x) <= np.iinfo(dtype).max:
        raise SamplingError(f"{where} must be {accepted} and fit in {dtype.name}, got {_shown(x)}")
    with np.errstate(over="ignore"):
        overflows = kind is float and not np.isfinite(dtype.type(x))
    if overflows:
        raise SamplingError(f"{where} must be {accepted} and within {dtype.name}'s range, got {_shown(x)}")
    return x


def _shown(x) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:20] + "…" + text[-8:]


# --------------------------------------------------------------------------------------------
# Filters: logits [B, V] and one setting per row [B] → logits with removed tokens at -inf


def repetition_penalty(logits: Array, seen: Array, penalty: Array) -> Array:
    """HuggingFace's penalty on every token in ``seen`` [B, V] (prompt and output so far):
    a positive logit is divided by the penalty, a negative one multiplied."""
    p = penalty[:, None]
    penalised = jnp.where(logits < 0, logits * p, logits / p)
    return jnp.where(seen, penalised, logits)


def _ordered(bits: Array) -> Array:
    """A float32's int32 bits reordered as the floats are (−0 just below +0): a negative one's
    magnitude bits flipped. Its own inverse."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _as_ordered(x: Array) -> Array:
    return _ordered(lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32))


def _as_float(ordered: Array) -> Array:
    return lax.bitcast_convert_type(_ordered(ordered), jnp.float32)


def _largest(fits: Callable[[Array], Array], rows: int) -> Array:
    """Each row's largest int32 ``m`` [rows, 1] for which ``fits(m)`` holds, where ``fits`` holds for
    the least int32 and, once it fails, fails for every larger one: bisection, 32 halvings.

    The filters find their thresholds this way over the logits' ordered bits, in passes that count
    or sum over the row: they vectorise, where a sort of the vocabulary costs a comparison at a time.
    """
    low = jnp.full((rows, 1), jnp.iinfo(jnp.int32).min, jnp.int32)
    high = jnp.full((rows, 1), jnp.iinfo(jnp.int32).max, jnp.int32)

    def halve(_, bounds):
        low, high = bounds
        middle = (low >> 1) + (high >> 1) + ((low | high) & 1)  # ceil((low + high) / 2), no overflow
        ok = fits(middle)
        return jnp.where(ok, middle, low), jnp.where(ok, high, middle - 1)

    return lax.fori_loop(0, 32, halve, (low, high))[0]


def _mass_threshold(values: Array, probs: Array, allowed: Callable[[Array], Array]) -> Array:
    """Each row's largest value [B, 1] (of ``values`` [B, V], at most the row's largest) for which
    ``allowed`` holds of the probability ``probs`` of the tokens whose values lie below it."""
    ordered = _as_ordered(values)
    below = _largest(
        lambda m: allowed(jnp.sum(jnp.where(ordered < m, probs, 0.0), axis=-1, keepdims=True)), len(values)
    )
    # a float sum short of 1 could allow every bit pattern, the last of them NaN's: cap it at the row's largest
    return _as_float(jnp.minimum(below, jnp.max(ordered, axis=-1, keepdims=True)))


def top_k_filter(logits: Array, k: Array) -> Array:
    """Keep each row's ``k`` highest logits (and any tied with the k-th); k = 0 keeps all.

    The threshold is the k-th largest *value*, so every token id, 0 included, can be removed.
    """
    ordered = _as_ordered(logits)
    at_least = jnp.clip(k, 1, logits.shape[-1])[:, None]
    kth = _largest(lambda m: jnp.sum(ordered >= m, axis=-1, keepdims=True) >= at_least, len(logits))
    keep = (logits >= _as_float(kth)) | (k <= 0)[:, None]
    return jnp.where(keep, logits, -jnp.inf)


def top_p_filter(logits: Array, p: Array) -> Array:
    """Nucleus: drop the least likely tokens whose total probability is at most 1 − p
    (HuggingFace's rule); the most likely token always stays. p = 1 keeps all.

    The threshold is the largest logit below which the row's probability sums to at most 1 − p:
    the first token HuggingFace keeps in ascending order, with the tokens tied with it.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    removable = (1.0 - p)[:, None]
    threshold = _mass_threshold(logits, probs, lambda below: below <= removable)
    keep = (logits >= threshold) | (p >= 1.0)[:, None]
    return jnp.where(keep, logits, -jnp.inf)


def min_p_filter(logits: Array, min_p: Array) -> Array:
    """Drop tokens less likely than ``min_p`` × the most likely token's probability (log space)."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    threshold = jnp.max(log_probs, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    keep = (log_probs >= threshold) | (min_p <= 0.0)[:, None]
    return jnp.where(keep, logits, -jnp.inf)


def typical_filter(logits: Array, mass: Array) -> Array:
    """Locally typical sampling (HuggingFace's ``TypicalLogitsWarper``): rank tokens by how far
    their surprisal −log p lies from the entropy H; keep the smallest prefix of that ranking whose
    probability reaches ``mass`` (at least one token). mass = 1 keeps all.

    The prefix ends at the least distance at or below which the probability reaches ``mass`` (the
    tokens tied with it kept too), found as :func:`top_p_filter` finds its threshold.
    """
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    probs = jnp.exp(log_probs)
    entropy = -jnp.nansum(log_probs * probs, axis=-1, keepdims=True)  # 0·(−inf) terms are nan: skip
    distance = jnp.abs(-log_probs - entropy)
    wanted = mass[:, None]
    threshold = _mass_threshold(distance, probs, lambda below: below < wanted)
    keep = (distance <= threshold) | (mass >= 1.0)[:, None]
    return jnp.where(keep, logits, -jnp.inf)


def _when_used(used: Array, fn, logits: Array, setting: Array) -> Array:
    """``fn(logits, setting)`` if any row uses the filter, else ``logits`` without running it."""
    return lax.cond(jnp.any(used), fn, lambda x, _: x, logits, setting)


def warp(logits: Array, params: SamplingParams, original_order: bool = False) -> Array:
    """Temperature and the filters, in HuggingFace's order or (``original_order``) the original's."""
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    if not original_order:
        logits = logits / temperature
    logits = _when_used(params.top_k > 0, top_k_filter, logits, params.top_k)
    logits = _when_used(params.top_p < 1, top_p_filter, logits, params.top_p)
    logits = _when_used(params.min_p > 0, min_p_filter, logits, params.min_p)
    logits = _when_used(params.typical_p < 1, typical_filter, logits, params.typical_p)
    if original_order:
        logits = logits / temperature
    return logits


def categorical(keys: Array, logits: Array) -> Array:
    """One draw per row from ``softmax(logits)`` [B, V], with that row's key: int32 [B].

    An inverse-CDF draw in two levels: the vocabulary is cut into blocks of about sqrt(V) ids, a
    first uniform number picks a block in proportion to its probability mass, a second picks an id
    within it. The draw is exact (up to float32 rounding) and needs two random numbers per row,
    where the Gumbel-max trick of ``jax.random.categorical`` draws one per vocabulary entry, which
    costs more than the model's own work at a few rows on a CPU. Ids of probability 0 (logits of
    -inf, as the filters leave them) are never drawn.
    """
    batch, vocab = logits.shape
    size = 1 << max(0, math.isqrt(vocab - 1)).bit_length()  # a power of two >= sqrt(vocab)
    blocks = -(-vocab // size)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    probs = jnp.pad(probs, ((0, 0), (0, blocks * size - vocab))).reshape(batch, blocks, size)
    uniform = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys)

    def pick(weights: Array, u: Array) -> Array:
        """Each row's first index whose running sum of ``weights`` [B, n] exceeds ``u`` [B] × the row's total."""
        running = jnp.cumsum(weights, axis=-1)
        index = jnp.sum(running <= (u * running[:, -1])[:, None], axis=-1)
        # rounding can leave u × total at the sum's very end: fall back on the last id that can occur
        last = jnp.max(jnp.where(weights > 0, jnp.arange(weights.shape[-1]), 0), axis=-1)
        return jnp.minimum(index, last).astype(jnp.int32)

    block = pick(probs.sum(axis=-1), uniform[:, 0])
    within = jnp.take_along_axis(probs, block[:, None, None], axis=1)[:, 0]
    return block * size + pick(within, uniform[:, 1])


def next_tokens(
    logits: Array, params: SamplingParams, seen: Array, keys: Array, valid_vocab: int, original_order: bool = False
) -> Array:
    """Choose one token per row: greedy where temperature is 0, otherwise a draw with that row's key.

    Args:
      logits: float32 [B, V] from the model.
      params: per-row settings.
      seen: bool [B, V], the tokens the repetition penalty applies to.
      keys: [B] PRNG keys, one per row (so a row's draw does not depend on its batch neighbours).
      valid_vocab: ids at or above it are never chosen.
    """
    logits = mask_vocab(logits, valid_vocab)
    logits = _when_used(
        params.repetition_penalty != 1, lambda x, p: repetition_penalty(x, seen, p), logits, params.repetition_penalty
    )
    greedy = first_argmax(logits)

    def draw(logits):
        sampled = categorical(keys, warp(logits, params, original_order))
        return jnp.where(params.temperature > 0, sampled, greedy)

    return lax.cond(jnp.all(params.temperature == 0), lambda _: greedy, draw, logits)
