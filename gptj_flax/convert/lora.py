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
import math
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
from gptj_flax.config import Config, ConfigError, LoraConfig, ModelConfig, max_lora_rank, projection_shape
from gptj_flax.convert import safetensors_io
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


def _refuse_non_adapter_path(path: epath.Path) -> None:
    """Refuse a file, or half a PEFT directory, where an adapter directory is expected."""
    if path.is_dir() and (path / PEFT_WEIGHTS).is_file():
        raise LoRAError(f"adapter {path} has {PEFT_WEIGHTS} but no {PEFT_CONFIG}: it is an incomplete PEFT adapter")
    if path.is_dir():
        return
    if path.name in (PEFT_CONFIG, PEFT_WEIGHTS):
        raise LoRAError(f"adapter {path} is a file: give the PEFT directory that holds it, {path.parent}")
    raise LoRAError(
        f"adapter {path} is a file: give a LoRA run directory, one of its step directories, or a PEFT "
        f"directory ({PEFT_CONFIG} and {PEFT_WEIGHTS})"
    )


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
    _refuse_non_adapter_path(directory)
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


# adapter_config.json fields that change what an adapter computes, each with the value it must have
# (PEFT's default) for the merge here to be what PEFT computes. rank_pattern and alpha_pattern are
# honoured; the other fields (dropout, initialisation, task) only shape training.
_PEFT_FIXED: dict[str, Any] = {
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "use_qalora": False,
    "layers_to_transform": None,
    "exclude_modules": None,
    "layer_replication": None,
    "modules_to_save": None,
    "trainable_token_indices": None,
    "target_parameters": None,
    "alora_invocation_tokens": None,
    "use_bdlora": None,
    "arrow_config": None,
    "kasa_config": None,
    "monteclora_config": None,
}


@dataclasses.dataclass(frozen=True)
class PeftSettings:
    """What a PEFT ``adapter_config.json`` says about the adapters' shapes and scales."""

    path: Path  # the adapter_config.json
    lora: LoraConfig  # r, lora_alpha and target_modules
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """The rank and alpha of ``module`` (``transformer.h.3.attn.q_proj``) as PEFT picks them."""
        return (
            _by_pattern(self.rank_pattern, module, self.lora.rank),
            _by_pattern(self.alpha_pattern, module, self.lora.alpha),
        )


def _by_pattern(patterns: dict, module: str, default):
    """PEFT's rule: the first pattern that matches the end of the module's dotted name, else ``default``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _peft_value(path: Path, key: str, value: Any, kind: str) -> Any:
    """``value`` of ``key`` checked as a positive ``int`` (a rank) or a finite positive number (an alpha)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if kind == "rank":
        ok = ok and isinstance(value, int)
    if not ok:
        want = "a positive integer" if kind == "rank" else "a finite positive number"
        raise LoRAError(f"{path}: {key} must be {want}, got {value!r}")
    return value


def _peft_patterns(path: Path, raw: dict, key: str, kind: str) -> dict:
    patterns = raw.get(key) or {}
    if not isinstance(patterns, dict):
        raise LoRAError(f"{path}: {key} must be an object of module patterns, got {patterns!r}")
    for pattern, value in patterns.items():
        try:
            re.compile(pattern)
        except re.error as e:
            raise LoRAError(f"{path}: {key} pattern {pattern!r} is not a regular expression ({e})") from None
        _peft_value(path, f"{key}[{pattern!r}]", value, kind)
    return dict(patterns)


def _peft_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"{path} is not JSON ({e}): write the adapter again with PEFT's save_pretrained") from None
    if not isinstance(raw, dict):
        raise LoRAError(f"{path} holds {type(raw).__name__}, not a JSON object of PEFT settings")
    return raw


def read_peft_settings(path: Path) -> PeftSettings:
    """``adapter_config.json`` at ``path``, checked: a LoRA adapter whose every setting is one the
    merge here computes as PEFT does."""
    raw = _peft_json(path)
    if raw.get("peft_type") != "LORA":
        raise LoRAError(f"{path}: peft_type {raw.get('peft_type')!r}, only LORA adapters load")
    for key, default in _PEFT_FIXED.items():
        value = raw.get(key)
        if value is not None and value != default and (default is not None or value not in ([], {})):
            raise LoRAError(f"{path}: {key}={value!r} is not supported (only {default!r}, PEFT's default)")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in raw:
            raise LoRAError(f"{path} has no {key!r}: it is not a complete PEFT LoRA config")
    rank = _peft_value(path, "r", raw["r"], "rank")
    alpha = _peft_value(path, "lora_alpha", raw["lora_alpha"], "alpha")
    modules = [raw["target_modules"]] if isinstance(raw["target_modules"], str) else raw["target_modules"]
    if not isinstance(modules, list):
        raise LoRAError(f"{path}: target_modules must be a list of module names, got {modules!r}")
    try:
        lora = LoraConfig(rank=rank, alpha=alpha, targets=tuple(modules))
    except ConfigError as e:
        raise LoRAError(f"{path}: {str(e).replace('train.lora.targets', 'target_modules')}") from None
    rank_pattern = _peft_patterns(path, raw, "rank_pattern", "rank")
    alpha_pattern = _peft_patterns(path, raw, "alpha_pattern", "alpha")
    return PeftSettings(path, lora, rank_pattern, alpha_pattern)


