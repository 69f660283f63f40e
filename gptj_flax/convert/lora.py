"""LoRA adapters outside training: the base's identity, merging into the base, and HuggingFace PEFT's format.

A LoRA run's checkpoints hold its adapters (the model's ``lora`` collection) and, in their meta, the
identity of the base they were trained on — where it is and a checksum of its files — never the
base itself. A QLoRA run (``model.quantize`` set) trained its adapters on the int8 rounding of that
base, so merging one merges into the dequantised int8 weights. Everything here reads such a
checkpoint (a run directory or one step), or a PEFT directory (``adapter_config.json`` +
``adapter_model.safetensors``).

Layouts: our adapter for a projection with kernel [*in, *out] is ``a`` [*in, rank] and ``b``
[rank, *out]; PEFT's ``lora_A.weight`` is [rank, in] and ``lora_B.weight`` [out, rank] (torch Linear
layout), with in/out flattened as GPT-J HF flattens heads × head_dim.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from etils import epath
from flax import traverse_util
from jax.sharding import Mesh

from gptj_flax import checkpoint, partitioning
from gptj_flax.config import Config, LoraConfig, ModelConfig
from gptj_flax.convert.common import ConversionError, atomic_directory, copy_tokenizer_files, scratch_directory
from gptj_flax.convert.hf import DEFAULT_MAX_SHARD_SIZE, to_hf
from gptj_flax.convert.init_from import load_init_params, parse_init_spec
from gptj_flax.convert.layout import StreamedArray
from gptj_flax.convert.orbax_io import OrbaxParams, write_checkpoint
from gptj_flax.convert.quantize import dequantize_params
from gptj_flax.model import abstract_adapters, stack_layers, unstack_layers

BASE_KEY = checkpoint.LORA_BASE_KEY  # the meta key of a LoRA checkpoint that names its base
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"

# Where each projection's kernel and adapter sit within one layer of the params / lora trees.
KERNEL_PATHS = {
    "q_proj": ("attn", "q_proj"),
    "k_proj": ("attn", "k_proj"),
    "v_proj": ("attn", "v_proj"),
    "out_proj": ("attn", "out_proj"),
    "fc_in": ("mlp", "fc_in", "kernel"),
    "fc_out": ("mlp", "fc_out", "kernel"),
}
ADAPTER_PATHS = {name: (path[0], f"{name}_lora") for name, path in KERNEL_PATHS.items()}
HF_MODULES = {name: f"{path[0]}.{name}" for name, path in KERNEL_PATHS.items()}  # q_proj → attn.q_proj
_PEFT_KEY = re.compile(r"^base_model\.model\.transformer\.h\.(\d+)\.(attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ConversionError):
    """A LoRA checkpoint, its base or a PEFT adapter is missing, changed or does not fit."""


# --------------------------------------------------------------------------------------------
# The base's identity


@dataclasses.dataclass(frozen=True)
class BaseIdentity:
    """Where a LoRA run's base is (an ``--init-from`` spec, an Orbax base pinned to its step) and the
    SHA-256 of its files, so a resumed run or a merge refuses a base that changed."""

    path: str
    checksum: str
    bytes: int  # the base's size on disk

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: dict, where: str) -> BaseIdentity:
        raw = meta.get(BASE_KEY)
        if not isinstance(raw, dict) or not {"path", "checksum", "bytes"} <= raw.keys():
            raise LoRAError(
                f"{where} records no base model ('{BASE_KEY}' in its meta): it is not a LoRA checkpoint "
                "written by gptj_flax, or its meta is damaged"
            )
        return cls(str(raw["path"]), str(raw["checksum"]), int(raw["bytes"]))


def base_files_dir(spec: str) -> tuple[str, epath.Path]:
    """``(canonical spec, the directory whose files are the base)``: an Orbax run directory is pinned
    to its latest step, so later saves into it are not mistaken for a changed base."""
    kind, location = parse_init_spec(spec)
    if kind != "orbax":
        return f"{kind}:{checkpoint.absolute_path(location)}", checkpoint.absolute_path(location)
    if not checkpoint.absolute_path(location).exists():
        raise LoRAError(f"the base model {location} does not exist")
    stored = OrbaxParams.open(location)
    step_dir = stored.directory / str(stored.step)
    return str(step_dir), step_dir


def _files(directory: epath.Path) -> list[epath.Path]:
    """Every file under ``directory``, in name order (``rglob`` is refused for remote paths)."""
    out: list[epath.Path] = []
    for child in sorted(directory.iterdir(), key=lambda p: p.name):
        out.extend(_files(child) if child.is_dir() else [child])
    return out


def disk_bytes(directory: epath.Path) -> int:
    return sum(p.stat().length for p in _files(directory))


def _checksum(directory: epath.Path) -> tuple[str, int]:
    """SHA-256 over every file under ``directory`` (relative name and content, in name order) and their total size."""
    if not directory.is_dir():
        raise LoRAError(f"the base model {directory} does not exist (or is not a directory)")
    digest, total = hashlib.sha256(), 0
    for path in _files(directory):
        digest.update(os.fspath(path.relative_to(directory)).encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
                total += len(chunk)
    return digest.hexdigest(), total


def identify_base(spec: str) -> BaseIdentity:
    """The identity of the base ``spec`` (``hf:DIR``, ``legacy:DIR`` or an Orbax checkpoint) as it is now."""
    path, directory = base_files_dir(spec)
    checksum, size = _checksum(directory)
    return BaseIdentity(path, checksum, size)


def verify_base(recorded: BaseIdentity, where: str) -> None:
    """Refuse a base that has gone or whose files changed since ``where`` recorded it."""
    kind, location = parse_init_spec(recorded.path)
    if not checkpoint.absolute_path(location).exists():
        raise LoRAError(
            f"{where} was trained on the base model {recorded.path}, which no longer exists: put it back "
            "(the adapters are useless without the exact base they were trained on)"
        )
    checksum, _ = _checksum(checkpoint.absolute_path(location))
    if checksum != recorded.checksum:
        raise LoRAError(
            f"the base model {recorded.path} changed since {where} was trained on it (SHA-256 of its files "
            f"{checksum[:12]}…, recorded {recorded.checksum[:12]}…): restore the original base"
        )


def base_model_config(config: Config) -> ModelConfig:
    """A LoRA run's base as it is held in memory: frozen, stored in bfloat16 (with its block
    projections int8 where ``model.quantize`` is set: QLoRA)."""
    return dataclasses.replace(config.model, param_dtype="bfloat16")


def load_base(recorded: BaseIdentity, config: Config, mesh: Mesh, where: str, *, verify: bool = True) -> dict:
    """The base params of a LoRA checkpoint on ``mesh``, in ``config.model.param_dtype``, after checking it."""
    if verify:
        verify_base(recorded, where)
    return load_init_params(recorded.path, config, mesh)


# --------------------------------------------------------------------------------------------
# Reading adapters


@dataclasses.dataclass
class Adapter:
    """A LoRA adapter as read: its config, its arrays (our ``lora`` tree, on a mesh or in host
    memory) and its base (None for a PEFT directory, which names none we can check)."""

    config: Config  # the run's config (a PEFT adapter's: its model's, with train.lora filled in)
    adapters: dict
    base: BaseIdentity | None
    step: int
    where: str
    tokenizer_dir: epath.Path | None = None

    @property
    def lora(self) -> LoraConfig:
        assert self.config.train.lora is not None
        return self.config.train.lora


def is_peft_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / PEFT_CONFIG).is_file()


def adapter_targets(config: Config, mesh: Mesh) -> Any:
    """Restore targets (ShapeDtypeStruct with shardings) of a LoRA run's adapters on ``mesh``."""
    assert config.train.lora is not None
    targets, _ = partitioning.restore_targets(abstract_adapters(config.model, config.train.lora), mesh)
    return targets


