"""mesh-transformer-jax checkpoints — the released GPT-J-6B and its fine-tunes — read tensor by tensor.

The format is described in ``docs/reference.md`` §4. Every file and every array's shape and dtype
is checked against the config from the .npz headers before any tensor data is read, and errors
name the file. How the original stored and sharded its
state is described where it is undone: :func:`legacy_params` (leaf order) and
:meth:`LegacyCheckpoint._dense` (reassembly).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import threading
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from gptj_flax import checkpoint
from gptj_flax.config import Config, ModelConfig, dtype_name, from_dict, is_legacy
from gptj_flax.convert.common import ConversionError, atomic_directory
from gptj_flax.convert.layout import ParamPath, StreamedArray, place_on_mesh, streamed_params
from gptj_flax.convert.orbax_io import write_checkpoint

PIECES = 16  # the original's `pieces`: files per shard
_ROOT = "causal_transformer_shard/~/"
_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype("V2"))

# How shards combine into the dense tensor (see LegacyCheckpoint._dense).
ROWS, COLS, SUM, FIRST = "rows", "cols", "sum", "first"


@dataclasses.dataclass(frozen=True)
class LegacyParam:
    """One Haiku parameter of the original model: its name, per-shard shape and reassembly."""

    module: str
    name: str
    shard_shape: tuple[int, ...]
    assemble: str

    @property
    def key(self) -> str:
        return f"{self.module}/{self.name}"


def legacy_params(config: ModelConfig, shards: int) -> list[LegacyParam]:
    """The original's parameters for ``config`` on ``shards`` shards, in its leaf (tree) order.

    On disk a checkpoint is ``step_N/shard_{s}/{i}.npz`` for ``s`` below the original's
    ``cores_per_replica`` and ``i < 16``. Each shard's state ``{opt_state, params, step}`` (slim:
    ``{params, step}``) was flattened in JAX tree order — dict keys sorted as strings, so layers go
    0, 1, 10, 11, …, 2, … — cut into 16 contiguous pieces, and piece ``i`` saved with ``np.savez``
    (``arr_0, arr_1, …`` restarting in every file). Slim checkpoints store bfloat16 as numpy void
    ``V2`` (the raw upper half of a float32).
    """
    d, f, v, s = config.d_model, config.ff_dim, config.vocab_size, shards
    params = [
        LegacyParam(_ROOT + "embedding_shard/~/linear", "b", (d,), SUM),
        LegacyParam(_ROOT + "embedding_shard/~/linear", "w", (v // s, d), ROWS),
        LegacyParam(_ROOT + "projection_shard/~/linear", "b", (v // s,), COLS),
        LegacyParam(_ROOT + "projection_shard/~/linear", "w", (d, v // s), COLS),
        LegacyParam(_ROOT + "projection_shard/~/replicated_layer_norm", "offset", (d,), FIRST),
        LegacyParam(_ROOT + "projection_shard/~/replicated_layer_norm", "scale", (d,), FIRST),
    ]
    for i in range(config.n_layers):
        layer = f"{_ROOT}layer_{i}/~/"
        params += [
            LegacyParam(layer + "linear", "w", (d, d // s), COLS),  # q
            LegacyParam(layer + "linear_1", "w", (d, d // s), COLS),  # v
            LegacyParam(layer + "linear_2", "w", (d, d // s), COLS),  # k
            LegacyParam(layer + "linear_3", "w", (d // s, d), ROWS),  # attention out
            LegacyParam(layer + "linear_4", "b", (f // s,), COLS),  # fc_in
            LegacyParam(layer + "linear_4", "w", (d, f // s), COLS),
            LegacyParam(layer + "linear_5", "b", (d,), SUM),  # fc_out
            LegacyParam(layer + "linear_5", "w", (f // s, d), ROWS),
            LegacyParam(layer + "replicated_layer_norm", "offset", (d,), FIRST),
            LegacyParam(layer + "replicated_layer_norm", "scale", (d,), FIRST),
        ]
    # JAX flattens Haiku's {module: {name: array}} with keys sorted as strings at each level.
    return sorted(params, key=lambda p: (p.module, p.name))


# Our unrolled path → the legacy parameter it comes from (the embedding table is special: w + Σb).
_PER_LAYER = {
    ("attn", "q_proj"): "linear/w",
    ("attn", "v_proj"): "linear_1/w",
    ("attn", "k_proj"): "linear_2/w",
    ("attn", "out_proj"): "linear_3/w",
    ("mlp", "fc_in", "kernel"): "linear_4/w",
    ("mlp", "fc_in", "bias"): "linear_4/b",
    ("mlp", "fc_out", "kernel"): "linear_5/w",
    ("mlp", "fc_out", "bias"): "linear_5/b",
    ("ln_1", "scale"): "replicated_layer_norm/scale",
    ("ln_1", "bias"): "replicated_layer_norm/offset",
}
_TOP: dict[ParamPath, str] = {
    ("lm_head", "kernel"): "projection_shard/~/linear/w",
    ("lm_head", "bias"): "projection_shard/~/linear/b",
    ("ln_f", "scale"): "projection_shard/~/replicated_layer_norm/scale",
    ("ln_f", "bias"): "projection_shard/~/replicated_layer_norm/offset",
}
_EMBED_W, _EMBED_B = _ROOT + "embedding_shard/~/linear/w", _ROOT + "embedding_shard/~/linear/b"


def legacy_key(path: ParamPath) -> str:
    """Our unrolled path → the legacy parameter key (the embedding's weight for ``wte``)."""
    if path == ("wte",):
        return _EMBED_W
    if tuple(path) in _TOP:
        return _ROOT + _TOP[tuple(path)]
    m = re.fullmatch(r"layer_(\d+)", path[0])
    if m and tuple(path[1:]) in _PER_LAYER:
        return f"{_ROOT}layer_{m.group(1)}/~/{_PER_LAYER[tuple(path[1:])]}"
    raise KeyError(f"not a GPT-J parameter path: {'/'.join(path)!r}")


def _split_sizes(n: int) -> list[int]:
    """How the original cut ``n`` leaves into 16 pieces (the first ``n % 16`` get one more)."""
    k, m = divmod(n, PIECES)
    return [k + 1 if i < m else k for i in range(PIECES)]


def _read_npy_header(z: zipfile.ZipFile, member: str) -> tuple[tuple[int, ...], np.dtype]:
    with z.open(member) as f:
        version = np.lib.format.read_magic(f)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = reader(f)
    return tuple(shape), dtype


class LegacyCheckpoint:
    """One ``step_N`` directory of a mesh-transformer-jax checkpoint, validated when opened.

    ``get(path)`` gives a parameter and ``moment("mu"|"nu", path)`` an Adam moment (full checkpoints),
    both dense, float32 and in our orientation, reading only the arrays they need. ``stored_dtype``
    is the precision the parameters are stored in: float32 in full checkpoints, bfloat16 or float16
    in slim ones.
    """

    def __init__(self, step_dir: str | os.PathLike, config: ModelConfig, shards: int | None = None):
        self.step_dir = Path(step_dir)
        self.config = config
        self.shards = self._count_shards(shards)
        for name, value in (("n_heads", config.n_heads), ("d_ff", config.ff_dim), ("vocab_size", config.vocab_size)):
            if value % self.shards:
                raise ConversionError(
                    f"{self.step_dir}: model.{name}={value} is not divisible by its "
                    f"{self.shards} shards: the config does not fit this checkpoint"
                )
        if config.ff_dim != 4 * config.d_model:
            raise ConversionError(
                f"{self.step_dir}: the original model always has d_ff = 4·d_model, "
                f"but the config says d_ff={config.ff_dim}, d_model={config.d_model}"
            )
        self.params = {p.key: p for p in legacy_params(config, self.shards)}
        n_params = len(self.params)
        self._npz: dict[Path, np.lib.npyio.NpzFile] = {}
        # Orbax writes params and optimiser state from two threads; numpy's header parsing (ast)
        # is not safe to run concurrently, so reads take turns.
        self._reading = threading.Lock()
        # (file, member) of every leaf of every shard, after checking counts, shapes and dtypes.
        self._where: list[list[tuple[Path, str]]] = []
        for shard in range(self.shards):
            members = self._list_members(shard)
            if shard == 0:
                if len(members) == n_params + 1:
                    self.full = False
                elif len(members) == 3 * n_params + 3:
                    self.full = True
                else:
                    raise ConversionError(
                        f"{self.step_dir / 'shard_0'}: holds {len(members)} arrays, but a {config.n_layers}-layer "
                        f"GPT-J checkpoint holds {n_params + 1} (slim) or {3 * n_params + 3} (with optimiser "
                        "state): is the config the one this checkpoint was trained with?"
                    )
            elif len(members) != len(self._where[0]):
                raise ConversionError(
                    f"{self.step_dir / f'shard_{shard}'}: holds {len(members)} arrays but "
                    f"shard_0 holds {len(self._where[0])}"
                )
            self._where.append(members)
        self._leaves = self._leaf_names()
        self._check_headers()
        self.step = int(self._read(0, len(self._leaves) - 1))

    # -- validation ------------------------------------------------------------------------
    def _count_shards(self, expected: int | None) -> int:
        if not self.step_dir.is_dir():
            raise ConversionError(f"{self.step_dir}: not a directory (expected a legacy step_N directory)")
        found = sorted(int(m.group(1)) for p in self.step_dir.iterdir() if (m := re.fullmatch(r"shard_(\d+)", p.name)))
        if not found:
            raise ConversionError(f"{self.step_dir}: no shard_0 directory: not a mesh-transformer-jax step directory")
        if found != list(range(len(found))):
            missing = min(set(range(max(found) + 1)) - set(found))
            raise ConversionError(f"{self.step_dir / f'shard_{missing}'}: missing (found shards {found})")
        if expected is not None and expected != len(found):
            raise ConversionError(
                f"{self.step_dir}: has {len(found)} shard directories but the config's cores_per_replica is {expected}"
            )
        return len(found)

    def _list_members(self, shard: int) -> list[tuple[Path, str]]:
        """Every (file, member) of one shard in leaf order, checking the 16-piece split."""
        per_piece = []
        for piece in range(PIECES):
            path = self.step_dir / f"shard_{shard}" / f"{piece}.npz"
            if not path.is_file():
                raise ConversionError(f"{path}: missing (every legacy shard has {PIECES} pieces, 0.npz … 15.npz)")
            try:
                with zipfile.ZipFile(path) as z:
                    names = set(z.namelist())
            except (zipfile.BadZipFile, OSError) as e:
                raise ConversionError(f"{path}: not a readable .npz (truncated or corrupt): {e}") from None
            count = len(names)
            if names != {f"arr_{j}.npy" for j in range(count)}:
                raise ConversionError(
                    f"{path}: members {sorted(names)[:4]}… are not np.savez's arr_0 … arr_{count - 1}"
                )
            per_piece.append([(path, f"arr_{j}.npy") for j in range(count)])
        total = sum(len(p) for p in per_piece)
        for piece, (members, want) in enumerate(zip(per_piece, _split_sizes(total))):
            if len(members) != want:
                raise ConversionError(
                    f"{self.step_dir / f'shard_{shard}' / f'{piece}.npz'}: holds {len(members)} "
                    f"arrays, but the {total} leaves of this shard cut into {PIECES} pieces "
                    f"put {want} here"
                )
        return [m for members in per_piece for m in members]

    def _leaf_names(self) -> list[str]:
        names = [f"params/{key}" for key in self.params]
        if self.full:  # optax chain state: Adam (count, mu, nu), then the schedule's count
            names = (
                ["opt_state/adam_count"]
                + [f"opt_state/mu/{k}" for k in self.params]
                + [f"opt_state/nu/{k}" for k in self.params]
                + ["opt_state/schedule_count"]
                + names
            )
        return names + ["step"]

    def _expected(self, leaf: str) -> tuple[tuple[int, ...], tuple[np.dtype, ...] | None]:
        if leaf in ("step", "opt_state/adam_count", "opt_state/schedule_count"):
            return (), None  # an integer scalar
        key = leaf.split("/", 2)[-1] if leaf.startswith("opt_state/") else leaf.split("/", 1)[1]
        return self.params[key].shard_shape, _FLOATS

    def _check_headers(self) -> None:
        stored: set[str] = set()
        desc = (
            f"config (n_layers={self.config.n_layers}, d_model={self.config.d_model}, "
            f"vocab_size={self.config.vocab_size}) on {self.shards} shards"
        )
        for members in self._where:
            open_zips: dict[Path, zipfile.ZipFile] = {}
            try:
                for leaf, (path, member) in zip(self._leaves, members):
                    if path not in open_zips:
                        open_zips[path] = zipfile.ZipFile(path)
                    try:
                        shape, dtype = _read_npy_header(open_zips[path], member)
                    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
                        raise ConversionError(f"{path} {member[:-4]} ({leaf}): unreadable array header: {e}") from None
                    want_shape, want_dtypes = self._expected(leaf)
                    if shape != want_shape:
                        raise ConversionError(
                            f"{path} {member[:-4]} ({leaf}): shape {shape}, but the {desc} expects {want_shape}"
                        )
                    ok = np.issubdtype(dtype, np.integer) if want_dtypes is None else dtype in want_dtypes
                    if not ok:
                        raise ConversionError(f"{path} {member[:-4]} ({leaf}): unexpected dtype {dtype}")
                    if leaf.startswith("params/"):
                        stored.add("bfloat16" if dtype == np.dtype("V2") else dtype_name(dtype))
            finally:
                for z in open_zips.values():
                    z.close()
        if len(stored) != 1:
            raise ConversionError(
                f"{self.step_dir}: its parameters are stored in several dtypes ({sorted(stored)}); "
                "a mesh-transformer-jax checkpoint stores all of them in one"
            )
        self.stored_dtype = stored.pop()

    # -- reading ---------------------------------------------------------------------------
    def _read(self, shard: int, leaf_index: int) -> np.ndarray:
        path, member = self._where[shard][leaf_index]
        try:
            with self._reading:
                if path not in self._npz:
                    self._npz[path] = np.load(path)
                array = self._npz[path][member[:-4]]
        except (ValueError, OSError, zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise ConversionError(f"{path} {member[:-4]} ({self._leaves[leaf_index]}): unreadable: {e}") from None
        if array.dtype == np.dtype("V2"):  # bfloat16 saved by a numpy that did not know it
            array = array.view(jnp.bfloat16)
        return array

    def _dense(self, leaf: str, assemble: str, mean_of_sums: bool = False) -> np.ndarray:
        """One leaf reassembled over the shards as float32, as the original computed with it.

        Column-parallel weights (q, k, v, fc_in, lm_head) are concatenated by columns, row-parallel
        ones (embedding rows, out, fc_out) by rows; the embedding and fc_out biases were added once
        per shard before a psum, so the dense bias is their sum; LayerNorms were all-gathered and
        shard 0's copy used (the others are untrained), so only shard 0 counts. (The embedding bias
        has no HF or gptj_flax counterpart: :meth:`get` folds it into every row of the table.)
        """
        index = self._leaves.index(leaf)
        if assemble == FIRST:
            return self._read(0, index).astype(np.float32)
        if assemble == SUM:
            total = np.zeros(self._expected(leaf)[0], np.float64)  # exact for any shard count
            for shard in range(self.shards):
                total += self._read(shard, index)
            return (total / self.shards if mean_of_sums else total).astype(np.float32)
        part_shape = self._expected(leaf)[0]
        axis = 0 if assemble == ROWS else len(part_shape) - 1
        shape = list(part_shape)
        shape[axis] *= self.shards
        out = np.empty(shape, np.float32)
        for shard in range(self.shards):
            index_slice = [slice(None)] * len(shape)
            index_slice[axis] = slice(shard * part_shape[axis], (shard + 1) * part_shape[axis])
            out[tuple(index_slice)] = self._read(shard, index)
        return out

    def _to_ours(self, path: ParamPath, dense: np.ndarray) -> np.ndarray:
        c = self.config
        if path[-1] in ("q_proj", "k_proj", "v_proj"):
            return dense.reshape(c.d_model, c.n_heads, c.head_dim)
        if path[-1] == "out_proj":
            return dense.reshape(c.n_heads, c.head_dim, c.d_model)
        return dense

    def get(self, path: ParamPath) -> np.ndarray:
        """A parameter (unrolled path) in our orientation, float32."""
        key = legacy_key(path)
        dense = self._dense(f"params/{key}", self.params[key].assemble)
        if path == ("wte",):
            dense += self._dense(f"params/{_EMBED_B}", SUM)
        return self._to_ours(path, dense)

    def moment(self, which: str, path: ParamPath) -> np.ndarray:
        """Adam's ``mu`` or ``nu`` for a parameter (unrolled path) in our orientation, float32.

        The summed biases got the same gradient on every shard (their sum is what the model used),
        so their moments are the moments of the dense bias: the mean over shards (equal copies in
        practice). ``wte`` takes the embedding weight's moments; the folded embedding bias has none.
        """
        if not self.full:
            raise ConversionError(
                f"{self.step_dir}: a slim checkpoint (no optimiser state); Adam moments need the full checkpoint"
            )
        key = legacy_key(path)
        dense = self._dense(f"opt_state/{which}/{key}", self.params[key].assemble, mean_of_sums=True)
        return self._to_ours(path, dense)

    def adam_count(self) -> int:
        if not self.full:
            raise ConversionError(f"{self.step_dir}: a slim checkpoint has no Adam step count")
        return int(self._read(0, self._leaves.index("opt_state/adam_count")))

    def close(self) -> None:
        for npz in self._npz.values():
            npz.close()
        self._npz.clear()

    def __enter__(self) -> LegacyCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def config_for_legacy(config_path: str | os.PathLike) -> tuple[Config, int | None]:
    """A config file (legacy or modern) → (Config, the checkpoint's shard count if the file says)."""
    path = Path(config_path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: cannot read the config: {e}") from None
    try:
        config = from_dict(raw)
    except ValueError as e:
        raise ConversionError(f"{path}: {e}") from None
    return config, (raw.get("cores_per_replica") if is_legacy(raw) else None)


def from_legacy(
    step_dir: str | os.PathLike,
    out: str | os.PathLike,
    config: Config,
    shards: int | None = None,
    *,
    dtype=None,
    opt_init: Callable | None = None,
) -> Path:
    """Legacy ``step_N`` directory → Orbax checkpoint ``out`` at the same step (params, float32).

    ``dtype``: the compute dtype the written config records; default the precision the
    checkpoint's parameters are stored in (float32 for a full checkpoint). ``opt_init``: the
    training optimiser's ``init`` (e.g. ``make_optimizer(config.train).init``); with it, the
    optimiser state is written too, holding the checkpoint's Adam count and moments, so training
    continues with them (``--init-from OUT``, or resuming with OUT as the run directory).
    """
    with LegacyCheckpoint(step_dir, config.model, shards) as legacy, atomic_directory(out) as tmp:
        compute = legacy.stored_dtype if dtype is None else dtype_name(dtype)
        config = config.replace(model=dataclasses.replace(config.model, dtype=compute))
        opt_state = None if opt_init is None else _streamed_opt_state(legacy, config, opt_init)
        write_checkpoint(
            tmp,
            legacy.step,
            params=streamed_params(legacy.get, config.model),
            config=config,
            opt_state=opt_state,
            meta={"converted_from": f"legacy:{Path(step_dir).resolve()}"},
        )
    return Path(out)


def _streamed_opt_state(legacy: LegacyCheckpoint, config: Config, opt_init: Callable):
    """The state ``opt_init`` makes, with Adam's count and moments streamed from ``legacy``.

    Every other leaf (the schedule's count) starts at zero, as in a fresh optax state: fine-tuning
    restarts the schedule, as the original did.
    """
    if not legacy.full:
        raise ConversionError(f"{legacy.step_dir}: a slim checkpoint has no optimiser state to carry")
    params = streamed_params(legacy.get, config.model)
    abstract = jax.eval_shape(opt_init, jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), params))
    count = legacy.adam_count()

    def stream(node):
        if isinstance(node, optax.ScaleByAdamState):
            return optax.ScaleByAdamState(
                count=StreamedArray(node.count.shape, node.count.dtype, lambda: np.asarray(count), name="adam/count"),
                mu=streamed_params(lambda path: legacy.moment("mu", path), config.model, _dtype_of(node.mu)),
                nu=streamed_params(lambda path: legacy.moment("nu", path), config.model, _dtype_of(node.nu)),
            )
        return StreamedArray(node.shape, node.dtype, lambda: np.zeros(node.shape, node.dtype))

    return jax.tree.map(stream, abstract, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))


