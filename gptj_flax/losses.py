"""Per-token scores and the training loss, computed from the model's float32 logits.

Scores: the log-probability of each target (normalised over the whole vocabulary, as HuggingFace's
are) and whether it is greedy decoding's choice. Loss: weighted cross-entropy sums, optionally with
the z-loss, and the same sums taken a chunk of positions at a time from the final hidden states, so
that a training batch's full logits never exist at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gptj_flax.model import project_to_vocab

Array = jax.Array


# --------------------------------------------------------------------------------------------
# Per-token scores


def token_log_probs(logits: Array, targets: Array) -> Array:
    """log p(target) under ``logits`` [..., V] for every position, in float32 (normalised over the
    whole vocabulary, as HuggingFace's are)."""
    logits = logits.astype(jnp.float32)
    chosen = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return chosen - jax.nn.logsumexp(logits, axis=-1)


def mask_vocab(logits: Array, valid_vocab: int) -> Array:
    """Remove the ids ≥ ``valid_vocab``: rows of a padded vocabulary no tokenizer produces."""
    return jnp.where(jnp.arange(logits.shape[-1]) < valid_vocab, logits, -jnp.inf)


def first_argmax(logits: Array) -> Array:
    """Each row's first index of its largest value, int32 [...] — ``jnp.argmax`` (NaN aside: a row
    without a comparable maximum gives 0), as two plain reductions, which XLA's CPU backend runs
    faster than the single (value, index) reduction ``argmax`` lowers to."""
    vocab = logits.shape[-1]
    is_max = logits == jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(is_max, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.where(first < vocab, first, 0)


def greedy_matches(logits: Array, targets: Array, valid_vocab: int | None = None) -> Array:
    """Whether each target is greedy decoding's choice (:func:`first_argmax` over the valid ids)."""
    if valid_vocab is not None:
        logits = mask_vocab(logits, valid_vocab)
    return first_argmax(logits) == targets


# --------------------------------------------------------------------------------------------
# Loss


def loss_sums(logits: Array, targets: Array, weights: Array, z_loss: float = 0.0) -> tuple[Array, Array, Array]:
    """Weighted sums over tokens, in float32: (cross-entropy + z_loss · logsumexp², cross-entropy, weight)."""
    nll = -token_log_probs(logits, targets)
    weights = weights.astype(jnp.float32)
    objective = nll + z_loss * jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)) if z_loss else nll
    return jnp.sum(objective * weights), jnp.sum(nll * weights), jnp.sum(weights)


def chunked_loss_sums(
    hidden: Array, head: dict, targets: Array, weights: Array, z_loss: float = 0.0, chunk: int = 256
) -> tuple[Array, Array, Array]:
    """:func:`loss_sums` of ``LMHead(hidden)``, computed ``chunk`` positions at a time.

    The full float32 logits of a training batch (batch × length × vocab) never exist at once: each chunk's logits are made, reduced to three
    sums and dropped, and the backward pass makes them again (``jax.checkpoint``). A sequence of one
    chunk is computed directly, without the loop: its logits exist once either way.
    """
    length = hidden.shape[1]
    chunk = min(chunk, length)
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    if pad:  # padded positions carry weight 0
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        weights = jnp.pad(weights, ((0, 0), (0, pad)))

    def split(x):  # [B, n·c, …] → [n, B, c, …]
        return jnp.swapaxes(x.reshape(x.shape[0], n_chunks, chunk, *x.shape[2:]), 0, 1)

    def sums(h, t, w):
        return loss_sums(project_to_vocab(h, head["kernel"], head["bias"]), t, w, z_loss)

    if n_chunks == 1:
        return sums(hidden, targets, weights)
    sums = jax.checkpoint(sums)

    def body(totals, xs):
        return jax.tree.map(jnp.add, totals, sums(*xs)), None

    zero = jnp.zeros((), jnp.float32)
    totals, _ = jax.lax.scan(body, (zero, zero, zero), (split(hidden), split(targets), split(weights)))
    return totals
