"""A bank of LoRA adapters served beside one base: stacked on the device, chosen per sequence.

Every adapter of the bank lives in one row of stacked arrays (``A`` [capacity, *in, rank], ``B``
[capacity, rank, *out] and a scale per row, for each projection the bank covers; see
:class:`gptj_flax.model.StackedLoRA`), its rank padded with zeros to the bank's. Row 0 is "no
adapter" and stays zero, so a sequence on the base runs the same program as one on an adapter, and
a batch may mix them freely. The bank's shape (:class:`~gptj_flax.model.AdapterSlots`: capacity,
rank and projections) is fixed when it is made, so adding or removing an adapter writes one row
and compiles nothing: an adapter of a higher rank, or on a projection the bank does not cover, is
refused with the setting that would make room for it.

Adapters are read as :func:`gptj_flax.convert.lora.read_adapter` reads them (a LoRA run of this
project, one of its steps, or a HuggingFace PEFT directory) and checked against the base as
:func:`gptj_flax.load` checks a merged one: the shapes, and a LoRA run's recorded base identity.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from gptj_flax import partitioning
from gptj_flax.config import LORA_PROJECTIONS, ModelConfig
from gptj_flax.convert import lora as lora_lib
from gptj_flax.convert.common import ConversionError
from gptj_flax.convert.init_from import check_architecture
from gptj_flax.model import AdapterSlots, abstract_adapter_slots, unstack_layers
from gptj_flax.sampling.samplers import SamplingError

# An adapter's name: what a request's ``model`` field gives; kept to characters safe in a URL path.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class AdapterError(SamplingError):
    """An adapter cannot be served: unreadable, made for another base, or beyond the bank's shape."""


class AdapterConflict(AdapterError):
    """The bank cannot take this now: it is full, or the name is taken (an HTTP 409)."""


class UnknownAdapter(AdapterError):
    """No adapter of this name is loaded (an HTTP 404)."""


@dataclasses.dataclass(frozen=True)
class ServedAdapter:
    """One adapter in the bank: its row, where it came from, and its rank and projections. ``salt``
    is unique to this load, so prefix-cache pages written with it are never found by another
    adapter (nor by this one's successor in the same row)."""

    name: str
    index: int
    path: str
    rank: int
    projections: tuple[str, ...]
    salt: bytes


@dataclasses.dataclass
class _Read:
    """An adapter read and checked, in host memory: per layer and projection ``(a, b)``, and its scale."""

    path: str
    rank: int
    scale: float
    projections: tuple[str, ...]
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]


def split_adapter(value: str) -> tuple[str | None, str]:
    """An ``--adapter`` value: ``NAME=DIR`` → ``(NAME, DIR)``; a bare ``DIR`` (a ``/`` before any
    ``=``, or no ``=``) → ``(None, DIR)``, the one adapter merged into the base."""
    name, equals, path = value.partition("=")
    if not equals or "/" in name or not name:
        return None, value
    return name, path


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise AdapterError(
            f"adapter name {name!r} is not valid: use 1-128 letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit"
        )
    return name


def _base_checksum(base: str | os.PathLike | None) -> str | None:
    return None if base is None else lora_lib.identify_base(os.fspath(base)).checksum


def read(path: str | os.PathLike, config: ModelConfig, base: str | os.PathLike | None, checksum: str | None) -> _Read:
    """The adapter at ``path`` for the base ``config`` (loaded from ``base``, whose files' checksum is
    ``checksum``), as host arrays: refused with the reason if it was made for another base."""
    try:
        found = lora_lib.read_adapter(path, None, config)
        check_architecture(found.config.model, config, f"adapter {path}")
    except (ConversionError, OSError, ValueError) as e:
        raise AdapterError(f"adapter {path} cannot be served: {e}") from None
    if found.base is not None and checksum is not None and found.base.checksum != checksum:
        raise AdapterError(
            f"adapter {path} was trained on the base {found.base.path} (sha256 {found.base.checksum[:12]}…), "
            f"but this server's base {base} has sha256 {checksum[:12]}…: serve it over the base it was trained on"
        )
    if found.config.model.quantize != config.quantize:
        raise AdapterError(
            f"adapter {path} was trained on a base quantised {found.config.model.quantize}, and this base is "
            f"{config.quantize or 'not quantised'}: serve it over a base stored as it was trained on"
        )
    tree = jax.tree.map(np.asarray, found.adapters)
    if found.config.model.scan_layers:
        tree = unstack_layers(tree)
    projections = found.lora.projections
    layers = [{name: _pair(tree[f"layer_{i}"], name) for name in projections} for i in range(config.n_layers)]
    return _Read(os.fspath(path), found.lora.rank, found.lora.scale, projections, layers)


