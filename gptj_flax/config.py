"""Typed configuration: the model, the device mesh and the training run.

Two on-disk forms load to the same objects:

* **modern JSON** — sections ``{"model": {...}, "mesh": {...}, "train": {...}}`` whose keys are
  the dataclass field names below;
* **legacy mesh-transformer-jax JSON** — one flat dict (``layers``, ``d_model``, ``pe_rotary_dims``,
  ``cores_per_replica`` …), recognised by its ``layers``/``d_model`` keys at the top level.

Every problem is reported as a :class:`ConfigError` that names the offending field and says how
to fix it; unknown keys are rejected by name rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from gptj_flax.errors import GptjFlaxError

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# auto: Splash on TPU, cuDNN's fused attention on GPU, XLA elsewhere (see gptj_flax.attention).
ATTENTION_BACKENDS = ("auto", "xla", "splash", "cudnn")
# Weight-only quantisations of the block projections (ModelConfig.quantize): for inference, and for
# the frozen base of a LoRA run (QLoRA).
QUANTIZATIONS = ("int8",)
# Storage of the inference KV cache (ModelConfig.kv_cache) besides the compute dtype.
KV_CACHE_DTYPES = ("int8",)

# Canonical dtype name → the dtype, and every spelling the user may write for each.
_DTYPE_BY_NAME = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPE_NAMES = tuple(_DTYPE_BY_NAME)
_DTYPE_SPELLINGS = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}


# Where the commands keep what they can make again (JAX's compiled programs, counted TFRecord
# layouts): this variable, else the XDG cache directory, else ~/.cache.
CACHE_ENV = "GPTJ_FLAX_CACHE"


def cache_root() -> str:
    """``$GPTJ_FLAX_CACHE``, else ``$XDG_CACHE_HOME/gptj_flax``, else ``~/.cache/gptj_flax``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "gptj_flax")


class ConfigError(GptjFlaxError, ValueError):
    """A configuration value is missing, malformed or inconsistent."""


def dtype_name(dtype: Any, what: str = "dtype") -> str:
    """The canonical name (``float32``, ``bfloat16`` or ``float16``) of a dtype spelt any accepted way:
    ``fp32``/``f32``, ``bf16``, ``fp16``/``half``, or a numpy or jax.numpy dtype."""
    if isinstance(dtype, str):
        name = _DTYPE_SPELLINGS.get(dtype.strip().lower())
    else:
        try:
            name = _DTYPE_SPELLINGS.get(np.dtype(dtype).name)
        except TypeError:
            name = None
    if name is None:
        spellings = ", ".join(
            f"{canonical} ({'/'.join(s for s, c in _DTYPE_SPELLINGS.items() if c == canonical)})"
            for canonical in DTYPE_NAMES
        )
        raise ConfigError(f"{what}={dtype!r} is not a supported dtype; use one of {spellings}")
    return name


def jnp_dtype(dtype: Any):
    """The jax.numpy dtype of a dtype spelt any way :func:`dtype_name` accepts."""
    return _DTYPE_BY_NAME[dtype_name(dtype)]


