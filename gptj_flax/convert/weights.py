"""Weights from any source onto a mesh: one resolver, :func:`open_weights`, and one placement,
:func:`place_weights`, for ``gptj_flax.load`` and for training's ``--init-from`` alike.

A source is a HuggingFace GPT-J directory, a mesh-transformer-jax checkpoint or an Orbax
checkpoint; each knows the model it holds (``model_config``), its ``step`` and its
``tokenizer_dir``. Placing traces the wanted model's parameter tree once (:class:`ParamTree`) and
derives everything else from it: an Orbax checkpoint that holds what is asked for is restored
natively, each process reading its own shards; any other source is streamed one tensor at a time
onto its shards, quantised on the way where the model is int8, and HuggingFace or legacy tensors
go straight into whichever layer layout the model has, with no stacking on the host.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from gptj_flax import checkpoint, partitioning
from gptj_flax.config import ModelConfig
from gptj_flax.convert.common import ConversionError, require_float
from gptj_flax.convert.hf import HFCheckpoint, is_hf_source
from gptj_flax.convert.layout import ParamTree, place_on_mesh, streamed_params
from gptj_flax.convert.legacy import LegacyCheckpoint
from gptj_flax.convert.orbax_io import OrbaxParams
from gptj_flax.convert.quantize import orbax_streamed, quantize_streamed
from gptj_flax.model import stack_layers, unstack_layers

WeightSource = HFCheckpoint | LegacyCheckpoint | OrbaxParams


def open_weights(
    spec: str | os.PathLike,
    step: int | None = None,
    *,
    dtype: str | None = None,
    model_config: ModelConfig | None = None,
    legacy_shards: int | None = None,
) -> WeightSource:
    """The source ``spec`` names, opened and validated (use it in ``with``: it may hold files open).

    ``hf:DIR`` or a directory with ``config.json`` and HuggingFace weights (``dtype``: the compute
    dtype, as :meth:`HFCheckpoint.open` takes it); ``legacy:DIR``, a mesh-transformer-jax step
    directory, which records no config, so it is read as ``model_config`` (``legacy_shards``: its
    shard count, when known); anything else, an Orbax run directory (its latest step, or ``step``)
    or one step's directory.
    """
    kind, location = parse_init_spec(spec)
    if kind == "orbax":
        return OrbaxParams.open(location, step)
    if step is not None:
        raise ConversionError(
            f"step={step}: {spec} holds one set of weights; step= is for Orbax checkpoints, which hold several"
        )
    if kind == "hf":
        return HFCheckpoint.open(location, dtype=dtype)
    if model_config is None:
        raise ConversionError(
            f"{spec}: a mesh-transformer-jax checkpoint records no model config; convert it with "
            f"`gptj-convert from-legacy {location} OUT --config CONFIG` and load OUT"
        )
    return LegacyCheckpoint(location, model_config, legacy_shards)


def parse_init_spec(spec: str | os.PathLike) -> tuple[str, str]:
    """``hf:DIR`` or a HuggingFace directory → ("hf", DIR), ``legacy:DIR`` → ("legacy", DIR),
    anything else → ("orbax", spec)."""
    text = os.fspath(spec)
    for kind in ("hf", "legacy"):
        if text.startswith(f"{kind}:"):
            location = text[len(kind) + 1 :]
            if not location:
                raise ConversionError(f"{text!r}: give a directory after '{kind}:'")
            return kind, location
    return ("hf" if is_hf_source(text) else "orbax"), text


class Placed(NamedTuple):
    params: dict  # jax.Arrays, each on its shards
    shardings: Any  # the matching tree of NamedShardings


def place_weights(
    source: WeightSource, config: ModelConfig, mesh: Mesh, rules: partitioning.Rules = partitioning.DEFAULT_RULES
) -> Placed:
    """``config``'s parameters from ``source`` on ``mesh``: in its layer layout, ``param_dtype`` and
    quantisation (``config.quantize``: int8 block projections, quantised here from the source's
    float values unless it stores them int8), placed as ``rules`` say.

    ``source`` must hold ``config``'s architecture (see ``check_architecture``); an int8 one loads
    only as int8.
    """
    tree = ParamTree.of(config)  # the one trace: every target, shape and kernel below comes from it
    stored = source.model_config.quantize
    if stored is not None and stored != config.quantize:
        require_float(source.model_config, _where(source), "loading it as float weights")
    if not isinstance(source, OrbaxParams):
        read_dtype = np.float32 if config.quantize else None  # quantise from the source's own values
        streamed = streamed_params(source.get, config, read_dtype, shapes=tree.shapes(scales=False))
        return Placed(_place_streamed(streamed, tree, mesh, rules, _desc(source, config)), tree.shardings(mesh, rules))
    as_stored = tree.in_layout(source.model_config.scan_layers)
    if stored == config.quantize:
        params = _restore(source, as_stored, mesh, rules)
    else:
        streamed = orbax_streamed(source, as_stored.shapes(scales=False))
        params = _place_streamed(streamed, as_stored, mesh, rules, _desc(source, config))
    return _in_layout(params, tree, mesh, rules)


def _place_streamed(streamed: dict, tree: ParamTree, mesh: Mesh, rules: partitioning.Rules, desc: str) -> dict:
    """Float ``streamed`` leaves onto ``tree``'s targets, quantised first where ``tree`` is int8."""
    if tree.config.quantize is not None:
        float_config = dataclasses.replace(tree.config, quantize=None)
        _, streamed = quantize_streamed(streamed, float_config, tree.quantized_kernels())
    targets, _ = tree.targets(mesh, rules)
    return place_on_mesh(streamed, targets, desc=desc)


def _restore(source: OrbaxParams, tree: ParamTree, mesh: Mesh, rules: partitioning.Rules) -> dict:
    """The checkpoint's params restored natively onto ``tree``'s targets (its own layout and
    quantisation), every chunk checked against its checksum."""
    targets, _ = tree.targets(mesh, rules)
    ckpt = checkpoint.Checkpointer(source.directory, read_only=True)
    try:
        return ckpt.restore_item(source.step, "params", targets)
    finally:
        ckpt.close()


def _in_layout(params: dict, tree: ParamTree, mesh: Mesh, rules: partitioning.Rules) -> Placed:
    """Placed ``params`` in ``tree``'s layer layout: stacked or split on the devices where they
    were stored the other way, then put on ``tree``'s shardings."""
    shardings = tree.shardings(mesh, rules)
    if ("layers" in params) != tree.config.scan_layers:
        params = stack_layers(params, tree.config.n_layers) if tree.config.scan_layers else unstack_layers(params)
        params = jax.device_put(params, shardings)
    return Placed(params, shardings)


def _where(source: WeightSource) -> str:
    if isinstance(source, OrbaxParams):
        return f"{source.directory}/{source.step}"
    return str(source.directory if isinstance(source, HFCheckpoint) else source.step_dir)


def _desc(source: WeightSource, config: ModelConfig) -> str:
    kind = {HFCheckpoint: "hf", LegacyCheckpoint: "legacy", OrbaxParams: "orbax"}[type(source)]
    return f"loading {kind} weights" + ("" if config.quantize is None else f", quantising to {config.quantize}")
