"""Batched log-likelihood of continuations: the compiled scorer behind the lm-eval adapter.

A request is ``(context, continuation)`` as token ids; its score is the summed log-probability of
the continuation tokens given everything before them, and whether greedy decoding would have
produced exactly them. Requests are sorted by length (longest first, so a batch that does not fit
fails at once rather than at the end), cut into batches of a fixed number of rows, and each batch
is right-padded to a power-of-two length: the compiled program is reused for every batch of the
same length bucket, whatever the lengths inside it. Right padding leaves the scores untouched
(attention is causal and never looks at padding).

Inputs reach the devices as global arrays and the per-row results come back replicated, so the same
code runs on one device, a sharded mesh or several hosts (every process passes the same requests,
checked before anything runs, and gets every score).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from gptj_flax import partitioning
from gptj_flax.config import ModelConfig
from gptj_flax.model import GPTJ
from gptj_flax.sampling.decoding import bucket, score_tokens
from gptj_flax.sampling.multihost import check_same_call, to_device

Request = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)


class TokenScorer:
    """log p(continuation | context) for many token-id pairs, on any mesh.

    The parameters are an argument of :meth:`score`, not part of the scorer, so one scorer (and its
    compiled programs) serves every checkpoint step of a training run.
    """

    def __init__(
        self,
        config: ModelConfig,
        mesh: Mesh,
        *,
        batch_size: int = 16,
        valid_vocab: int | None = None,
        rules: partitioning.Rules = partitioning.DEFAULT_RULES,
    ):
        """
        Args:
          config: the model; ``mesh`` the devices it runs on (the batch is split over ``data`` and
            ``fsdp``, heads and vocabulary over ``model``).
          batch_size: requests per compiled call; rounded up to a multiple of the data-parallel size.
          valid_vocab: ids at or above it (a padded embedding's unused rows) never count as the
            greedy choice — as in generation, which never emits them. Log-probabilities are
            normalised over the whole vocabulary, as HuggingFace's are.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.config, self.mesh, self.rules = config, mesh, rules
        self.valid_vocab = config.vocab_size if valid_vocab is None else min(valid_vocab, config.vocab_size)
        data_parallel = partitioning.data_parallel_size(mesh, rules)
        self.rows = -(-batch_size // data_parallel) * data_parallel
        self.model = GPTJ(config)
        self._table_sharding = partitioning.named_sharding(mesh, ("batch", "length"), rules)
        self._row_sharding = partitioning.named_sharding(mesh, ("batch",), rules)
        replicated = NamedSharding(mesh, PartitionSpec())
        self._score = jax.jit(self._score_fn, out_shardings=(replicated, replicated))

    def _score_fn(self, params, tokens, lengths, scored):
        """tokens [B, L+1] (row i real up to ``lengths[i]``); the last ``scored[i]`` targets count.

        Returns the counted targets' log-probabilities [B, L] (0 elsewhere) and whether each row's
        counted targets are all greedy choices [B].
        """
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        slots = jnp.arange(inputs.shape[1])[None, :]
        real = slots < (lengths - 1)[:, None]
        scores = score_tokens(self.model, params, inputs, targets, real.astype(jnp.int32), self.valid_vocab)
        counted = real & (slots >= (lengths - 1 - scored)[:, None])
        # per token, not summed: the host adds them up in float64 (a float32 sum of a long text's
        # log-probabilities would lose the last digits)
        return jnp.where(counted, scores.log_probs, 0.0), jnp.all(scores.greedy | ~counted, axis=-1)

    def score(
        self, params: Any, requests: Sequence[Request], *, progress: bool = False, desc: str = "scoring"
    ) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation tokens), every continuation token is the greedy choice)`` per request.

        The sequence ``context + continuation`` is cut from the left to the model's context
        (``max_len`` inputs, so ``max_len + 1`` tokens); scored tokens cut off with it no longer
        count. The context needs at least one token (GPT-J has no start token: pass the EOS).
        """
        check_same_call("score", [(list(context), list(continuation)) for context, continuation in requests])
        max_len = self.config.max_len
        sequences, counts = [], []
        for i, (context, continuation) in enumerate(requests):
            if len(context) == 0:
                raise ValueError(
                    f"request {i} has an empty context; GPT-J needs at least one token before the "
                    "continuation (the EOS, as lm-eval and the original evaluation do)"
                )
            full = np.asarray([*context, *continuation], np.int32)[-(max_len + 1) :]
            if full.size and not (0 <= full.min() and full.max() < self.config.vocab_size):
                raise ValueError(f"request {i} has a token id outside [0, {self.config.vocab_size})")
            sequences.append(full)
            counts.append(min(len(continuation), full.size - 1))
        order = sorted(range(len(sequences)), key=lambda i: -sequences[i].size)
        results: list[tuple[float, bool]] = [(0.0, True)] * len(sequences)
        batches = [order[i : i + self.rows] for i in range(0, len(order), self.rows)]
        with partitioning.sharding_scope(self.mesh, self.rules):
            for batch in tqdm(batches, desc=desc, unit="batch", disable=not progress):
                width = min(bucket(max(sequences[i].size for i in batch) - 1), max_len) + 1
                tokens = np.zeros((self.rows, width), np.int32)
                lengths = np.ones(self.rows, np.int32)  # padding rows: one token, nothing scored
                scored = np.zeros(self.rows, np.int32)
                for row, i in enumerate(batch):
                    tokens[row, : sequences[i].size] = sequences[i]
                    lengths[row], scored[row] = sequences[i].size, counts[i]
                log_probs, greedy = self._score(
                    params,
                    to_device(tokens, self._table_sharding),
                    to_device(lengths, self._row_sharding),
                    to_device(scored, self._row_sharding),
                )
                log_probs, greedy = np.asarray(log_probs), np.asarray(greedy)
                for row, i in enumerate(batch):
                    results[i] = (float(np.sum(log_probs[row], dtype=np.float64)), bool(greedy[row]))
        return results

    def compilations(self) -> int:
        """Programs compiled so far (one per length bucket), for checking that nothing recompiles."""
        return self._score._cache_size()