def _suggest(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# JSON's true/false load as Python bools, which are ints: every numeric check refuses them by name.
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_positive_int(field: str, value: Any, *, optional: bool = False, minimum: int = 1) -> None:
    if optional and value is None:
        return
    if not _is_int(value) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise ConfigError(f"{field} must be {kind}{' or null' if optional else ''}, got {value!r}")


def _check_string(field: str, value: Any, *, optional: bool = False, nonempty: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or (nonempty and not value):
        kind = "a non-empty string" if nonempty else "a string"
        raise ConfigError(f"{field} must be {kind}{' or null' if optional else ''}, got {value!r}")


def _check_choice(field: str, value: Any, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{field}={value!r} is not one of {list(choices)}")


def _string_list(field: str, value: Any) -> tuple[str, ...]:
    """A list of strings; a bare string is refused rather than split into its characters."""
    if isinstance(value, str):
        raise ConfigError(f"{field} must be a list of strings, got the string {value!r}: write [{json.dumps(value)}]")
    if not isinstance(value, Sequence) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{field} must be a list of non-empty strings, got {value!r}")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a GPT-J model.

    ``dtype`` is the compute dtype of activations and matmuls; ``param_dtype`` how parameters are
    stored. Both accept any spelling :func:`dtype_name` does and are kept under the canonical name.
    Softmax, LayerNorm statistics and the loss are float32 whatever ``dtype`` says. On CPU, XLA has
    no fast bfloat16 matmul, so float32 is the faster choice there as well as the exact one.
    """

    n_layers: int
    d_model: int
    n_heads: int
    rotary_dim: int
    vocab_size: int
    max_len: int = 2048
    # None: 4 * d_model, as GPT-J. Kept as given (read the width from ``ff_dim``), so that a config
    # rebuilt with another d_model (``--set model.d_model=…``, ``dataclasses.replace``) follows it.
    d_ff: int | None = None
    layer_norm_eps: float = 1e-5
    dtype: str = "bfloat16"  # compute dtype (TPU/GPU training); float32 on CPU, where it is also faster
    param_dtype: str = "float32"  # storage dtype of the parameters
    scan_layers: bool = True  # nn.scan over the blocks: compile time independent of depth
    remat_policy: str = "none"  # one of REMAT_POLICIES
    attention: str = "auto"  # one of ATTENTION_BACKENDS
    # "int8": the block projections are stored int8 with a float scale per output channel
    # (gptj_flax.convert.quantize makes them from float weights); None: every weight in param_dtype.
    quantize: str | None = None
    # "int8": cached keys and values are stored int8 with a float32 scale per (row, head, slot),
    # about half a bf16 cache's memory; None: the cache is in the compute dtype. Inference only.
    kv_cache: str | None = None

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):
            object.__setattr__(self, name, dtype_name(getattr(self, name), f"model.{name}"))
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def compute_dtype(self):
        return jnp_dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp_dtype(self.param_dtype)

    def validate(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "rotary_dim", "vocab_size", "max_len"):
            _check_positive_int(f"model.{name}", getattr(self, name))
        _check_positive_int("model.d_ff", self.d_ff, optional=True)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                f"choose n_heads among the divisors of d_model (e.g. {_divisors_near(self.d_model, self.n_heads)})"
            )
        if self.rotary_dim % 2:
            raise ConfigError(f"model.rotary_dim={self.rotary_dim} must be even (rotary rotates pairs of dimensions)")
        if self.rotary_dim > self.head_dim:
            raise ConfigError(
                f"model.rotary_dim={self.rotary_dim} exceeds the head dimension "
                f"d_model/n_heads={self.head_dim}: use rotary_dim <= {self.head_dim}"
            )
        if not (_is_finite_number(self.layer_norm_eps) and self.layer_norm_eps > 0):
            raise ConfigError(f"model.layer_norm_eps must be a finite positive number, got {self.layer_norm_eps!r}")
        _check_choice("model.remat_policy", self.remat_policy, REMAT_POLICIES)
        _check_choice("model.attention", self.attention, ATTENTION_BACKENDS)
        if self.quantize is not None:
            _check_choice("model.quantize", self.quantize, QUANTIZATIONS)
        if self.kv_cache is not None:
            _check_choice("model.kv_cache", self.kv_cache, KV_CACHE_DTYPES)
        if not isinstance(self.scan_layers, bool):
            raise ConfigError(f"model.scan_layers must be true or false, got {self.scan_layers!r}")

    @property
    def ff_dim(self) -> int:
        """The MLP's hidden width: ``d_ff``, or ``4 * d_model`` when the config leaves it unset."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    def param_count(self) -> int:
        """Dense parameter count, computed from the shapes alone."""
        d, f, v = self.d_model, self.ff_dim, self.vocab_size
        per_layer = 4 * d * d + (d * f + f) + (f * d + d) + 2 * d
        return v * d + self.n_layers * per_layer + 2 * d + (d * v + v)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6·N plus attention scores."""
        seq = seq_len or self.max_len
        n_matmul = self.param_count() - self.vocab_size * self.d_model  # the lookup is no matmul
        return 6.0 * n_matmul + 12.0 * self.n_layers * self.d_model * seq


def _divisors_near(n: int, target: int) -> list[int]:
    divs = [k for k in range(1, n + 1) if n % k == 0]
    return sorted(divs, key=lambda k: abs(k - target))[:3]


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh shape over axes (data, fsdp, model); -1 means "all remaining devices"."""

    data: int = 1
    fsdp: int = -1
    model: int = 1

    def __post_init__(self):
        shape = self.shape
        for axis, size in zip((f.name for f in dataclasses.fields(self)), shape):
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise ConfigError(f"mesh.{axis} must be a positive integer or -1, got {size!r}")
        if shape.count(-1) > 1:
            raise ConfigError(f"mesh {shape}: at most one axis may be -1 (the remaining devices)")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.model)

    def resolve(self, n_devices: int) -> tuple[int, int, int]:
        """The concrete shape for ``n_devices`` devices."""
        shape = list(self.shape)
        fixed = math.prod(s for s in shape if s != -1)
        if -1 in shape:
            if n_devices % fixed:
                raise ConfigError(
                    f"mesh {self.shape}: the fixed axes use {fixed} devices, which does not divide "
                    f"the {n_devices} available"
                )
            shape[shape.index(-1)] = n_devices // fixed
        elif fixed > n_devices:
            raise ConfigError(f"mesh {self.shape} needs {fixed} devices but only {n_devices} are available")
        data, fsdp, model = shape
        return data, fsdp, model


# The projections a LoRA adapter may wrap, in model order (the names of their parameters).
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out")
# float16's largest value: alpha / rank multiplies the adapters' output in the compute dtype, so a
# larger alpha can make that product inf and the first training step NaN.
LORA_ALPHA_MAX = 65504.0


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the projections ``targets`` (globs over :data:`LORA_PROJECTIONS`):
    each computes ``x @ W + (alpha / rank) * (x @ A) @ B`` with the base ``W`` frozen."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self):
        _check_positive_int("train.lora.rank", self.rank)
        if not _is_finite_number(self.alpha) or not 0 < self.alpha <= LORA_ALPHA_MAX:
            raise ConfigError(
                f"train.lora.alpha must be a finite positive number at most {LORA_ALPHA_MAX:g}, got {self.alpha!r}"
            )
        targets = _string_list("train.lora.targets", self.targets)
        if not targets:
            raise ConfigError(f"train.lora.targets is empty: name at least one of {', '.join(LORA_PROJECTIONS)}")
        for pattern in targets:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in LORA_PROJECTIONS):
                raise ConfigError(
                    f"train.lora.targets: {pattern!r} matches no projection{_suggest(pattern, LORA_PROJECTIONS)}; "
                    f"the projections are {', '.join(LORA_PROJECTIONS)} (globs such as '*_proj' allowed)"
                )
        object.__setattr__(self, "targets", targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def projections(self) -> tuple[str, ...]:
        """The projections the target globs match, in model order."""
        return tuple(n for n in LORA_PROJECTIONS if any(fnmatch.fnmatchcase(n, p) for p in self.targets))


def projection_shape(model: ModelConfig, name: str) -> tuple[int, int]:
    """``(in, out)`` of one block projection's kernel, heads × head_dim counted as d_model."""
    d, f = model.d_model, model.ff_dim
    return {"fc_in": (d, f), "fc_out": (f, d)}.get(name, (d, d))


def max_lora_rank(model: ModelConfig, projections: Sequence[str]) -> tuple[int, str]:
    """The highest useful adapter rank on ``projections`` and the projection that sets it.

    ``A @ B`` on an ``in × out`` kernel has rank at most ``min(in, out)``: rank up to there is a
    full update of that kernel, and any more adds parameters without adding anything it can express.
    """
    name = min(projections, key=lambda n: min(projection_shape(model, n)))  # the first in model order on a tie
    return min(projection_shape(model, name)), name


def _check_lora_rank(model: ModelConfig, lora: LoraConfig) -> None:
    limit, name = max_lora_rank(model, lora.projections)
    if lora.rank > limit:
        rows, cols = projection_shape(model, name)
        raise ConfigError(
            f"train.lora.rank={lora.rank} exceeds {limit}, the rank of a full update of {name} ({rows}×{cols}): "
            f"a higher rank adds parameters but nothing the adapter can express; set train.lora.rank to at most {limit}"
        )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training run. Fields mirror the legacy keys; see ``LEGACY_KEYS``."""

    batch_size: int | None = None  # global sequences per micro-batch; or derive from per_replica_batch
    per_replica_batch: int | None = None  # legacy: sequences per model replica (data-parallel rank)
    seq_len: int | None = None  # None: the model's max_len
    grad_accum_steps: int = 1
    total_steps: int = 1000
    warmup_steps: int = 100
    anneal_steps: int = 900
    lr: float = 1e-4
    end_lr: float = 1e-5
    weight_decay: float = 0.1
    adam_mu_dtype: str = "float32"  # "bfloat16" halves Adam's first moment (saves 2 bytes/param)
    z_loss: float = 0.0
    seed: int = 0
    run_dir: str = "runs/default"
    train_set: str | None = None  # .index of TFRecords, text/jsonl file or dir, or tfds:NAME
    val_set: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tokenizer: str | None = None  # dir or hub name; needed for text sources; saved with checkpoints
    freeze: tuple[str, ...] = ()  # glob patterns of parameter paths that get no updates
    lora: LoraConfig | None = None  # train low-rank adapters on a frozen bfloat16 base (needs init_from)
    val_every: int = 500
    val_batches: int = 10
    ckpt_every: int = 500
    keep_last: int = 2
    keep_every: int | None = None
    eval_harness_tasks: tuple[str, ...] = ()
    name: str = "gptj"
    wandb_project: str | None = None
    comment: str = ""
    tpu_size: int | None = None  # legacy: the slice the config was written for; a warning when the run's differs
    # The EMA rate of the gradient-noise statistics (noise/*, docs/train.md); None: not computed.
    noise_scale_alpha: float | None = None

    def __post_init__(self):
        if (self.batch_size is None) == (self.per_replica_batch is None):
            raise ConfigError("train: set exactly one of train.batch_size (global) or train.per_replica_batch")
        for name in ("grad_accum_steps", "total_steps", "val_every", "val_batches", "ckpt_every", "keep_last"):
            _check_positive_int(f"train.{name}", getattr(self, name))
        for name in ("batch_size", "per_replica_batch", "seq_len", "keep_every", "tpu_size"):
            _check_positive_int(f"train.{name}", getattr(self, name), optional=True)
        for name in ("warmup_steps", "anneal_steps"):
            _check_positive_int(f"train.{name}", getattr(self, name), minimum=0)
        for name in ("lr", "end_lr", "weight_decay", "z_loss"):
            value = getattr(self, name)
            if not _is_finite_number(value) or value < 0:
                raise ConfigError(f"train.{name} must be a finite non-negative number, got {value!r}")
        alpha = self.noise_scale_alpha
        if alpha is not None and not (_is_finite_number(alpha) and 0 < alpha <= 1):
            raise ConfigError(
                f"train.noise_scale_alpha must be a number in (0, 1] (the weight of each new step in the "
                f"statistics' moving averages; device_train.py used 0.01) or null, got {alpha!r}"
            )
        object.__setattr__(self, "adam_mu_dtype", dtype_name(self.adam_mu_dtype, "train.adam_mu_dtype"))
        _check_choice("train.adam_mu_dtype", self.adam_mu_dtype, ("float32", "bfloat16"))
        if not _is_int(self.seed) or not 0 <= self.seed < 2**32:
            # jax.random.key folds larger seeds onto smaller ones (2**32 gives seed 0's key)
            raise ConfigError(f"train.seed must be an integer in [0, 2**32), got {self.seed!r}")
        _check_string("train.run_dir", self.run_dir, nonempty=True)
        _check_string("train.train_set", self.train_set, optional=True, nonempty=True)
        _check_string("train.tokenizer", self.tokenizer, optional=True, nonempty=True)
        _check_string("train.wandb_project", self.wandb_project, optional=True, nonempty=True)
        for name in ("name", "comment"):
            _check_string(f"train.{name}", getattr(self, name))
        if not isinstance(self.val_set, Mapping):
            raise ConfigError(f"train.val_set must be a mapping name -> source, got {self.val_set!r}")
        for key, source in self.val_set.items():
            if not isinstance(key, str) or not key:
                raise ConfigError(f"train.val_set: names must be non-empty strings, got {key!r}")
            _check_string(f"train.val_set.{key}", source, nonempty=True)
        object.__setattr__(
            self, "eval_harness_tasks", _string_list("train.eval_harness_tasks", self.eval_harness_tasks)
        )
        object.__setattr__(self, "freeze", _string_list("train.freeze", self.freeze))
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            if not isinstance(self.lora, Mapping):
                raise ConfigError(f"train.lora must be an object {{rank, alpha, targets}} or null, got {self.lora!r}")
            object.__setattr__(self, "lora", _build(LoraConfig, "train.lora", self.lora))
        if self.lora is not None and self.freeze:
            raise ConfigError(
                "train.freeze and train.lora are both set: a LoRA run trains only its adapters (the base is "
                "frozen whole); drop train.freeze"
            )

    def global_batch_size(self, data_parallel: int) -> int:
        """Sequences per micro-batch over the whole mesh (``data_parallel``: the mesh's data-parallel size)."""
        if self.batch_size is not None:
            return self.batch_size
        assert self.per_replica_batch is not None  # construction requires one of the two
        return self.per_replica_batch * data_parallel


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=lambda: TrainConfig(batch_size=8))

    def __post_init__(self):
        if self.train.lora is not None:
            _check_lora_rank(self.model, self.train.lora)
        if self.train.seq_len is not None and self.train.seq_len > self.model.max_len:
            raise ConfigError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_len={self.model.max_len}: the model has "
                f"no positions past {self.model.max_len}; lower train.seq_len or raise model.max_len"
            )

    def to_dict(self) -> dict[str, Any]:
        model = dataclasses.asdict(self.model)
        for key in ("quantize", "kv_cache"):  # unset, a config stays readable by versions without the key
            if model[key] is None:
                del model[key]
        return {
            "model": model,
            "mesh": dataclasses.asdict(self.mesh),
            "train": _jsonable(dataclasses.asdict(self.train)),
        }

    def replace(self, **sections) -> Config:
        return dataclasses.replace(self, **sections)


def _jsonable(d: Mapping) -> dict:
    return {
        k: (list(v) if isinstance(v, tuple) else _jsonable(v) if isinstance(v, Mapping) else v) for k, v in d.items()
    }


# --------------------------------------------------------------------------------------------
# Loading

# legacy key -> (section, field, converter)
LEGACY_KEYS: dict[str, tuple[str, str]] = {
    "layers": ("model", "n_layers"),
    "d_model": ("model", "d_model"),
    "n_heads": ("model", "n_heads"),
    "n_vocab": ("model", "vocab_size"),
    "pe_rotary_dims": ("model", "rotary_dim"),
    "seq": ("model", "max_len"),
    "cores_per_replica": ("mesh", "model"),
    "per_replica_batch": ("train", "per_replica_batch"),
    "gradient_accumulation_steps": ("train", "grad_accum_steps"),
    "warmup_steps": ("train", "warmup_steps"),
    "anneal_steps": ("train", "anneal_steps"),
    "lr": ("train", "lr"),
    "end_lr": ("train", "end_lr"),
    "weight_decay": ("train", "weight_decay"),
    "total_steps": ("train", "total_steps"),
    "tpu_size": ("train", "tpu_size"),
    "train_set": ("train", "train_set"),
    "val_set": ("train", "val_set"),
    "eval_harness_tasks": ("train", "eval_harness_tasks"),
    "val_batches": ("train", "val_batches"),
    "val_every": ("train", "val_every"),
    "ckpt_every": ("train", "ckpt_every"),
    "keep_every": ("train", "keep_every"),
    "name": ("train", "name"),
    "wandb_project": ("train", "wandb_project"),
    "comment": ("train", "comment"),
    "noise_scale_alpha": ("train", "noise_scale_alpha"),
}
# Legacy keys handled specially: fixed architecture choices, and the GCS bucket.
LEGACY_SPECIAL = ("norm", "pe", "bucket", "model_dir")


def _section_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _build(cls, section: str, values: Mapping[str, Any]):
    known = _section_fields(cls)
    for key in values:
        if key not in known:
            raise ConfigError(f"unknown key {section}.{key!r}{_suggest(key, known)}; known keys: {', '.join(known)}")
    try:
        return cls(**values)
    except TypeError as e:  # a required field is missing
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in values
        ]
        raise ConfigError(f"{section}: missing required key(s) {', '.join(missing) or '?'} ({e})") from None


