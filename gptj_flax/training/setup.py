"""What a training run builds from its config and mesh before it reads any file: the model, the
optimiser, the abstract training state (traced once) with its restore targets and shardings, the
batch shardings and the jitted steps.

``train``, the AOT fit check (:mod:`gptj_flax.training.aot`) and the benchmarks all start from a
:class:`TrainSetup`, so what they compile is the same program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from gptj_flax import attention, checkpoint, partitioning
from gptj_flax.config import Config, ConfigError
from gptj_flax.convert import lora as lora_lib
from gptj_flax.data import Batch
from gptj_flax.model import GPTJ
from gptj_flax.training import optimizer, steps


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    config: Config
    mesh: Mesh
    model: GPTJ
    tx: optax.GradientTransformation
    schedule: optax.Schedule  # the learning rate by step, as the optimiser applies it
    targets: steps.TrainState  # every leaf a ShapeDtypeStruct with its sharding: restored into, lowered against
    shardings: steps.TrainState
    train_sharding: NamedSharding  # a training batch [GA, B, T+1]
    eval_sharding: NamedSharding  # a validation batch [B, T+1]
    batch_size: int  # sequences per micro-batch over the whole mesh
    seq_len: int
    attention: attention.Backend

    @classmethod
    def build(cls, config: Config, mesh: Mesh | None = None) -> TrainSetup:
        """Check ``config`` against ``mesh`` (default: ``config.mesh`` over all devices), then build."""
        tc, mc = config.train, config.model
        if mc.quantize is not None and tc.lora is None:
            raise ConfigError(
                f"model.quantize={mc.quantize!r} without train.lora: int8 weights take no gradient, so an int8 "
                "base trains only LoRA adapters (QLoRA: set train.lora); for a full fine-tune unset model.quantize"
            )
        mesh = mesh or partitioning.make_mesh(config.mesh)
        checkpoint.check_mesh(mc, mesh)
        batch_size = _batch_size(config, mesh)
        seq_len = tc.seq_len or mc.max_len
        model = GPTJ(mc, tc.lora)
        trained = steps.abstract_trained(model)  # the optimiser's frozen mask and the state both start here
        tx = optimizer.make_optimizer(tc, nn.meta.unbox(trained), tc.freeze)
        targets, shardings = partitioning.restore_targets(steps.abstract_state(model, tx, trained), mesh)
        return cls(
            config=config,
            mesh=mesh,
            model=model,
            tx=tx,
            schedule=optimizer.schedule(tc),
            targets=targets,
            shardings=shardings,
            train_sharding=steps.batch_sharding(mesh, accumulated=True),
            eval_sharding=steps.batch_sharding(mesh, accumulated=False),
            batch_size=batch_size,
            seq_len=seq_len,
            attention=attention.choose(mc, seq_len, mesh.devices.flat[0]),
        )

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimiser step trains on (every micro-batch)."""
        return self.config.train.grad_accum_steps * self.batch_size * self.seq_len

    @property
    def noise_replicas(self) -> int | None:
        """The data-parallel replicas whose gradients a step keeps apart for the gradient-noise
        statistics: set with ``train.noise_scale_alpha`` and gradient accumulation; else None."""
        tc = self.config.train
        if tc.noise_scale_alpha is None or tc.grad_accum_steps < 2:
            return None
        return partitioning.data_parallel_size(self.mesh)

    def init_state(self, params: Any = None) -> steps.TrainState:
        """A fresh state born sharded (seeded by ``train.seed``); with ``params``, only the optimiser's is new."""
        rng = jax.random.key(self.config.train.seed)
        return steps.create_state(self.model, self.tx, self.mesh, rng, params=params, shardings=self.shardings)

    def compile(self, base: Any = None) -> tuple[Callable, Callable]:
        """``(train_step, eval_step)``, jitted on this setup's shardings (compiled at their first call
        or ``lower``). A LoRA model's steps take the frozen base as a third argument, placed as
        ``base`` (its arrays, or :meth:`base_targets`) is."""
        base_shardings = None if base is None else jax.tree.map(lambda x: x.sharding, base)
        train_step = steps.compile_train_step(
            self.model,
            self.tx,
            self.shardings,
            data_sharding=self.train_sharding,
            lr_fn=self.schedule,
            z_loss=self.config.train.z_loss,
            base_shardings=base_shardings,
            noise_replicas=self.noise_replicas,
        )
        eval_step = steps.compile_eval_step(
            self.model, self.shardings.params, data_sharding=self.eval_sharding, base_shardings=base_shardings
        )
        return train_step, eval_step

    def base_targets(self) -> Any:
        """A LoRA run's frozen base as it is held (:func:`~gptj_flax.convert.lora.base_model_config`),
        as ShapeDtypeStructs with shardings: what the steps are lowered against without loading it."""
        return checkpoint.param_targets(lora_lib.base_model_config(self.config), self.mesh)[0]

    def abstract_batch(self) -> Batch:
        """A training batch as ShapeDtypeStructs with their sharding."""
        rows = (self.config.train.grad_accum_steps, self.batch_size)
        tokens: Any = jax.ShapeDtypeStruct((*rows, self.seq_len + 1), jnp.int32, sharding=self.train_sharding)
        mask: Any = jax.ShapeDtypeStruct((*rows, self.seq_len), jnp.float32, sharding=self.train_sharding)
        return Batch(tokens, tokens, mask)


def _batch_size(config: Config, mesh: Mesh) -> int:
    """Sequences per micro-batch over ``mesh``, which its data-parallel shards must divide."""
    data_parallel = partitioning.data_parallel_size(mesh)
    batch_size = config.train.global_batch_size(data_parallel)
    if batch_size % data_parallel:
        raise ConfigError(
            f"train.batch_size={batch_size} is not divisible by the {data_parallel} data-parallel "
            f"shards (data x fsdp) of mesh {partitioning.mesh_shape(mesh)}: use a multiple of "
            f"{data_parallel}"
        )
    return batch_size
