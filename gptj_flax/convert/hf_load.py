"""Sample or serve straight from a HuggingFace GPT-J directory, converting in memory on load.

The GPT-4chan server needed a second backend to run without TPUs; JAX runs on CPU, GPU and TPU
alike, so here a HF directory simply loads into the same :class:`~gptj_flax.sampling.LanguageModel`
as an Orbax checkpoint: tensors are read one at a time and put straight onto their shards.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
from jax.sharding import Mesh

from gptj_flax import partitioning
from gptj_flax.config import DTYPES, Config
from gptj_flax.convert.hf import HFCheckpoint
from gptj_flax.convert.init_from import load_init_params
from gptj_flax.data import load_tokenizer
from gptj_flax.sampling import LanguageModel

HF_PREFIX = "hf:"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")


def is_hf_source(path: str | os.PathLike) -> bool:
    """``hf:DIR``, or a directory holding a ``config.json`` and HF weight files."""
    spec = os.fspath(path)
    if spec.startswith(HF_PREFIX):
        return True
    directory = Path(spec)
    return (directory / "config.json").is_file() and any((directory / f).is_file() for f in WEIGHT_FILES)


def load_hf(path: str | os.PathLike, mesh: Mesh | str | tuple[int, int, int] | None = None, dtype=None, *,
            tokenizer=None) -> LanguageModel:
    """A HF GPT-J directory (``hf:DIR`` or DIR) as a :class:`LanguageModel` on ``mesh`` (default one device).

    ``dtype`` sets parameter and compute dtype (default: float32 parameters, the config's compute
    dtype); the tokenizer comes from the directory unless ``tokenizer`` (object or directory) is given.
    """
    directory = os.fspath(path).removeprefix(HF_PREFIX)
    source = HFCheckpoint.open(directory)
    model_config = source.model_config
    if dtype is not None:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        if name not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
        model_config = dataclasses.replace(model_config, dtype=name, param_dtype=name)
    if mesh is None or not isinstance(mesh, Mesh):
        mesh = partitioning.make_mesh((1, 1, 1) if mesh is None else mesh)
    params = load_init_params(HF_PREFIX + directory, Config(model=model_config), mesh)
    if tokenizer is None and any((Path(directory) / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = load_tokenizer(directory)
    elif isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    return LanguageModel(model_config, params, tokenizer=tokenizer, mesh=mesh, step=0)
