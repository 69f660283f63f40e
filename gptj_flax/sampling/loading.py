"""The one ``load``: an Orbax checkpoint or a HuggingFace GPT-J directory as a :class:`LanguageModel`.

Weights brought in from HuggingFace compute in the precision they are stored in, and a checkpoint
in the dtype its config states, unless ``dtype`` says otherwise; so the default is the model as it
was trained or published. ``quantize="int8"`` quantises the block projections as they load (one
tensor at a time); a checkpoint written by ``gptj-convert quantize`` is int8 already.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from gptj_flax import partitioning
from gptj_flax.config import KV_CACHE_DTYPES, QUANTIZATIONS, ModelConfig, dtype_name
from gptj_flax.convert import lora as lora_lib
from gptj_flax.convert.hf import HFCheckpoint
from gptj_flax.convert.init_from import check_architecture
from gptj_flax.convert.quantize import round_trip
from gptj_flax.convert.weights import WeightSource, open_weights, parse_init_spec, place_weights
from gptj_flax.data.tokenizer import resolve_tokenizer
from gptj_flax.model import stack_layers, unstack_layers
from gptj_flax.sampling.adapter_bank import AdapterBank
from gptj_flax.sampling.api import LanguageModel
from gptj_flax.sampling.samplers import SamplingError


def load(
    path: str | os.PathLike,
    mesh: partitioning.MeshSpec = None,
    dtype=None,
    *,
    step: int | None = None,
    tokenizer=None,
    quantize: str | None = None,
    adapter: str | os.PathLike | None = None,
    kv_cache: str | None = None,
    adapters: Mapping[str, str | os.PathLike] | None = None,
    max_adapters: int | None = None,
) -> LanguageModel:
    """A :class:`LanguageModel` from ``path``, ready to generate, stream and score.

    Args:
      path: an Orbax checkpoint (a run directory — its latest step — or one step's directory), or
        a HuggingFace GPT-J directory (``hf:DIR``, or any directory with ``config.json`` and
        safetensors / ``pytorch_model.bin`` weights), converted tensor by tensor as it loads.
      mesh: a ``Mesh``, a layout name (``"tp"``, …), ``"data,fsdp,model"`` sizes or a 3-tuple;
        default one device.
      dtype: parameter and compute dtype (``float32``/``fp32``, ``bfloat16``/``bf16``,
        ``float16``/``fp16`` or a numpy dtype). Default: a checkpoint's stored parameters and its
        config's compute dtype; a HuggingFace directory's stored precision for both.
      step: (Orbax checkpoints) this step instead of the latest.
      tokenizer: a tokenizer object, directory or hub name overriding the one that comes with the model.
      quantize: ``"int8"``: store the block projections int8 with a float32 scale per output
        channel (about half a bf16 model's memory; ``dtype`` then sets the compute dtype and the
        other weights'). Default: as stored (int8 for a checkpoint ``gptj-convert quantize`` wrote).
      adapter: LoRA adapters to merge into the weights of ``path`` (the base): a LoRA run directory
        or one of its steps — whose recorded base must be ``path``, unchanged (checked by checksum)
        — or a HuggingFace PEFT directory (``adapter_config.json``). The tokenizer then comes from
        the LoRA run when it saved one. A QLoRA run's adapters are merged into the base's block
        projections as int8 quantisation rounds them, which is what they were trained on.
      kv_cache: ``"int8"``: generation stores cached keys and values int8 with a float32 scale per
        (row, head, slot), about half a bf16 cache's memory. Default: the compute dtype.
      adapters: LoRA adapters to keep beside the base instead of merging one, by name (name →
        directory, each as ``adapter`` takes it, checked as it is): ``generate(…, adapter=NAME)``
        picks one per prompt, in one batch (:attr:`LanguageModel.adapters` adds and removes more).
      max_adapters: how many adapters the model can hold at once (default: as many as ``adapters``).
    """
    _check_options(path, step, quantize, kv_cache)
    mesh = partitioning.make_mesh(partitioning.ONE_DEVICE if mesh is None else mesh)
    name = None if dtype is None else dtype_name(dtype)
    with open_weights(path, step, dtype=name) as source:
        config = for_inference(source, name, quantize, kv_cache)
        if adapter is not None and config.quantize is not None:
            raise SamplingError(
                f"adapter= merges LoRA adapters into float weights, and this model is {config.quantize}: "
                "load the float base with adapter=, or write the merged model with `gptj-convert merge-lora` "
                "and quantise that with `gptj-convert quantize`"
            )
        # Held unrolled, as the Decoder runs them: each layer's weights are buffers of their own
        # that a decode step reads in place, where a scanned stack is sliced at every step.
        unrolled = dataclasses.replace(config, scan_layers=False)
        params, shardings = place_weights(source, unrolled, mesh)
    saved = source.tokenizer_dir
    if adapter is not None:
        params, adapter_tokenizer = _merge_adapter(adapter, path, unrolled, params, mesh)
        saved = adapter_tokenizer or saved
    tokenizer = resolve_tokenizer(tokenizer, saved=saved)
    model = LanguageModel(config, params, tokenizer=tokenizer, mesh=mesh, step=source.step, shardings=shardings)
    if adapters is not None:
        if adapter is not None:
            raise SamplingError(
                "adapter= merges one adapter into the base, adapters= keeps several beside it: give one"
            )
        bank = AdapterBank.build(unrolled, mesh, adapters, max_adapters=max_adapters, base=os.fspath(path))
        model.decoder.use_adapters(bank)
    return model


def _check_options(path, step: int | None, quantize: str | None, kv_cache: str | None) -> None:
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise SamplingError(f"quantize={quantize!r} is not one of {list(QUANTIZATIONS)} (or None: as stored)")
    if kv_cache is not None and kv_cache not in KV_CACHE_DTYPES:
        raise SamplingError(f"kv_cache={kv_cache!r} is not one of {list(KV_CACHE_DTYPES)} (or None: the compute dtype)")
    if step is not None and parse_init_spec(path)[0] == "hf":
        raise SamplingError(
            f"step={step}: a HuggingFace directory holds one set of weights; step= is for Orbax checkpoints"
        )


def for_inference(source: WeightSource, dtype: str | None, quantize: str | None, kv_cache: str | None) -> ModelConfig:
    """The model ``load`` gives: ``source``'s, its parameters in ``dtype`` if given (else a
    checkpoint's as configured, a HuggingFace directory's as stored), its block projections
    ``quantize``d unless they are already, its KV cache in ``kv_cache``."""
    held = dtype or (source.stored_dtype if isinstance(source, HFCheckpoint) else None)
    config = source.model_config
    if held is not None:
        config = dataclasses.replace(config, dtype=held, param_dtype=held)
    if quantize is not None and config.quantize is None:
        config = dataclasses.replace(config, quantize=quantize)
    return config if kv_cache is None else dataclasses.replace(config, kv_cache=kv_cache)


def _merge_adapter(adapter, base_path, model_config, params, mesh):
    """``params`` with ``adapter`` merged in (each kernel keeping its dtype and sharding), and the
    adapter's tokenizer directory if it has one."""
    found = lora_lib.read_adapter(adapter, mesh, model_config)
    check_architecture(found.config.model, model_config, f"adapter {adapter}")
    if found.base is not None:
        given = lora_lib.identify_base(os.fspath(base_path))
        if given.checksum != found.base.checksum:
            raise SamplingError(
                f"adapter {adapter} was trained on the base {found.base.path} (sha256 {found.base.checksum[:12]}…), "
                f"but {base_path} has sha256 {given.checksum[:12]}…: load it onto the base it was trained on"
            )
    adapters = found.adapters
    if found.config.model.quantize is not None:  # QLoRA: trained on the base's int8 rounding
        params = round_trip(params, model_config)
    if found.config.model.scan_layers != model_config.scan_layers:
        adapters = jax.tree.map(jnp.asarray, adapters)
        adapters = (
            stack_layers(adapters, model_config.n_layers) if model_config.scan_layers else unstack_layers(adapters)
        )
    merged = lora_lib.merge_adapters(params, adapters, found.lora)
    placed = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), merged, params)
    return placed, found.tokenizer_dir