def _dtype_of(moments) -> np.dtype:
    """The dtype the optimiser keeps a moment tree in (e.g. bf16 ``mu`` to save memory)."""
    return np.dtype(jax.tree.leaves(moments)[0].dtype)


@dataclasses.dataclass
class LegacyAdamState:
    """Adam's state from a full legacy checkpoint, in our params' tree layout and shardings."""

    count: jax.Array  # int32 scalar: the updates Adam has made (drives its bias correction)
    mu: dict
    nu: dict


def load_legacy_opt_state(
    step_dir: str | os.PathLike, config: Config, mesh: Mesh, shards: int | None = None
) -> LegacyAdamState:
    """Adam's count, ``mu`` and ``nu`` from a full legacy checkpoint, laid out and sharded like the
    params of ``config`` on ``mesh`` (scanned or unrolled per ``config.model.scan_layers``).

    Each moment tensor goes straight onto its shards, so host memory holds one tensor at a time.
    Hand the result to :func:`gptj_flax.convert.insert_adam_moments` to continue training with it.
    """
    target, _ = checkpoint.param_targets(config.model, mesh, dtype=jnp.float32)
    with LegacyCheckpoint(step_dir, config.model, shards) as legacy:
        count = jnp.asarray(legacy.adam_count(), jnp.int32)
        moments = {
            which: place_on_mesh(
                streamed_params(functools.partial(legacy.moment, which), config.model, np.float32),
                target,
                desc=f"Adam {which}",
            )
            for which in ("mu", "nu")
        }
    return LegacyAdamState(count=count, mu=moments["mu"], nu=moments["nu"])