def read_adapter(path: str | os.PathLike, mesh: Mesh | None = None, model_config: ModelConfig | None = None) -> Adapter:
    """The adapter at ``path``: a LoRA run directory (its latest step), one step of it, or a PEFT
    directory (which needs ``model_config``, the base's, to know the shapes)."""
    mesh = mesh or partitioning.make_mesh(partitioning.ONE_DEVICE)
    if is_peft_dir(path):
        if model_config is None:
            raise LoRAError(f"{path} is a PEFT adapter: give the base model too, which says the shapes")
        return read_peft(path, model_config)
    directory, step = checkpoint.split_step_path(checkpoint.absolute_path(path))
    if not directory.exists():
        raise LoRAError(f"adapter {path} does not exist")
    ckpt = checkpoint.Checkpointer(directory, read_only=True)
    try:
        step = ckpt.resolve_step(step)
        config = ckpt.read_config(step)
        where = f"{directory}/{step}"
        if config.train.lora is None:
            raise LoRAError(f"{where} is not a LoRA checkpoint (its config has no train.lora)")
        base = BaseIdentity.from_meta(ckpt.read_json(step, "meta"), where)
        adapters = ckpt.restore_item(step, "params", adapter_targets(config, mesh))
    finally:
        ckpt.close()
    return Adapter(config, adapters, base, step, where, checkpoint.tokenizer_dir(directory))