def _peft_tensors(path: Path, settings: PeftSettings, n_layers: int) -> dict[str, safetensors_io.TensorInfo]:
    """The tensors of ``adapter_model.safetensors`` at ``path``, each one an adapter of the base."""
    if not path.is_file():
        raise LoRAError(f"{path.parent} has no {PEFT_WEIGHTS}")
    tensors = safetensors_io.read_header(path)
    for key in tensors:
        m = _PEFT_KEY.match(key)
        if not m or m.group(3) not in settings.lora.projections:
            raise LoRAError(f"{path}: unexpected tensor {key!r} for a GPT-J LoRA on {settings.lora.projections}")
        if int(m.group(1)) >= n_layers:
            raise LoRAError(f"{path}: {key} is for a layer the base model (n_layers={n_layers}) lacks")
    return tensors


def _peft_matrix(tensors: dict, key: str, want: tuple[int, int], rank: int, model_config: ModelConfig) -> np.ndarray:
    """One ``lora_A``/``lora_B`` weight as float32, checked for its shape and finite values."""
    info = tensors[key]
    if info.shape != want:
        rank_axis = 0 if key.endswith("lora_A.weight") else 1
        if len(info.shape) == 2 and info.shape[1 - rank_axis] == want[1 - rank_axis]:
            why = f"its rank is {info.shape[rank_axis]} but {PEFT_CONFIG} gives {rank} (r, or rank_pattern)"
        else:
            why = (
                "it was made for a model of other dimensions than this base "
                f"(d_model={model_config.d_model}, d_ff={model_config.ff_dim})"
            )
        raise LoRAError(f"{info.path}: tensor {key} has shape {info.shape}, not {want}: {why}")
    if not np.issubdtype(info.dtype, np.floating) and info.dtype != np.dtype(jnp.bfloat16):
        raise LoRAError(f"{info.path}: tensor {key} is {info.dtype}, not floating point")
    matrix = safetensors_io.read_tensor(info).astype(np.float32)
    if not np.isfinite(matrix).all():
        raise LoRAError(
            f"{info.path}: tensor {key} holds NaN or infinite values (training diverged?): the adapter is unusable"
        )
    return matrix


def _peft_module(tensors: dict, settings: PeftSettings, layer: int, name: str, model_config: ModelConfig):
    """Our ``a`` [in, r] and ``b`` [r, out] of one projection, at its own rank, its ``alpha/r`` folded into ``b``."""
    module = f"transformer.h.{layer}.{HF_MODULES[name]}"
    prefix = f"base_model.model.{module}"
    rank, alpha = settings.rank_and_alpha(module)
    n_in, n_out = projection_shape(model_config, name)
    a = _peft_matrix(tensors, f"{prefix}.lora_A.weight", (rank, n_in), rank, model_config).T
    b = _peft_matrix(tensors, f"{prefix}.lora_B.weight", (n_out, rank), rank, model_config).T
    return a, b * np.float32(alpha / rank)


def _check_peft_rank(settings: PeftSettings, rank: int, model_config: ModelConfig) -> None:
    limit, name = max_lora_rank(model_config, settings.lora.projections)
    if rank > limit:
        rows, cols = projection_shape(model_config, name)
        raise LoRAError(
            f"{settings.path}: rank {rank} (r, or rank_pattern) exceeds {limit}, the rank of a full update of this "
            f"base's {name} ({rows}×{cols}): an adapter of higher rank was not made for a model of this size"
        )


def read_peft(path: str | os.PathLike, model_config: ModelConfig) -> Adapter:
    """A PEFT LoRA directory for GPT-J as an :class:`Adapter` in ``model_config``'s layer layout (host arrays).

    Per-module ranks and alphas (``rank_pattern``, ``alpha_pattern``) apply as PEFT applies them: each
    module's ``alpha/r`` is folded into its ``b`` and its rank padded with zeros to the largest, so the
    adapter is one of that rank and scale 1.
    """
    directory = Path(path)
    settings = read_peft_settings(directory / PEFT_CONFIG)
    tensors = _peft_tensors(directory / PEFT_WEIGHTS, settings, model_config.n_layers)
    modules = [(layer, name) for layer in range(model_config.n_layers) for name in settings.lora.projections]
    missing = [
        f"{prefix}.lora_{which}.weight"
        for prefix in (f"base_model.model.transformer.h.{i}.{HF_MODULES[name]}" for i, name in modules)
        for which in "AB"
        if f"{prefix}.lora_{which}.weight" not in tensors
    ]
    if missing:
        raise LoRAError(f"{directory / PEFT_WEIGHTS} lacks {len(missing)} adapter tensor(s), e.g. {missing[:2]}")
    pairs = {module: _peft_module(tensors, settings, *module, model_config) for module in modules}
    rank = max(a.shape[1] for a, _ in pairs.values())
    _check_peft_rank(settings, rank, model_config)
    lora = LoraConfig(rank=rank, alpha=float(rank), targets=settings.lora.targets)  # scale 1: folded into b
    shapes = nn.meta.unbox(abstract_adapters(dataclasses.replace(model_config, scan_layers=False), lora))
    adapters = jax.tree.map(lambda s: None, shapes)
    for (layer, name), (a, b) in pairs.items():
        want, pad = _get(shapes[f"layer_{layer}"], ADAPTER_PATHS[name]), rank - a.shape[1]
        a, b = np.pad(a, ((0, 0), (0, pad))), np.pad(b, ((0, pad), (0, 0)))
        _set(
            adapters[f"layer_{layer}"],
            ADAPTER_PATHS[name],
            {"a": a.reshape(want["a"].shape), "b": b.reshape(want["b"].shape)},
        )
    if model_config.scan_layers:
        adapters = stack_layers(adapters, model_config.n_layers)
    plain = Config(model=model_config)
    config = plain.replace(train=dataclasses.replace(plain.train, lora=lora))
    return Adapter(config, adapters, None, 0, str(directory))
