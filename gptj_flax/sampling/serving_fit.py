"""Will ``gptj-serve`` fit a TPU slice? The decode slots' own programs
(:mod:`~gptj_flax.sampling.slot_programs`), compiled ahead of time for the slice, as
:mod:`gptj_flax.training.aot` compiles the train step.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gptj_flax import convert, partitioning
from gptj_flax.config import Config, ModelConfig
from gptj_flax.model import AdapterSlots, abstract_adapter_slots, abstract_params
from gptj_flax.sampling import slot_programs as programs
from gptj_flax.sampling.decoding import DEFAULT_PAGE_COLUMNS, PAGE_COLUMNS, bucket
from gptj_flax.sampling.samplers import SamplingParams
from gptj_flax.sampling.slot_programs import NewRows, SlotPrograms, SlotShape
from gptj_flax.sampling.slots import MAX_PREFILL_ROWS
from gptj_flax.training.aot import GiB, TopologyError, topology_devices
from gptj_flax.training.metrics import ChipPeak, chip_peak

# One-chip topologies whose HBM is known without libtpu: their fit is then computed from shapes,
# the activations estimated from the programs' largest live tensors. (XLA's CPU compiler is no
# stand-in: it computes bfloat16 matmuls in float32, so its temporaries hold float32 copies of the
# weights and caches, 36 GiB for GPT-J-6B.)
XLA_TPU = "XLA:TPU's memory analysis"
ONE_CHIP_KINDS = {"v4:1x1x1": "TPU v4", "v5e:1x1": "TPU v5 lite", "v5p:1x1x1": "TPU v5p", "v6e:1x1": "TPU v6 lite"}
# gptj-serve's limit on alternatives per token (serving.schemas.MAX_LOGPROBS), which its slots are built for
SERVE_TOP_LOGPROBS = 20


@dataclasses.dataclass
class ServingFit:
    topology: str
    device_kind: str
    compiler: str  # who measured the activations: XLA's TPU compiler, or the estimate
    quantize: str | None
    kv_cache: str | None  # None: the cache in the compute dtype
    param_dtype: str
    batch: int  # decode slots
    cache_len: int  # tokens per slot
    chunk: int  # prefill chunk
    param_bytes: int  # per device, from the sharded shapes
    cache_bytes: int  # per device: the slots' pool of pages and a chunked prompt's own one-row cache
    activation_bytes: int  # per device: the largest temporaries of the slot programs
    hbm_bytes: int | None
    compile_error: str | None
    adapter_rank: int | None = None  # LoRA adapters served beside the base (gptj-serve --adapter NAME=DIR)
    adapter_targets: tuple[str, ...] = ()
    adapter_bytes: int = 0  # per device, one adapter of the bank

    @property
    def adapters_that_fit(self) -> int | None:
        """Adapters of ``adapter_rank`` that fit in the HBM the rest leaves (None: not asked, or unknown)."""
        if not self.adapter_bytes or self.hbm_bytes is None or not self.fits:
            return None
        return (self.hbm_bytes - self.total_bytes) // self.adapter_bytes

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.cache_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return not self.compile_error and (self.hbm_bytes is None or self.total_bytes <= self.hbm_bytes)

    def format(self) -> str:
        hbm = f"{self.hbm_bytes / GiB:.1f} GiB" if self.hbm_bytes else "unknown"
        weights = f"block projections {self.quantize}, the rest" if self.quantize else "weights"
        cache = f" ({self.kv_cache} KV cache)" if self.kv_cache else ""
        head = [
            f"serving on {self.topology} ({self.device_kind}): {weights} {self.param_dtype}, {self.batch} decode "
            f"slots x {self.cache_len} cached tokens{cache}, prefill chunks of {self.chunk}; activations: {self.compiler}"
        ]
        if self.compile_error:
            return "\n".join([*head, f"XLA: {self.compile_error} -> DOES NOT FIT"])
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        lines = [
            *head,
            f"per device: parameters {self.param_bytes / GiB:.2f} GiB + KV cache {self.cache_bytes / GiB:.2f} GiB"
            f" + activations {self.activation_bytes / GiB:.2f} GiB = {self.total_bytes / GiB:.2f} GiB of {hbm}"
            f" HBM -> {verdict}",
        ]
        if self.adapter_bytes:
            room = "unknown" if self.adapters_that_fit is None else f"{self.adapters_that_fit:,}"
            lines.append(
                f"LoRA adapters of rank {self.adapter_rank} on {', '.join(self.adapter_targets)}: "
                f"{self.adapter_bytes / 2**20:.2f} MiB each per device; {room} fit beside (gptj-serve --max-adapters; "
                "the activations as measured without adapters)"
            )
        return "\n".join(lines)


def serving_fit(
    config: Config,
    topology: str,
    *,
    batch: int,
    cache_len: int,
    chunk: int = 128,
    top_logprobs: int = SERVE_TOP_LOGPROBS,
    mesh_spec=None,
    adapter_rank: int | None = None,
    adapter_targets: tuple[str, ...] = ("q_proj", "v_proj"),
) -> ServingFit:
    """Will ``gptj-serve`` of ``config`` fit ``topology``? Compiles the decode slots' programs for
    the slice, for ``batch`` slots of ``cache_len`` tokens and prefill chunks of ``chunk``, as the
    server runs them with prompts prefilled between decode steps (:func:`lowered_programs`). The
    parameters are held in the compute dtype (as ``load(..., dtype=…)`` of that dtype holds them),
    int8 block projections where ``model.quantize`` says so, and the cache int8 with its scales
    where ``model.kv_cache`` does.

    Without libtpu a one-chip topology (:data:`ONE_CHIP_KINDS`) is still answered: parameter and
    cache bytes from the shapes, activations by :func:`serving_activation_estimate`.

    With ``adapter_rank`` it also says how many LoRA adapters of that rank on ``adapter_targets``
    fit in the HBM left (each takes a row of the adapter bank, in the compute dtype).
    """
    if cache_len > config.model.max_len or chunk > cache_len:
        raise ValueError(f"need chunk {chunk} <= cache length {cache_len} <= model.max_len {config.model.max_len}")
    mc = dataclasses.replace(
        config.model, scan_layers=False, remat_policy="none", param_dtype=config.model.dtype, attention="xla"
    )
    devices, kind, compiler = _devices(topology)
    mesh = partitioning.make_mesh(mesh_spec or (1, 1, -1), devices=devices)
    shape = serving_shape(mc, mesh, batch=batch, cache_len=cache_len, chunk=chunk, top_logprobs=top_logprobs)
    fit = ServingFit(
        topology=topology,
        device_kind=kind,
        compiler=compiler,
        quantize=mc.quantize,
        kv_cache=mc.kv_cache,
        param_dtype=mc.param_dtype,
        batch=batch,
        cache_len=cache_len,
        chunk=chunk,
        param_bytes=partitioning.bytes_per_device(abstract_params(mc), mesh),
        cache_bytes=_cache_bytes(shape, mesh),
        activation_bytes=0,
        hbm_bytes=(chip_peak(kind) or ChipPeak(0, 0, 0)).hbm_bytes or None,
        compile_error=None,
        adapter_rank=adapter_rank,
        adapter_targets=tuple(adapter_targets),
        adapter_bytes=0 if adapter_rank is None else _adapter_bytes(mc, mesh, adapter_rank, tuple(adapter_targets)),
    )
    if compiler != XLA_TPU:
        return dataclasses.replace(fit, activation_bytes=serving_activation_estimate(mc, batch, cache_len, chunk))
    return _measured(fit, SlotPrograms(shape), mesh)


def _adapter_bytes(mc: ModelConfig, mesh: Mesh, rank: int, targets: tuple[str, ...]) -> int:
    """Bytes per device of one row of an adapter bank (:class:`~gptj_flax.model.AdapterSlots`)."""
    bank = abstract_adapter_slots(mc, AdapterSlots(2, rank, targets))
    return partitioning.bytes_per_device(bank, mesh) // 2


def serving_shape(
    mc: ModelConfig,
    mesh: Mesh,
    *,
    batch: int,
    cache_len: int,
    chunk: int,
    top_logprobs: int = SERVE_TOP_LOGPROBS,
    page: int = PAGE_COLUMNS.get("tpu", DEFAULT_PAGE_COLUMNS),
) -> SlotShape:
    """The shape of the slots that ``gptj-serve`` builds on ``mesh`` for ``batch`` slots of
    ``cache_len`` tokens (``Slots`` of its decoder, one decode step a call); ``page``: the columns
    of a page on the chip (a TPU's by default)."""
    return SlotShape.build(
        mc,
        slots=batch,
        length=cache_len,
        chunk=chunk,
        steps=1,  # as the serving engine decodes
        top_logprobs=top_logprobs,
        page=page,
        batch_multiple=partitioning.data_parallel_size(mesh),
    )


def _measured(fit: ServingFit, compiled: SlotPrograms, mesh: Mesh) -> ServingFit:
    """``fit`` with the activations XLA's TPU compiler measured: the largest temporaries of the
    programs, or the compiler's refusal."""
    try:
        temporaries = [
            _temporaries(lowered.compile(), fit.topology) for lowered in lowered_programs(compiled, mesh).values()
        ]
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # XLA's TPU compiler refuses programs that cannot fit; its message has the numbers.
        return dataclasses.replace(fit, compile_error=str(e).split("RESOURCE_EXHAUSTED:")[-1].strip().splitlines()[0])
    return dataclasses.replace(fit, activation_bytes=max(temporaries))


def _devices(topology: str) -> tuple[list, str, str]:
    """``(devices, device kind, who measures the activations)`` for ``topology``: its TPU devices
    where libtpu describes it, else one CPU device standing in for a chip of :data:`ONE_CHIP_KINDS`."""
    try:
        devices = topology_devices(topology)
        return devices, devices[0].device_kind, XLA_TPU
    except TopologyError:
        if topology not in ONE_CHIP_KINDS:
            raise
        estimate = "estimated from the largest live tensors (no libtpu to compile for the chip)"
        return jax.devices("cpu")[:1], ONE_CHIP_KINDS[topology], estimate


def _temporaries(compiled, topology: str) -> int:
    memory = compiled.memory_analysis()
    if memory is None:
        raise TopologyError(f"XLA gave no memory analysis for {topology}'s serving programs")
    return memory.temp_size_in_bytes


def _chunked(shape: SlotShape) -> bool:
    """Whether a prompt can be long enough to be prefilled chunk by chunk."""
    return bucket(shape.length) > shape.chunk


def _cache_bytes(shape: SlotShape, mesh: Mesh) -> int:
    """Bytes per device of the slots' pool of pages and, where prompts can be chunked, of the
    longest prompt's own one-row cache."""
    caches = [programs.abstract_state(shape, mesh).cache]
    if _chunked(shape):
        caches.append(_prompt_cache(shape, mesh))
    return sum(math.prod(s.sharding.shard_shape(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(caches))


def _prompt_cache(shape: SlotShape, mesh: Mesh):
    """The longest prompt's one-row cache, as :func:`~gptj_flax.sampling.slot_programs.new_cache`
    makes it: replicated over the mesh."""
    with partitioning.sharding_scope(mesh, shape.rules):
        cache = jax.eval_shape(lambda: programs.new_cache(shape, bucket(shape.length)))
    return programs.abstract(cache, NamedSharding(mesh, PartitionSpec()))


def _host(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    """An argument that the host sends as a numpy array: no sharding of its own (jit places it)."""
    return jax.ShapeDtypeStruct(shape, dtype)


def _new_rows(rows: int, columns: int) -> NewRows:
    """The shapes of ``rows`` new prompts of ``columns`` columns, as the host sends them."""
    host = NewRows(
        tokens=np.zeros((rows, columns), np.int32),
        lengths=np.zeros(rows, np.int32),
        slot=np.zeros(rows, np.int32),
        max_new_tokens=np.zeros(rows, np.int32),
        eos_id=np.zeros(rows, np.int32),
        seeds=np.zeros(rows, np.uint32),
        sampling=SamplingParams.build(rows),
        want_top=np.zeros(rows, bool),
        adapter=np.zeros(rows, np.int32),
    )
    return jax.tree.map(lambda x: _host(x.shape, x.dtype), host)


def lowered_programs(compiled: SlotPrograms, mesh: Mesh) -> dict[str, jax.stages.Lowered]:
    """The slot programs that hold the most memory, lowered for ``mesh`` at their largest: a decode
    step of every slot over the whole pool, the largest batch of short prompts admitted at once,
    and, where prompts can be chunked, the longest prompt's chunk and its insert into a slot."""
    shape = compiled.shape
    params, _ = convert.param_targets(shape.config, mesh, shape.rules)
    state = programs.abstract_state(shape, mesh)
    release = jax.ShapeDtypeStruct(
        (shape.slots,), bool, sharding=partitioning.named_sharding(mesh, ("batch",), shape.rules)
    )
    table, scalar = _host((shape.slots, shape.per_row), np.int32), _host((), np.int32)
    short = _new_rows(bucket(min(MAX_PREFILL_ROWS, shape.slots), 1), min(shape.chunk, bucket(shape.length)))
    lowered = {}
    with partitioning.sharding_scope(mesh, shape.rules):
        step = (params, state, release, scalar, table)
        lowered["decode"] = compiled.decode.lower(*step, rows=shape.slots)
        lowered["admit"] = compiled.admit.lower(params, short)
        if _chunked(shape):
            columns, cache = bucket(shape.length), _prompt_cache(shape, mesh)
            prompt = _host((1, columns), np.int32)
            lowered["chunk"] = compiled.chunk.lower(params, cache, prompt, scalar, scalar, scalar)
            lowered["insert"] = compiled.insert.lower(state, cache, _new_rows(1, columns), table)
    return lowered


def serving_activation_estimate(mc: ModelConfig, batch: int, cache_len: int, chunk: int) -> int:
    """Bytes of the larger of a decode step's and a prefill chunk's live temporaries (one device).

    Counted twice over for one layer's activations (the next layer's are made while the last ones'
    are freed): q, k, v, the attention output and the MLP hidden state in the compute dtype, the
    float32 scores and their softmax; plus the float32 logits, twice (sampling masks a copy), and,
    for an int8 model, one block's largest kernel converted to the compute dtype, and for an int8
    cache one layer's keys and values so, in case the convert is not fused into its matmul.
    """
    itemsize = np.dtype(mc.compute_dtype).itemsize
    d, f, h, v = mc.d_model, mc.ff_dim, mc.n_heads, mc.vocab_size

    def program(rows: int, tokens: int) -> int:
        layer = rows * tokens * (4 * d + f) * itemsize + 2 * rows * h * tokens * cache_len * 4
        return 2 * layer + 2 * rows * v * 4

    dequantized = d * f * itemsize if mc.quantize else 0
    if mc.kv_cache:
        dequantized += 2 * batch * cache_len * d * itemsize
    return max(program(batch, 1), program(1, chunk)) + dequantized