def is_legacy(raw: Mapping[str, Any]) -> bool:
    return "layers" in raw and "d_model" in raw and "model" not in raw


def from_legacy_dict(raw: Mapping[str, Any]) -> Config:
    """Translate a flat mesh-transformer-jax config into a :class:`Config`."""
    sections: dict[str, dict[str, Any]] = {"model": {}, "mesh": {}, "train": {}}
    known = list(LEGACY_KEYS) + list(LEGACY_SPECIAL)
    for key, value in raw.items():
        if key in LEGACY_KEYS:
            section, name = LEGACY_KEYS[key]
            sections[section][name] = value
        elif key not in LEGACY_SPECIAL:
            raise ConfigError(f"unknown legacy config key {key!r}{_suggest(key, known)}")
    if raw.get("norm", "layernorm") != "layernorm":
        raise ConfigError(f"legacy key 'norm'={raw['norm']!r}: only 'layernorm' (GPT-J) is supported")
    if raw.get("pe", "rotary") != "rotary":
        raise ConfigError(f"legacy key 'pe'={raw['pe']!r}: only 'rotary' (GPT-J) is supported")
    model_dir = raw.get("model_dir")
    if model_dir is not None:
        bucket = raw.get("bucket")
        is_url = "://" in str(model_dir)
        if bucket and is_url and not str(model_dir).startswith(f"gs://{bucket}/"):
            raise ConfigError(
                f"legacy keys 'bucket'={bucket!r} and 'model_dir'={model_dir!r} disagree: a model_dir URL is the "
                "run directory itself; drop 'bucket', or give model_dir as a path inside the bucket"
            )
        sections["train"]["run_dir"] = f"gs://{bucket}/{model_dir}" if bucket and not is_url else model_dir
    elif raw.get("bucket"):  # the original required both; a bucket alone would leave checkpoints in runs/default
        raise ConfigError(
            f"legacy key 'bucket'={raw['bucket']!r} is set without 'model_dir': checkpoints go to "
            "gs://BUCKET/MODEL_DIR; add 'model_dir', or drop 'bucket' and set the run directory (train.run_dir)"
        )
    sections["mesh"].setdefault("data", 1)
    sections["mesh"]["fsdp"] = -1
    return Config(
        model=_build(ModelConfig, "model", sections["model"]),
        mesh=_build(MeshConfig, "mesh", sections["mesh"]),
        train=_build(TrainConfig, "train", sections["train"]),
    )


