"""Token-weighted loss and perplexity of a checkpoint over a dataset (TFRecords, text or TFDS).

The data are cut exactly as for validation during training (``gptj_flax.data.make_eval_batches``:
every sequence once, documents packed with EOS between them and never attending across it), and
scored with the training eval step, so the numbers here and the run's ``val/loss_*`` agree.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from gptj_flax import data, partitioning
from gptj_flax.model import GPTJ
from gptj_flax.sampling import load
from gptj_flax.training import steps


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    loss: float  # mean negative log-likelihood per predicted token (nats)
    perplexity: float
    tokens: int  # predicted tokens counted
    batches: int
    checkpoint: str
    step: int | None  # None for a HuggingFace directory
    source: str
    seq_len: int
    param_dtype: str  # how the parameters were held
    dtype: str  # the compute dtype

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def perplexity(
    path: str | os.PathLike,
    source,
    *,
    mesh: Mesh | str | tuple[int, int, int] | None = None,
    seq_len: int | None = None,
    batch_size: int = 8,
    max_batches: int | None = None,
    dtype: str | None = None,
    step: int | None = None,
    tokenizer=None,
    tfds_data_dir: str | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Loss and perplexity of the checkpoint at ``path`` over ``source``.

    Args:
      source: anything ``gptj_flax.data.open_source`` opens: an ``.index`` or ``.tfrecords`` file,
        text/jsonl files or directories, or ``tfds:NAME[@SPLIT]``.
      mesh: a ``Mesh``, layout name, ``"data,fsdp,model"`` sizes or 3-tuple; default one device.
      seq_len: tokens per sequence; default the model's context.
      batch_size: sequences per step (global, a multiple of the data-parallel size).
      max_batches: only the first this many batches (default: the whole source).
      dtype: parameter and compute dtype (any spelling ``dtype_name`` reads); default as
        :func:`gptj_flax.load` chooses.
      tokenizer: for text and TFDS; default the one that comes with the model.
    """
    model = load(path, mesh, dtype, step=step, tokenizer=tokenizer)
    mesh, model_config, params, tokenizer = model.mesh, model.decoder.config, model.decoder.params, model.tokenizer
    seq_len = seq_len or model_config.max_len
    if seq_len > model_config.max_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's context of {model_config.max_len} tokens")
    data_parallel = partitioning.data_parallel_size(mesh)
    if batch_size % data_parallel:
        raise ValueError(
            f"batch_size={batch_size} is not a multiple of the {data_parallel} data-parallel shards "
            f"of mesh {partitioning.mesh_shape(mesh)}"
        )

    sharding = steps.batch_sharding(mesh, accumulated=False)
    share, n_shares = data.process_share(sharding, (batch_size, seq_len + 1), 0)
    batches = data.make_eval_batches(
        source,
        seq_len=seq_len,
        batch_size=batch_size,
        n_batches=max_batches,
        tokenizer=tokenizer,
        process_index=share,
        process_count=n_shares,
        tfds_data_dir=tfds_data_dir,
        progress=progress,
        vocab_size=model_config.vocab_size,
    )
    eval_step = steps.compile_eval_step(
        GPTJ(model_config), jax.tree.map(lambda x: x.sharding, params), data_sharding=sharding
    )

    loss_sum = tokens = 0.0
    bar = tqdm(batches, desc="perplexity", unit="batch", disable=not progress or jax.process_index() != 0)
    with partitioning.sharding_scope(mesh):
        for local in bar:
            result = jax.device_get(eval_step(params, data.to_global_batch(local, sharding)))
            loss_sum += float(result["loss_sum"])
            tokens += float(result["tokens"])
            running = loss_sum / max(tokens, 1.0)
            bar.set_postfix(loss=f"{running:.4f}", ppl=f"{math.exp(min(running, 50.0)):.3f}")
    loss = loss_sum / max(tokens, 1.0)
    return PerplexityResult(
        loss=loss,
        perplexity=math.exp(loss) if loss < 700 else math.inf,
        tokens=int(tokens),
        batches=len(batches),
        checkpoint=os.fspath(path),
        step=model.step,
        source=str(source),
        seq_len=seq_len,
        param_dtype=model.param_dtype,
        dtype=model.compute_dtype,
    )
