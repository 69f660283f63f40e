"""HuggingFace GPT-J directories ⇄ our Orbax checkpoints, one tensor at a time.

Import checks every tensor name and shape against ``config.json`` before writing anything, and
computes in the precision the weights are stored in unless asked otherwise, so an imported model
scores as HuggingFace does. Export writes a directory ``GPTJForCausalLM.from_pretrained`` loads
with no missing or unexpected keys.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gptj_flax.config import Config, ConfigError, ModelConfig, dtype_name, jnp_dtype
from gptj_flax.convert import safetensors_io
from gptj_flax.convert.common import (
    TOKENIZER_FILES,
    ConversionError,
    atomic_directory,
    copy_tokenizer_files,
    progress,
    require_float,
)
from gptj_flax.convert.hf_names import (
    IGNORED_HF_SUFFIXES,
    hf_name,
    hf_names,
    hf_shape,
    hf_to_ours,
    ours_to_hf,
)
from gptj_flax.convert.layout import ParamPath, Source, layer_paths, streamed_params
from gptj_flax.convert.orbax_io import OrbaxParams, write_converted

HF_PREFIX = "hf:"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers' own default for save_pretrained
GPTJ_EOS = 50256  # GPT-2 BPE's <|endoftext|>, GPT-J's bos and eos
# A HuggingFace directory holds its tokenizer when it has one of these.
HF_TOKENIZER_FILES = ("tokenizer.json", "vocab.json")

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# config.json


def is_hf_source(path: str | os.PathLike) -> bool:
    """``hf:DIR``, or a directory holding a ``config.json`` and HF weight files."""
    spec = os.fspath(path)
    if spec.startswith(HF_PREFIX):
        return True
    directory = Path(spec)
    return (directory / "config.json").is_file() and any((directory / f).is_file() for f in WEIGHT_FILES)


def model_config_from_hf(raw: dict, where: Path, scan_layers: bool = True, dtype: str = "float32") -> ModelConfig:
    """A HF ``GPTJConfig`` dict → our ModelConfig computing in ``dtype``; anything GPT-J cannot be is
    refused by name."""
    if raw.get("model_type") != "gptj":
        raise ConversionError(
            f"{where}: model_type is {raw.get('model_type')!r}, not 'gptj': this is not a GPT-J checkpoint"
        )
    activation = raw.get("activation_function", "gelu_new")
    if activation != "gelu_new":
        raise ConversionError(f"{where}: activation_function {activation!r} is not supported; GPT-J uses 'gelu_new'")
    if raw.get("tie_word_embeddings", False):
        raise ConversionError(f"{where}: tie_word_embeddings is true; GPT-J's lm_head is untied (it has a bias)")
    if raw.get("rotary_dim") is None:
        raise ConversionError(f"{where}: rotary_dim is null; GPT-J needs a rotary_dim (64 for GPT-J-6B)")
    try:
        return ModelConfig(
            n_layers=raw["n_layer"],
            d_model=raw["n_embd"],
            n_heads=raw["n_head"],
            rotary_dim=raw["rotary_dim"],
            vocab_size=raw["vocab_size"],
            max_len=raw.get("n_positions", 2048),
            d_ff=raw.get("n_inner"),
            layer_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
            scan_layers=scan_layers,
            dtype=dtype,
        )
    except KeyError as e:
        raise ConversionError(f"{where}: missing key {e.args[0]!r}") from None
    except ConfigError as e:
        raise ConversionError(f"{where}: {e}") from None


def hf_config_dict(config: ModelConfig, dtype: str) -> dict:
    """The ``config.json`` of ``GPTJForCausalLM`` for ``config``, weights stored as ``dtype``."""
    eos = GPTJ_EOS if config.vocab_size > GPTJ_EOS else None  # a small vocabulary has no id 50256
    return {
        "architectures": ["GPTJForCausalLM"],
        "model_type": "gptj",
        "vocab_size": config.vocab_size,
        "n_positions": config.max_len,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "rotary_dim": config.rotary_dim,
        "n_inner": None if config.d_ff == 4 * config.d_model else config.d_ff,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.layer_norm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "tie_word_embeddings": False,
        "dtype": dtype_name(dtype),
    }


# --------------------------------------------------------------------------------------------
# Reading a HF directory


class _TorchFile:
    """A ``pytorch_model.bin`` opened memory-mapped, so tensors are read only when asked for."""

    def __init__(self, path: Path):
        try:
            import torch
        except ImportError:
            raise ConversionError(
                f"{path}: reading pytorch_model.bin needs torch (pip install torch==2.13.0), "
                "or convert from safetensors"
            ) from None
        try:
            self._tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # pre-zipfile serialisation cannot be memory-mapped
            try:
                self._tensors = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 — torch raises many types for corrupt files
                raise ConversionError(f"{path}: unreadable PyTorch checkpoint: {e}") from None
        except Exception as e:  # noqa: BLE001
            raise ConversionError(f"{path}: unreadable PyTorch checkpoint: {e}") from None
        self.path = path

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self._tensors.items()}

    def dtype(self, name: str) -> str:
        return str(self._tensors[name].dtype).removeprefix("torch.")

    def read(self, name: str) -> np.ndarray:
        import torch

        return self._tensors[name].to(torch.float32).numpy()


class HFCheckpoint(Source):
    """A HuggingFace GPT-J directory, validated up front and read one tensor at a time.

    ``stored_dtype`` is the precision its weights are stored in: ``config.json``'s ``dtype``
    (``torch_dtype`` before transformers 5), else the weight files' own. ``model_config`` computes
    in it unless ``open`` is given another ``dtype``; its parameters are kept in float32. It holds
    one set of weights: ``step`` is 0.
    """

    step = 0

    def __init__(
        self,
        directory: Path,
        model_config: ModelConfig,
        readers: dict[str, Callable[[], np.ndarray]],
        stored_dtype: str,
    ):
        self.directory = directory
        self.model_config = model_config
        self.stored_dtype = stored_dtype
        self._readers = readers

    @classmethod
    def open(cls, src: str | os.PathLike, scan_layers: bool = True, dtype=None) -> HFCheckpoint:
        directory = Path(os.fspath(src).removeprefix(HF_PREFIX))
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise ConversionError(f"{config_path} not found: a HuggingFace model directory has a config.json")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ConversionError(f"{config_path}: not valid JSON: {e}") from None
        model_config = model_config_from_hf(raw, config_path, scan_layers)

        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, str] = {}
        readers: dict[str, Callable[[], np.ndarray]] = {}
        where: dict[str, Path] = {}
        for path, kind in _weight_files(directory):
            if kind == "safetensors":
                for name, info in safetensors_io.read_header(path).items():
                    shapes[name], dtypes[name], where[name] = info.shape, info.dtype.name, path
                    readers[name] = functools.partial(safetensors_io.read_tensor, info)
            else:
                torch_file = _TorchFile(path)
                for name, shape in torch_file.shapes().items():
                    shapes[name], dtypes[name], where[name] = shape, torch_file.dtype(name), path
                    readers[name] = functools.partial(torch_file.read, name)
        compute = None if dtype is None else dtype_name(dtype)
        stored = _stored_dtype(raw, dtypes.get("transformer.wte.weight"), config_path, compute)
        model_config = dataclasses.replace(model_config, dtype=compute or stored)

        expected = hf_names(model_config)
        missing = [n for n in expected if n not in shapes]
        if missing:
            raise ConversionError(
                f"{directory}: {len(missing)} GPT-J tensor(s) missing from the weight files, "
                f"e.g. {missing[:3]} (config.json says {model_config.n_layers} layers)"
            )
        unexpected = sorted(set(shapes) - set(expected))
        unexpected = [n for n in unexpected if not n.endswith(IGNORED_HF_SUFFIXES)]
        if unexpected:
            raise ConversionError(
                f"{where[unexpected[0]]}: unexpected tensor(s) for a {model_config.n_layers}-layer "
                f"GPT-J: {unexpected[:3]}"
            )
        for name in expected:
            want = hf_shape(name, model_config)
            if shapes[name] != want:
                raise ConversionError(
                    f"{where[name]}: tensor {name!r} has shape {shapes[name]} but {config_path} implies {want}"
                )
        return cls(directory, model_config, {n: readers[n] for n in expected}, stored)

    @property
    def tokenizer_dir(self) -> Path | None:
        """The directory itself, where it holds a tokenizer."""
        return self.directory if any((self.directory / f).is_file() for f in HF_TOKENIZER_FILES) else None

    def get(self, path: ParamPath) -> np.ndarray:
        """The parameter at ``path`` (unrolled layout) in our orientation, in its stored dtype."""
        name = hf_name(path)
        return hf_to_ours(name, self._readers[name](), self.model_config)[1]


def _stored_dtype(raw: dict, tensor_dtype: str | None, where: Path, requested: str | None) -> str:
    """The precision a HF directory's weights are stored in (see :class:`HFCheckpoint`); where it is
    none GPT-J computes in, the ``requested`` compute dtype (an error if none was)."""
    declared = next(
        (raw[k] for k in ("dtype", "torch_dtype") if isinstance(raw.get(k), str) and raw[k] != "auto"), None
    )
    found = declared.removeprefix("torch.") if declared else tensor_dtype or "float32"
    try:
        return dtype_name(found)
    except ConfigError:
        if requested is not None:
            return requested
        raise ConversionError(
            f"{where}: the weights are stored as {found}, which GPT-J does not compute in: "
            "give the dtype to compute in (float32, bfloat16 or float16)"
        ) from None


def _weight_files(directory: Path) -> list[tuple[Path, str]]:
    """The weight files of a HF directory, in the order transformers prefers them."""
    for index_name, kind in ((safetensors_io.INDEX_FILE, "safetensors"), ("pytorch_model.bin.index.json", "torch")):
        index_path = directory / index_name
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ConversionError(f"{index_path}: not a valid weight index ({e})") from None
            files = [directory / name for name in dict.fromkeys(weight_map.values())]
            for path in files:
                if not path.is_file():
                    raise ConversionError(f"{path}: listed in {index_path} but missing")
            return [(path, kind) for path in files]
    for name, kind in ((safetensors_io.SINGLE_FILE, "safetensors"), ("pytorch_model.bin", "torch")):
        if (directory / name).is_file():
            return [(directory / name, kind)]
    raise ConversionError(
        f"{directory}: no weights found (expected {safetensors_io.SINGLE_FILE}, "
        f"{safetensors_io.INDEX_FILE}, pytorch_model.bin or its index)"
    )


# --------------------------------------------------------------------------------------------
# Converters


def from_hf(
    src: str | os.PathLike, out: str | os.PathLike, *, scan_layers: bool = True, tokenizer: bool = True, dtype=None
) -> Path:
    """HF GPT-J directory ``src`` → Orbax checkpoint ``out`` (step 0, float32 parameters, tokenizer carried).

    ``dtype``: the compute dtype the checkpoint's config records; default the precision ``src``'s
    weights are stored in. ``tokenizer``: carry ``src``'s tokenizer files, which must load as a
    tokenizer (a directory without any is converted with a warning); False converts the weights alone.
    """
    hf = HFCheckpoint.open(src, scan_layers, dtype)
    carry = _checked_tokenizer(hf.directory) if tokenizer else False
    config = Config(model=hf.model_config)
    return write_converted(
        out,
        0,
        params=streamed_params(hf.get, config.model),
        config=config,
        meta={"converted_from": f"hf:{Path(src).resolve()}"},
        tokenizer=hf.directory if carry else None,
    )


def _checked_tokenizer(directory: Path) -> bool:
    """Whether ``directory`` has tokenizer files to carry; files that do not load are refused."""
    names = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    if not names:
        log.warning(
            "%s has no tokenizer files (%s): converting the weights alone. Give a tokenizer when "
            "loading (tokenizer=…) or training (train.tokenizer), or pass --no-tokenizer to say so.",
            directory,
            ", ".join(TOKENIZER_FILES[:3]),
        )
        return False
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers and tokenizers raise bare Exceptions for bad files
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversionError(
            f"{directory}: its tokenizer files ({', '.join(names)}) do not load as a tokenizer "
            f"({reason}); fix or remove them, or pass --no-tokenizer to convert the weights "
            "alone"
        ) from None
    return True


def to_hf(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str = "float32",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Orbax checkpoint ``ckpt`` (run or step directory) → HF GPT-J directory ``out``, weights stored as ``dtype``."""
    stored = np.dtype(jnp_dtype(dtype))
    source = OrbaxParams.open(ckpt)
    config = source.config.model
    require_float(config, source.directory, "HuggingFace export")
    plan = [(name, hf_shape(name, config), stored) for name in hf_names(config)]
    with atomic_directory(out) as tmp:
        with (
            safetensors_io.ShardedWriter(
                tmp, plan, safetensors_io.parse_size(max_shard_size), metadata={"format": "pt"}
            ) as writer,
            progress(writer.total_bytes, "writing safetensors") as bar,
        ):
            for path, shape in source.leaf_shapes().items():
                array = source.read(path)
                if array.shape != shape:
                    raise ConversionError(
                        f"{source.params_dir}: {'/'.join(path)} has shape {array.shape} but "
                        f"the checkpoint's config implies {shape}"
                    )
                per_layer = layer_paths(path, config.n_layers)
                pieces = [(path, array)] if per_layer is None else list(zip(per_layer, array))
                for our_path, piece in pieces:
                    name = hf_name(our_path)
                    writer.write(name, ours_to_hf(name, piece, config))
                    bar.update(piece.size * stored.itemsize)
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(config, dtype), indent=2) + "\n")
        tokenizer_dir = source.tokenizer_dir
        copy_tokenizer_files(Path(tokenizer_dir) if tokenizer_dir else None, tmp)
    return Path(out)