def from_dict(raw: Mapping[str, Any]) -> Config:
    """Build a :class:`Config` from a modern or legacy dict."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a JSON object, got {type(raw).__name__}")
    if is_legacy(raw):
        return from_legacy_dict(raw)
    sections = ("model", "mesh", "train")
    for key in raw:
        if key not in sections:
            raise ConfigError(f"unknown top-level config key {key!r}{_suggest(key, sections)}; expected {sections}")
    if "model" not in raw:
        raise ConfigError("config has no 'model' section (nor the legacy 'layers'/'d_model' keys)")
    train = dict(raw.get("train", {"batch_size": 8}))
    return Config(
        model=_build(ModelConfig, "model", raw["model"]),
        mesh=_build(MeshConfig, "mesh", raw.get("mesh", {})),
        train=_build(TrainConfig, "train", train),
    )


# A line holding only a comment; JSON strings cannot span lines, so this never matches inside one.
_COMMENT_LINE = re.compile(r"^[ \t]*(//|#).*$", re.MULTILINE)


def parse_json_config(text: str, source: str) -> Any:
    """Parse config JSON; lines holding only a ``//`` or ``#`` comment are allowed and skipped."""
    try:
        return json.loads(_COMMENT_LINE.sub("", text))  # blanked, not removed: error line numbers stay right
    except json.JSONDecodeError as e:
        line = text.splitlines()[e.lineno - 1] if e.lineno <= len(text.splitlines()) else ""
        hint = ""
        if line[e.colno - 1 :].lstrip().startswith(("//", "#", "/*")):
            hint = " (comments are allowed only on lines of their own, starting with // or #)"
        raise ConfigError(
            f"{source}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}{hint}: {line.strip()!r}"
        ) from None


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Config:
    """Load a JSON config file (modern or legacy), then apply ``section.key=value`` overrides."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory, not a JSON config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None
    raw = parse_json_config(text, str(path))
    try:
        config = from_dict(raw)
        return apply_overrides(config, overrides)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def apply_overrides(config: Config, overrides: Sequence[str]) -> Config:
    """Apply ``--set section.key=value`` overrides; values are parsed as JSON when they can be."""
    if not overrides:
        return config
    data = config.to_dict()
    overridden = set()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.lr=3e-4")
        dotted, text = item.split("=", 1)
        if "." not in dotted:
            raise ConfigError(f"--set {item!r}: name the section, e.g. model.{dotted}={text}")
        section, key = dotted.split(".", 1)
        if section not in data:
            raise ConfigError(f"--set {item!r}: unknown section {section!r}; expected one of {list(data)}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        data[section][key] = value
        overridden.add(dotted)
    # Two alternatives: setting one of them replaces the file's other, unless both are set.
    for chosen, other in (("batch_size", "per_replica_batch"), ("per_replica_batch", "batch_size")):
        set_now = f"train.{chosen}" in overridden and data["train"].get(chosen) is not None
        if set_now and f"train.{other}" not in overridden:
            data["train"][other] = None
    return from_dict(data)


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write ``config`` as modern JSON; a crash mid-write leaves any previous file intact."""
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(config.to_dict(), f, indent=2)
    os.replace(tmp, path)
