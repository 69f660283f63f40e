"""``scripts/bench.py data``: can the input pipeline feed the demo's train step with room to spare?

Measures, in one run, the tokens/s the pipeline delivers (pre-tokenised TFRecords, and raw text
tokenised on the fly) at the demo's batch shape, and the tokens/s the demo's train step consumes on
this machine, and prints their ratios.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from gptj_flax import data, partitioning
from gptj_flax.config import cli_path, load_config
from gptj_flax.model import GPTJ
from gptj_flax.training import optimizer, steps


def demo_step_tokens_per_s(config_path: str = "configs/demo_cpu.json", repeats: int = 5) -> float:
    """Tokens/s of the demo config's train step (its mesh, batch and sequence length), steady state."""
    config = load_config(config_path)
    mesh = partitioning.make_mesh(config.mesh)
    model, tc = GPTJ(config.model), config.train
    tx = optimizer.make_optimizer(tc)
    step = steps.compile_train_step(model, tx, mesh, steps.state_shardings(model, tx, mesh),
                                    optimizer.schedule(tc), accumulated=True)
    seq = tc.seq_len or config.model.max_len
    batch_size = tc.global_batch_size(mesh.shape["data"] * mesh.shape["fsdp"])
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (tc.grad_accum_steps, batch_size, seq + 1))
    batch = data.make_batch(tokens.astype(np.int32), np.full(tokens.shape[:2], seq + 1), None)
    state = steps.create_state(model, tx, mesh, jax.random.key(0))
    with partitioning.activate(mesh):
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(repeats):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    return repeats * tokens[..., 1:].size / (time.perf_counter() - start)


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="configs/demo_cpu.json", type=cli_path, help="the train step to compare with")
    parser.add_argument("--batches", type=int, default=128, help="batches read from each pipeline")


def run(args) -> None:
    config = load_config(args.config)
    seq = config.train.seq_len or config.model.max_len
    mesh_shape = config.mesh.resolve(jax.device_count())
    batch = config.train.global_batch_size(mesh_shape[0] * mesh_shape[1])
    pipe = data.benchmark_pipeline(seq_len=seq, batch_size=batch, n_batches=args.batches,
                                   grad_accum=config.train.grad_accum_steps)
    step = demo_step_tokens_per_s(args.config)
    print(f"input pipeline vs the train step of {args.config} (batch {batch} x {seq + 1} tokens)")
    print(f"  train step consumes            {step:12,.0f} tokens/s")
    for label, key in (("pre-tokenised TFRecords", "tfrecord_tokens_per_s"), ("text, tokenised on the fly", "text_tokens_per_s")):
        print(f"  {label:30s} {pipe[key]:12,.0f} tokens/s  = {pipe[key] / step:7.1f}x the step")