# --------------------------------------------------------------------------------------------
# Merging


def _layer_groups(adapters: dict) -> list[tuple[str, bool]]:
    """``(key, stacked)`` of each layer subtree: ``layers`` (scanned, stacked on axis 0) or ``layer_i``."""
    return [(key, key == "layers") for key in adapters]


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def lora_update(a, b, scale: float, stacked: bool):
    """``scale · a @ b`` in float32 with a's input dims and b's output dims (a leading layer axis if stacked)."""
    xp = np if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) else jnp
    lead = a.shape[:1] if stacked else ()
    rank = b.shape[len(lead)]
    in_dims, out_dims = a.shape[len(lead) : -1], b.shape[len(lead) + 1 :]
    a2 = a.reshape(*lead, -1, rank).astype(np.float32)
    b2 = b.reshape(*lead, rank, -1).astype(np.float32)
    return (scale * xp.matmul(a2, b2)).reshape(*lead, *in_dims, *out_dims)


def _adapted_kernels(adapters: dict, lora: LoraConfig) -> dict[tuple[str, ...], tuple[dict, bool]]:
    """Each adapted kernel's path in the params tree, with its adapter (``a``, ``b``) and whether its
    layers are stacked."""
    return {
        (group, *KERNEL_PATHS[name]): (_get(adapters[group], ADAPTER_PATHS[name]), stacked)
        for group, stacked in _layer_groups(adapters)
        for name in lora.projections
    }


def _merged_kernel(kernel, ab: dict, lora: LoraConfig, stacked: bool, path: tuple[str, ...], dtype=None):
    update = lora_update(ab["a"], ab["b"], lora.scale, stacked)
    if update.shape != kernel.shape:
        raise LoRAError(f"adapter {'/'.join(path)}: update {update.shape} does not fit kernel {kernel.shape}")
    return (kernel.astype(np.float32) + update).astype(dtype or kernel.dtype)


def merge_adapters(params: dict, adapters: dict, lora: LoraConfig, dtype=None) -> dict:
    """``params`` with every adapted kernel replaced by ``W + (alpha/rank)·A@B``, in ``dtype``
    (default each kernel's own). Both trees must be in the same layer layout."""
    merged = jax.tree.map(lambda x: x, params)  # a new tree: the caller's is left as it is
    for path, (ab, stacked) in _adapted_kernels(adapters, lora).items():
        _set(merged, path, _merged_kernel(_get(merged, path), ab, lora, stacked, path, dtype))
    return merged


def merged_streamed(params: dict, adapters: dict, lora: LoraConfig) -> dict:
    """:func:`merge_adapters` as :class:`StreamedArray` leaves: each kernel is merged as it is written, so a
    writer holds one merged leaf at a time and can stop between leaves (Ctrl-C, a failure)."""
    kernels = _adapted_kernels(adapters, lora)

    def produce(path: tuple[str, ...], leaf) -> np.ndarray:
        if path not in kernels:
            return np.asarray(leaf)
        ab, stacked = kernels[path]
        return np.asarray(_merged_kernel(leaf, ab, lora, stacked, path))

    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict(
        {
            path: StreamedArray(leaf.shape, leaf.dtype, functools.partial(produce, path, leaf), "/".join(path))
            for path, leaf in flat.items()
        }
    )


def merge_lora(src: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "float32") -> Path:
    """LoRA checkpoint ``src`` (run or step directory) → ``out``: an ordinary checkpoint of the base with
    the adapters merged in (parameters ``dtype``), written atomically. The base is verified first."""
    mesh = partitioning.make_mesh(partitioning.ONE_DEVICE)
    adapter = read_adapter(src, mesh)
    assert adapter.base is not None
    model = dataclasses.replace(adapter.config.model, param_dtype=dtype)
    base = load_base(adapter.base, Config(model=model, mesh=adapter.config.mesh), mesh, adapter.where)
    if model.quantize is not None:  # QLoRA: merged into the dequantised int8 base it was trained on
        base, model = dequantize_params(base, dtype), dataclasses.replace(model, quantize=None)
    config = Config(model=model, mesh=adapter.config.mesh)
    merged = merged_streamed(base, adapter.adapters, adapter.lora)
    with atomic_directory(out) as tmp:
        write_checkpoint(
            tmp,
            adapter.step,
            params=merged,
            config=config,
            meta={"merged_lora": adapter.where, "lora_base_path": adapter.base.path},
        )
        tokenizer = adapter.tokenizer_dir
        copy_tokenizer_files(Path(str(tokenizer)) if tokenizer else None, tmp / checkpoint.TOKENIZER_DIR)
    return Path(out)