def _pair(layer: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    group, module = lora_lib.ADAPTER_PATHS[name]
    ab = layer[group][module]
    return np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)


class AdapterBank:
    """Up to ``max_adapters`` adapters of rank at most ``rank`` on ``projections``, over the base
    ``config`` on ``mesh``. ``base``: where the base was loaded from, to check the base identity
    that a LoRA run records (None: not checked). ``arrays`` is the ``adapters`` collection a model
    with :attr:`slots` applies; it is replaced whole at each change, never written in place, so a
    program dispatched with the old one is unaffected."""

    def __init__(
        self,
        config: ModelConfig,
        mesh: Mesh,
        *,
        max_adapters: int,
        rank: int,
        projections: Sequence[str],
        base: str | os.PathLike | None = None,
        rules: partitioning.Rules = partitioning.DEFAULT_RULES,
    ):
        if max_adapters < 1:
            raise AdapterError(f"--max-adapters must be at least 1, got {max_adapters}")
        unknown = sorted(set(projections) - set(LORA_PROJECTIONS))
        if unknown or not projections:
            raise AdapterError(f"adapter projections {unknown or '(none)'}: choose from {', '.join(LORA_PROJECTIONS)}")
        ordered = tuple(p for p in LORA_PROJECTIONS if p in projections)
        self.config, self.mesh, self.base = config, mesh, base
        self.slots = AdapterSlots(max_adapters + 1, rank, ordered)
        abstract = abstract_adapter_slots(config, self.slots)
        self._shapes = nn.meta.unbox(abstract)
        self.shardings = partitioning.logical_to_sharding(nn.get_partition_spec(abstract), mesh, rules)
        zeros = jax.jit(
            lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._shapes), out_shardings=self.shardings
        )
        self.arrays: Any = zeros()
        self._put = jax.jit(
            lambda arrays, i, row: jax.tree.map(lambda big, x: big.at[i].set(x.astype(big.dtype)), arrays, row),
            out_shardings=self.shardings,
        )
        self._checksum: str | None = None
        self._loads = itertools.count(1)
        # Replaced whole at each change, never changed in place: other threads read them meanwhile.
        self.adapters: dict[str, ServedAdapter] = {}
        self._salts: dict[int, bytes] = {}

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        mesh: Mesh,
        adapters: Mapping[str, str | os.PathLike],
        *,
        max_adapters: int | None = None,
        rank: int | None = None,
        projections: Sequence[str] = (),
        base: str | os.PathLike | None = None,
        rules: partitioning.Rules = partitioning.DEFAULT_RULES,
    ) -> AdapterBank:
        """A bank holding ``adapters`` (name → path), of rank ``rank`` on ``projections``, by default
        the largest rank and every projection among them (an adapter beyond a rank or projections
        given is refused); ``max_adapters`` defaults to their number."""
        checksum = _base_checksum(base) if base is not None else None
        found = {check_name(name): read(path, config, base, checksum) for name, path in adapters.items()}
        rank = rank or max([1, *(r.rank for r in found.values())])
        covered = set(projections or set().union(*(r.projections for r in found.values())))
        bank = cls(
            config,
            mesh,
            max_adapters=max_adapters if max_adapters is not None else max(1, len(found)),
            rank=rank,
            projections=sorted(covered) or ["q_proj", "v_proj"],
            base=base,
            rules=rules,
        )
        bank._checksum = checksum
        for name, read_one in found.items():
            bank._install(name, read_one)
        return bank

    # -- what requests name --------------------------------------------------------------------
    def index(self, name: str | None) -> int:
        """The row of adapter ``name`` (0 for None: the base)."""
        if name is None:
            return 0
        if name not in self.adapters:
            raise UnknownAdapter(f"no adapter named {name!r} is loaded (loaded: {', '.join(self.adapters) or 'none'})")
        return self.adapters[name].index

    def salt(self, index: int) -> bytes:
        """The prefix-cache salt of the adapter in row ``index`` (empty for the base)."""
        return self._salts.get(index, b"")

    @property
    def max_adapters(self) -> int:
        return self.slots.capacity - 1

    @property
    def bytes_per_adapter(self) -> int:
        """Bytes on the devices that one row of the bank takes (every row takes as much)."""
        total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self._shapes))
        return total // self.slots.capacity

    # -- changes ---------------------------------------------------------------------------------
    def add(self, name: str, path: str | os.PathLike) -> ServedAdapter:
        """Load the adapter at ``path`` as ``name`` into a free row; compiles nothing."""
        return self.install(name, self.prepare(name, path))

    def prepare(self, name: str, path: str | os.PathLike) -> _Read:
        """The slow half of :meth:`add`: the adapter at ``path`` read and checked, for :meth:`install`."""
        self._check_free(name)  # refuse a full bank or a taken name before reading anything
        if self._checksum is None and self.base is not None:
            self._checksum = _base_checksum(self.base)
        return read(path, self.config, self.base, self._checksum)

    def install(self, name: str, found: _Read) -> ServedAdapter:
        """The quick half of :meth:`add`: ``found`` (from :meth:`prepare`) written into a free row as ``name``."""
        self._check_free(name)
        return self._install(name, found)

    def remove(self, name: str) -> ServedAdapter:
        """Take adapter ``name`` out (its row zeroed, free for another); compiles nothing. A request
        that names it afterwards is refused at once; one already running must have ended."""
        self.index(name)
        adapter = self.adapters[name]
        self.adapters = {k: v for k, v in self.adapters.items() if k != name}
        self._salts = {i: salt for i, salt in self._salts.items() if i != adapter.index}
        self._write(adapter.index, self._zero_row())
        return adapter

    def _check_free(self, name: str) -> None:
        check_name(name)
        if name in self.adapters:
            raise AdapterConflict(f"an adapter named {name!r} is loaded already: remove it first, or pick another name")
        self._free_row()

    def _free_row(self) -> int:
        used = {a.index for a in self.adapters.values()}
        for index in range(1, self.slots.capacity):
            if index not in used:
                return index
        raise AdapterConflict(
            f"the adapter bank is full ({self.max_adapters} adapters, --max-adapters): remove one first "
            "(DELETE /v1/adapters/NAME), or restart with a larger --max-adapters"
        )

    def _install(self, name: str, found: _Read) -> ServedAdapter:
        if found.rank > self.slots.rank:
            raise AdapterError(
                f"adapter {found.path} has rank {found.rank}, above this bank's {self.slots.rank}: "
                f"restart with --max-adapter-rank {found.rank} (or more)"
            )
        missing = [p for p in found.projections if p not in self.slots.projections]
        if missing:
            raise AdapterError(
                f"adapter {found.path} adapts {', '.join(missing)}, which this bank does not cover "
                f"({', '.join(self.slots.projections)}): restart with --adapter-targets naming them"
            )
        index = self._free_row()
        self._write(index, self._row(found))
        served = ServedAdapter(
            name, index, found.path, found.rank, found.projections, f"{next(self._loads)}:{name}".encode()
        )
        self.adapters = {**self.adapters, name: served}
        self._salts = {**self._salts, index: served.salt}
        return served

    def _row(self, found: _Read) -> dict:
        """One row of the bank holding ``found``: its matrices padded to the bank's rank, zeros on
        the projections it leaves alone."""
        row = self._zero_row()
        for i, layer in enumerate(found.layers):
            for name, (a, b) in layer.items():
                group, _ = lora_lib.ADAPTER_PATHS[name]
                leaves = row[f"layer_{i}"][group][f"{name}_adapters"]
                pad = self.slots.rank - a.shape[-1]
                leaves["a"] = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
                leaves["b"] = np.pad(b, [(0, pad)] + [(0, 0)] * (b.ndim - 1))
                leaves["scale"] = np.float32(found.scale)
        return row

    def _zero_row(self) -> dict:
        return jax.tree.map(lambda s: np.zeros(s.shape[1:], np.float32), self._shapes)

    def _write(self, index: int, row: dict) -> None:
        with jax.set_mesh(self.mesh):
            self.arrays = self._put(self.arrays, np.int32(index), row)

    def compilations(self) -> int:
        return self._put._cache_size()
