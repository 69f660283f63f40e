"""Slimming: an Orbax checkpoint without its optimiser state, params stored in bf16 or fp16.

For sharing and serving a trained model at a third (bf16 params vs fp32 params + two fp32 Adam
moments) of the size. The config keeps ``param_dtype`` float32, so loading a slim checkpoint for
training upcasts to float32 master params; samplers may load it in the stored half precision.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from gptj_flax.config import dtype_name
from gptj_flax.convert.common import ConversionError, require_float
from gptj_flax.convert.layout import StreamedArray
from gptj_flax.convert.orbax_io import OrbaxParams, write_converted

SLIM_DTYPES = {"bfloat16": np.dtype(jnp.bfloat16), "float16": np.dtype(np.float16)}


def slim(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "bfloat16") -> Path:
    """Checkpoint ``ckpt`` (run or step directory) → ``out``: same step, params only, in ``dtype``
    (``bfloat16`` or ``float16``, any spelling ``dtype_name`` reads)."""
    dtype = dtype_name(dtype)
    if dtype not in SLIM_DTYPES:
        raise ConversionError(f"dtype {dtype!r}: a slim checkpoint stores bfloat16 or float16")
    source = OrbaxParams.open(ckpt)
    require_float(source.config.model, source.directory, "slimming")  # it would cast the int8 weights
    params = traverse_util.unflatten_dict(
        {
            path: StreamedArray(shape, SLIM_DTYPES[dtype], functools.partial(source.read, path), name="/".join(path))
            for path, shape in source.leaf_shapes().items()
        }
    )
    meta = {k: v for k, v in source.meta.items() if k != "step"}
    return write_converted(
        out,
        source.step,
        params=params,
        config=source.config,
        meta={**meta, "slimmed_from": str(Path(str(source.directory)).resolve()), "slim_dtype": dtype},
        tokenizer=source.tokenizer_dir,
    )