def to_hf_merged(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str = "float32",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """LoRA checkpoint ``src`` → HF GPT-J directory ``out`` of the base with the adapters merged in.

    The merged model goes through a temporary float32 checkpoint beside ``out`` (removed after), so
    the export is exactly ``merge_lora`` followed by ``to_hf``.
    """
    parent = Path(out).resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    with scratch_directory(parent, ".merge-lora-") as scratch:
        merged = merge_lora(src, scratch / "merged")
        return to_hf(merged, out, dtype=dtype, max_shard_size=max_shard_size)


# --------------------------------------------------------------------------------------------
# HuggingFace PEFT


def _unrolled_numpy(adapters: dict) -> dict:
    host = jax.tree.map(np.asarray, adapters)
    return unstack_layers(host) if "layers" in host else host


def to_peft(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """LoRA checkpoint ``src`` → PEFT directory ``out`` (float32), which ``peft.PeftModel.from_pretrained``
    loads onto ``transformers.GPTJForCausalLM`` of the base (e.g. our ``to_hf`` export of it)."""
    adapter = read_adapter(src)
    lora = adapter.lora
    tensors = {}
    for group, layer in _unrolled_numpy(adapter.adapters).items():
        index = int(group.removeprefix("layer_"))
        for name in lora.projections:
            ab = _get(layer, ADAPTER_PATHS[name])
            prefix = f"base_model.model.transformer.h.{index}.{HF_MODULES[name]}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(ab["a"].reshape(-1, lora.rank).T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(ab["b"].reshape(lora.rank, -1).T)
    assert adapter.base is not None
    kind, location = parse_init_spec(adapter.base.path)
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": location if kind == "hf" else None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": list(lora.projections),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    with atomic_directory(out) as tmp:
        safetensors.numpy.save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
        (tmp / PEFT_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")
    return Path(out)


def read_peft(path: str | os.PathLike, model_config: ModelConfig) -> Adapter:
    """A PEFT LoRA directory for GPT-J as an :class:`Adapter` in ``model_config``'s layer layout (host arrays)."""
    directory = Path(path)
    raw = json.loads((directory / PEFT_CONFIG).read_text())
    if raw.get("peft_type") != "LORA":
        raise LoRAError(f"{directory}/{PEFT_CONFIG}: peft_type {raw.get('peft_type')!r}, only LORA adapters load")
    for key, supported in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if raw.get(key, supported) != supported:
            raise LoRAError(f"{directory}/{PEFT_CONFIG}: {key}={raw[key]!r} is not supported (only {supported!r})")
    modules = raw.get("target_modules")
    targets = [modules] if isinstance(modules, str) else list(modules or [])
    lora = LoraConfig(rank=raw["r"], alpha=raw["lora_alpha"], targets=tuple(targets))
    if not (directory / PEFT_WEIGHTS).is_file():
        raise LoRAError(f"{directory} has no {PEFT_WEIGHTS}")
    tensors = safetensors.numpy.load_file(str(directory / PEFT_WEIGHTS))
    unrolled = dataclasses.replace(model_config, scan_layers=False)
    shapes = nn.meta.unbox(abstract_adapters(unrolled, lora))
    adapters = jax.tree.map(lambda s: None, shapes)
    for key, tensor in tensors.items():
        m = _PEFT_KEY.match(key)
        if not m or m.group(3) not in lora.projections:
            raise LoRAError(
                f"{directory}/{PEFT_WEIGHTS}: unexpected tensor {key!r} for a GPT-J LoRA on {lora.projections}"
            )
        layer, name, which = f"layer_{m.group(1)}", m.group(3), m.group(4)
        if layer not in shapes:
            raise LoRAError(
                f"{directory}: {key} is for a layer the base model (n_layers={model_config.n_layers}) lacks"
            )
        leaf = "a" if which == "A" else "b"
        want = _get(shapes[layer], ADAPTER_PATHS[name])[leaf].shape
        array = tensor.T.reshape(want).astype(np.float32)
        _get(adapters[layer], ADAPTER_PATHS[name])[leaf] = array
    missing = [
        "/".join(map(str, p))
        for p, v in jax.tree_util.tree_leaves_with_path(adapters, is_leaf=lambda x: x is None)
        if v is None
    ]
    if missing:
        raise LoRAError(f"{directory}/{PEFT_WEIGHTS} lacks adapters for {missing[:4]}")
    if model_config.scan_layers:
        adapters = stack_layers(adapters, model_config.n_layers)
    plain = Config(model=model_config)
    config = plain.replace(train=dataclasses.replace(plain.train, lora=lora))
    return Adapter(config, adapters, None, 0, str(directory))
