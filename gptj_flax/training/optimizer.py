"""The optimiser of the original GPT-J runs, done right.

mesh-transformer-jax: scale by 1/GA → clip global norm 1.0 → Adam(0.9, 0.999, 1e-8) → decoupled
weight decay on matrices only → × −lr(t), with a "gpt3" schedule (linear warmup, half-cosine
anneal to ``end_lr``, then constant). The 1/GA scaling lives in the train step here (gradients are
averaged over every token of the accumulated batch, in float32 — the original summed in bf16).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from gptj_flax.config import ConfigError, TrainConfig, jnp_dtype


def schedule(train: TrainConfig) -> optax.Schedule:
    """0 → lr linearly over ``warmup_steps``; lr → end_lr by half-cosine over ``anneal_steps``; then end_lr."""
    warmup = optax.linear_schedule(0.0, train.lr, max(train.warmup_steps, 1))
    anneal = optax.cosine_decay_schedule(
        train.lr, max(train.anneal_steps, 1), alpha=train.end_lr / train.lr if train.lr else 0.0
    )
    return optax.join_schedules([warmup, anneal], boundaries=[train.warmup_steps])


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def frozen_mask(params, patterns: Sequence[str]):
    """True for every parameter whose path (e.g. ``layers/attn/q_proj``, ``wte``) matches a glob."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(fnmatch.fnmatch(_path_str(path), p) for p in patterns), params
    )


def make_optimizer(train: TrainConfig, params=None, freeze: Sequence[str] = ()) -> optax.GradientTransformation:
    """AdamW with global-norm clipping, matrix-only decay and the warmup/cosine schedule.

    ``freeze``: glob patterns over parameter paths; matching parameters get zero updates and no
    optimiser state (``params`` is needed to resolve them).
    """
    adamw = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8, mu_dtype=jnp_dtype(train.adam_mu_dtype)),
        optax.add_decayed_weights(train.weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        optax.scale_by_learning_rate(schedule(train)),
    )
    if not freeze:
        return adamw
    if params is None:
        raise ValueError("freezing parameters needs the params tree to resolve the patterns")
    mask = frozen_mask(params, freeze)
    if not any(jax.tree.leaves(mask)):
        raise ConfigError(
            f"train.freeze patterns {list(freeze)} match no parameter; paths look like "
            f"{', '.join(_path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)[:3])}"
        )
    labels = jax.tree.map(lambda frozen: "frozen" if frozen else "train", mask)
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)


def restart_schedule(opt_state):
    """Zero every schedule counter (fine-tuning restarts warmup) but keep Adam's moments and count."""

    def reset(node):
        if isinstance(node, optax.ScaleByScheduleState):
            return optax.ScaleByScheduleState(count=jnp.zeros_like(node.count))
        return node

    return jax.tree.map(reset, opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByScheduleState))
