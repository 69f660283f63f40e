"""Train state, sharded state creation, and the jitted train / eval steps.

A batch is a :class:`gptj_flax.data.Batch`: ``tokens`` int32 [GA, B, T+1] (or [B, T+1]),
``segment_ids`` of the same shape (0 = padding, documents numbered within a row) and ``loss_mask``
[.., T] (1 where the target token counts). Inputs are ``tokens[..., :-1]``, targets ``tokens[..., 1:]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gptj_flax import model as model_lib
from gptj_flax import partitioning
from gptj_flax.data import Batch
from gptj_flax.losses import chunked_loss_sums
from gptj_flax.model import GPTJ

BATCH_AXES = ("batch", "length")
ACCUM_BATCH_AXES = (None, "batch", "length")


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimiser updates applied so far
    params: Any
    opt_state: Any


def trained_collection(model: GPTJ) -> str:
    """The variable collection a step trains: the model's ``params``, or with LoRA its ``lora`` adapters
    (the base ``params`` then come into every step as a separate, frozen argument)."""
    return "params" if model.lora is None else "lora"


def abstract_trained(model: GPTJ) -> Any:
    """Boxed abstract tree of what the state's ``params`` holds: the model's params, or its adapters."""
    if model.lora is None:
        return model_lib.abstract_params(model.config)
    return model_lib.abstract_adapters(model.config, model.lora)


def abstract_state(model: GPTJ, tx: optax.GradientTransformation, trained: Any = None) -> Any:
    """Boxed abstract TrainState (shapes and logical axes; nothing allocated): the optimiser's
    moments carry their parameters' logical axes. ``trained``: :func:`abstract_trained`, if the
    caller has it already."""

    def init(params):
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    return jax.eval_shape(init, abstract_trained(model) if trained is None else trained)


def state_shardings(
    model: GPTJ, tx: optax.GradientTransformation, mesh: Mesh, rules: partitioning.Rules = partitioning.DEFAULT_RULES
) -> Any:
    """NamedShardings of every TrainState leaf: optimiser moments follow their parameters."""
    return partitioning.logical_to_sharding(nn.get_partition_spec(abstract_state(model, tx)), mesh, rules)


def create_state(
    model: GPTJ,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rng: jax.Array,
    rules: partitioning.Rules = partitioning.DEFAULT_RULES,
    params: Any = None,
    shardings: TrainState | None = None,
) -> TrainState:
    """A fresh TrainState born sharded; with ``params`` given, only the optimiser state is new.
    ``shardings``: :func:`state_shardings`, if the caller has them already."""
    if shardings is None:
        shardings = state_shardings(model, tx, mesh, rules)

    def init(rng, params):
        if params is None:  # with LoRA, the base params init makes are unused and compiled away
            params = nn.meta.unbox(model.init(rng, jnp.zeros((1, 1), jnp.int32)))[trained_collection(model)]
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    with partitioning.sharding_scope(mesh, rules):
        if params is None:
            return jax.jit(lambda r: init(r, None), out_shardings=shardings)(rng)
        return jax.jit(init, in_shardings=(None, shardings.params), out_shardings=shardings, donate_argnums=1)(
            rng, params
        )


def _as_accumulated(batch: Batch) -> Batch:
    """[B, T+1] batches become a single micro-batch [1, B, T+1]."""
    return batch if batch.tokens.ndim == 3 else jax.tree.map(lambda x: x[None], batch)


def _loss_sums(model: GPTJ, params, micro: Batch, z_loss: float = 0.0, base=None):
    """(objective, cross-entropy, tokens) summed over the micro-batch; the LM head runs in chunks.
    With LoRA, ``params`` are the adapters and ``base`` the frozen base params."""
    variables = {"params": params} if base is None else {"params": base, "lora": params}
    hidden = model.apply(variables, micro.inputs, segment_ids=micro.input_segment_ids, method=GPTJ.hidden_states)
    head = variables["params"]["lm_head"]
    return chunked_loss_sums(hidden, head, micro.targets, micro.loss_mask, z_loss)


def _with_base(model: GPTJ, step: Callable) -> Callable:
    """``step(…, base)`` for a LoRA model; ``step(…)`` with no base otherwise."""
    if model.lora is not None:
        return step
    return lambda *args: step(*args, None)


def _accumulate(micro_grads: Callable, params, batch: Batch):
    """``(grads, loss_sum, tokens)`` summed over the micro-batches of ``batch`` [GA, …], where
    ``micro_grads(params, micro) -> (grads, (loss_sum, tokens))`` for one micro-batch.

    The micro-batches run under ``lax.scan`` with the gradients summed in float32; one micro-batch
    runs alone, sparing the float32 accumulator's memory.
    """
    if batch.tokens.shape[0] == 1:
        grads, (loss_sum, tokens) = micro_grads(params, jax.tree.map(lambda x: x[0], batch))
        return grads, loss_sum, tokens

    def body(carry, micro):
        grads, loss_sum, tokens = carry
        g, (micro_loss, n) = micro_grads(params, micro)
        return (jax.tree.map(jnp.add, grads, g), loss_sum + micro_loss, tokens + n), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (grads, loss_sum, tokens), _ = jax.lax.scan(body, (zeros, 0.0, 0.0), batch)
    return grads, loss_sum, tokens


def _replica_norms(tree) -> jax.Array:
    """[R]: the global norm of each slice ``[r]`` of a tree whose leaves lead with a replica axis."""
    squares = [
        jnp.sum(jnp.square(x.astype(jnp.float32)).reshape(x.shape[0], -1), axis=1) for x in jax.tree.leaves(tree)
    ]
    return jnp.sqrt(sum(squares))


def _accumulate_per_replica(micro_grads: Callable, params, batch: Batch, replicas: int):
    """:func:`_accumulate`, with each data-parallel replica's gradient of each micro-batch kept apart
    for the gradient-noise statistics (docs/train.md): ``(grads, loss_sum, tokens, norms)``.

    Each micro-batch is split into the ``replicas`` shares its replicas hold, and ``micro_grads`` is
    vmapped over them, the shares staying on their own devices; a replica's accumulated gradient
    is carried apart from the others' (a float32 copy of the trained parameters per replica, on
    that replica's devices) and the global gradient is their sum. With ``w`` a share's gradient
    (its summed loss over the whole step's tokens) and ``GA`` micro-batches, ``GA · R · w`` is the
    share's mean-token gradient and ``R · Σ_i w_i`` a replica's mean over its micro-batches, so
    ``norms`` holds ``grad_norm_micro``, the mean of the first's norms over micro-batches and
    replicas, and ``grad_norm_replica``, the mean of the second's over replicas.
    """
    accum = batch.tokens.shape[0]

    def per_replica(micro):
        shares = jax.tree.map(lambda x: x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:]), micro)
        with partitioning.within_replica():
            vmapped = jax.vmap(micro_grads, in_axes=(None, 0), spmd_axis_name=partitioning.replica_axes() or None)
            return vmapped(params, shares)

    def body(carry, micro):
        grads, loss_sum, tokens = carry
        g, (micro_loss, n) = per_replica(micro)
        carry = (jax.tree.map(jnp.add, grads, g), loss_sum + jnp.sum(micro_loss), tokens + jnp.sum(n))
        return carry, _replica_norms(g)

    zeros = jax.tree.map(lambda p: jnp.zeros((replicas, *p.shape), jnp.float32), params)
    (per_replica_grads, loss_sum, tokens), micro_norms = jax.lax.scan(body, (zeros, 0.0, 0.0), batch)
    norms = {
        "grad_norm_micro": accum * replicas * jnp.mean(micro_norms),
        "grad_norm_replica": replicas * jnp.mean(_replica_norms(per_replica_grads)),
    }
    return jax.tree.map(lambda g: jnp.sum(g, axis=0), per_replica_grads), loss_sum, tokens, norms


def make_train_step(
    model: GPTJ,
    tx: optax.GradientTransformation,
    lr_fn: Callable,
    z_loss: float = 0.0,
    noise_replicas: int | None = None,
):
    """``train_step(state, batch) -> (state, metrics)``, to be jitted by :func:`compile_train_step`;
    with LoRA ``train_step(state, batch, base)``, the base params frozen (no gradient is taken for them).

    Micro-batches are accumulated by :func:`_accumulate`. Each micro-batch's summed loss is divided
    by the token count of the *whole* batch (known before any forward pass), so the accumulated
    gradient is already the mean over every token — k micro-batches give exactly the gradient of
    one k-times larger batch — and no extra pass over the gradients is needed.

    ``noise_replicas``: the mesh's data-parallel size, to keep each replica's gradients apart and
    return the norms of the gradient-noise statistics (:func:`_accumulate_per_replica`); None
    compiles none of that.
    """

    def train_step(state: TrainState, batch: Batch, base):
        batch = _as_accumulated(batch)
        denom = jnp.maximum(jnp.sum(batch.loss_mask.astype(jnp.float32)), 1.0)

        def micro_grads(params, micro):
            def loss_fn(p):
                objective, loss, tokens = _loss_sums(model, p, micro, z_loss, base)
                return objective / denom, (loss, tokens)

            return jax.grad(loss_fn, has_aux=True)(params)

        if noise_replicas is None:
            grads, loss_sum, tokens = _accumulate(micro_grads, state.params, batch)
            noise_norms = {}
        else:
            grads, loss_sum, tokens, noise_norms = _accumulate_per_replica(
                micro_grads, state.params, batch, noise_replicas
            )
        with jax.named_scope("optimizer"):  # a name for profiles: optax's operations carry none
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss_sum / denom,
            "grad_norm": optax.tree.norm(grads),
            "lr": lr_fn(state.step),
            "tokens": tokens,
            **noise_norms,
        }
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return _with_base(model, train_step)


def make_eval_step(model: GPTJ):
    """``eval_step(params, batch) -> {"loss_sum", "tokens"}`` (sums, so batches aggregate exactly);
    with LoRA ``eval_step(adapters, batch, base)``."""

    def eval_step(params, batch, base):
        batch = _as_accumulated(batch)

        def body(carry, micro):
            _, loss_sum, tokens = _loss_sums(model, params, micro, base=base)
            return (carry[0] + loss_sum, carry[1] + tokens), None

        (loss_sum, tokens), _ = jax.lax.scan(body, (0.0, 0.0), batch)
        return {"loss_sum": loss_sum, "tokens": tokens}

    return _with_base(model, eval_step)


def batch_sharding(mesh: Mesh, accumulated: bool, rules: partitioning.Rules = partitioning.DEFAULT_RULES):
    return partitioning.named_sharding(mesh, ACCUM_BATCH_AXES if accumulated else BATCH_AXES, rules)


def _base_in(model: GPTJ, base_shardings: Any) -> tuple:
    if model.lora is None:
        return ()
    if base_shardings is None:
        raise ValueError("a LoRA model's steps take the base params: pass base_shardings")
    return (base_shardings,)


def compile_train_step(
    model: GPTJ,
    tx,
    shardings: TrainState,
    *,
    data_sharding: NamedSharding,
    lr_fn: Callable,
    z_loss: float = 0.0,
    base_shardings: Any = None,
    noise_replicas: int | None = None,
):
    """Jit the train step with NamedShardings in and out; the state is donated (updated in place).
    ``data_sharding``: the batch's (:func:`batch_sharding`). With LoRA, ``base_shardings`` are the
    base params' (an input, never donated). ``noise_replicas``: see :func:`make_train_step`."""
    replicated = NamedSharding(data_sharding.mesh, PartitionSpec())
    return jax.jit(
        make_train_step(model, tx, lr_fn, z_loss, noise_replicas),
        in_shardings=(shardings, data_sharding, *_base_in(model, base_shardings)),
        out_shardings=(shardings, replicated),
        donate_argnums=0,
    )


def compile_eval_step(model: GPTJ, param_shardings: Any, *, data_sharding: NamedSharding, base_shardings: Any = None):
    replicated = NamedSharding(data_sharding.mesh, PartitionSpec())
    return jax.jit(
        make_eval_step(model),
        in_shardings=(param_shardings, data_sharding, *_base_in(model, base_shardings)),
        out_shardings=replicated,
    )
