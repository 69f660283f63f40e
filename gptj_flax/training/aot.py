"""Ahead-of-time compilation of the train step (and of serving's programs) for a TPU slice, on a
machine without one.

With ``libtpu`` installed (the ``tpu`` extra), ``jax.experimental.topologies`` describes a slice
(``v3:2x2``, ``v4:2x2x1``, ``v5e:2x4`` …) and XLA compiles the real sharded train step for it;
``memory_analysis()`` then says how many bytes each chip needs, before anyone rents the slice.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from gptj_flax import attention, checkpoint, partitioning
from gptj_flax.config import Config
from gptj_flax.errors import GptjFlaxError
from gptj_flax.model import GPTJ, KVCache, PagedKVCache, abstract_params
from gptj_flax.training.metrics import ChipPeak, chip_peak
from gptj_flax.training.setup import TrainSetup

GiB = 2**30


@dataclasses.dataclass
class AotReport:
    topology: str
    device_kind: str
    n_devices: int
    mesh: dict
    global_batch_tokens: int
    attention: str  # the backend compiled, and why
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak: ChipPeak | None
    compile_error: str | None  # XLA refused: e.g. "temporaries (16.22G) exceed available HBM (15.48G)"
    compiled_flops: float  # per device, one step (XLA's cost analysis)
    bytes_accessed: float  # per device, one step (XLA's cost analysis)
    kernel_flops: float  # per device, one step: the fused attention's, counted analytically
    kernel_bytes: float
    scanned: bool  # nn.scan over layers: the cost analysis sees one layer
    model_flops: float  # 6·N·tokens + attention, per device, one step
    lora: str | None = None  # a LoRA step: what it trains (the base frozen)

    @property
    def hbm_bytes(self) -> int | None:
        return self.peak.hbm_bytes if self.peak else None

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs − donated + temporaries: an upper bound (XLA may reuse donated buffers)."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool:
        """XLA's verdict: the TPU compiler refuses (RESOURCE_EXHAUSTED) a program that cannot fit."""
        return not self.compile_error

    @property
    def roofline_seconds(self) -> float | None:
        """The step's lower bound on this chip: its FLOPs at peak or its bytes at full bandwidth
        (None for a scanned stack, whose layers the cost analysis counts once)."""
        if not self.peak or self.scanned:
            return None
        flops, moved = self.compiled_flops + self.kernel_flops, self.bytes_accessed + self.kernel_bytes
        return max(flops / self.peak.flops, moved / self.peak.hbm_bandwidth)

    @property
    def mfu_bound(self) -> float | None:
        """Model FLOPs over what the chip could do in :attr:`roofline_seconds`."""
        seconds = self.roofline_seconds
        return self.model_flops / (seconds * self.peak.flops) if seconds and self.peak else None

    def format(self) -> str:
        hbm = f"{self.hbm_bytes / GiB:.1f} GiB" if self.hbm_bytes else "unknown"
        verdict = "FITS (XLA compiled it for this chip)" if self.fits else "DOES NOT FIT"
        head = [
            f"topology {self.topology}: {self.n_devices} x {self.device_kind}, mesh {self.mesh}",
            f"global batch {self.global_batch_tokens:,} tokens per optimiser step",
            *([f"LoRA: {self.lora}"] if self.lora else []),
            f"attention: {self.attention}",
        ]
        if self.compile_error:
            return "\n".join([*head, f"XLA: {self.compile_error} -> {verdict}"])
        scanned = "; XLA counts a scanned layer's body once" if self.scanned else ""
        lines = [
            *head,
            f"per device: arguments {self.argument_bytes / GiB:.2f} GiB + outputs {self.output_bytes / GiB:.2f} GiB"
            f" - aliased {self.alias_bytes / GiB:.2f} GiB + temporaries {self.temp_bytes / GiB:.2f} GiB"
            f" = {self.peak_bytes / GiB:.2f} GiB (at most) of {hbm} HBM -> {verdict}",
            f"XLA cost analysis per device per step: {self.compiled_flops:.3e} FLOPs, "
            f"{self.bytes_accessed:.3e} bytes accessed{scanned}",
        ]
        if self.kernel_flops:
            lines.append(
                f"  + fused attention kernel (counted analytically; the cost analysis cannot see inside it): "
                f"{self.kernel_flops:.3e} FLOPs, {self.kernel_bytes:.3e} bytes"
                + (" in the one layer counted" if self.scanned else "")
            )
        total = self.compiled_flops + self.kernel_flops
        lines.append(
            f"model FLOPs (6N + attention) per device per step: {self.model_flops:.3e} "
            f"(compiled / model {total / self.model_flops:.2f})"
        )
        seconds, mfu = self.roofline_seconds, self.mfu_bound
        if self.peak and self.scanned:
            lines.append("roofline: not computed for a scanned stack; --set model.scan_layers=false gives it")
        elif self.peak and seconds is not None and mfu is not None:
            lines.append(
                f"roofline on {self.device_kind} ({self.peak.flops / 1e12:.0f} TFLOP/s, "
                f"{self.peak.hbm_bandwidth / 1e9:.0f} GB/s): {1e3 * seconds:.1f} ms per step, "
                f"MFU at most {100 * mfu:.0f}%"
            )
        return "\n".join(lines)


class TopologyError(GptjFlaxError, RuntimeError):
    """The TPU slice cannot be described here (libtpu missing, or an unknown name)."""


def topology_devices(topology: str):
    from jax.experimental import topologies

    # libtpu takes a machine-wide lock by default, which guards real chips; a compile for a
    # described slice uses none, so several may run side by side.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # v4 and v5p chips have two cores that JAX runs as one device ("megacore"), as on a real slice.
    kwargs: dict = {"chip_config_name": "megacore"} if topology.startswith(("v4", "v5p")) else {}
    if all(dim == "1" for dim in topology.partition(":")[2].split("x")):
        # One chip (v5e:1x1, v4:1x1x1): libtpu's default host holds 2x2x1 chips, which one chip does not divide.
        kwargs["chips_per_host_bounds"] = (1, 1, 1)
    try:
        return topologies.get_topology_desc(topology, "tpu", **kwargs).devices
    except Exception as e:  # noqa: BLE001 - libtpu missing or an unknown name: say which
        raise TopologyError(
            f"cannot describe TPU topology {topology!r} ({e}); install the extra: pip install "
            "-e '.[tpu]', and name a slice like v3:2x2, v4:2x2x1 or v5e:2x4"
        ) from None


def compile_for_topology(config: Config, topology: str, mesh_spec=None) -> AotReport:
    """Compile ``config``'s train step for the TPU slice ``topology`` (the step ``train`` runs, from
    the same :class:`~gptj_flax.training.setup.TrainSetup`) and report what each chip needs."""
    devices = topology_devices(topology)
    setup = TrainSetup.build(config, partitioning.make_mesh(mesh_spec or config.mesh, devices=devices))
    # A LoRA step also takes the frozen base, held in bfloat16 or, for QLoRA, with int8 block projections
    # (an argument: it counts in the HBM used).
    base = () if config.train.lora is None else (setup.base_targets(),)
    train_step, _ = setup.compile(*base)
    report = _unmeasured(setup, topology, devices)
    try:
        with partitioning.sharding_scope(setup.mesh):
            compiled = train_step.lower(setup.targets, setup.abstract_batch(), *base).compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # XLA's TPU compiler refuses programs that cannot fit; its message has the numbers.
        return dataclasses.replace(
            report, compile_error=str(e).split("RESOURCE_EXHAUSTED:")[-1].strip().splitlines()[0]
        )
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dataclasses.replace(
        report,
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        compiled_flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
    )


def _unmeasured(setup: TrainSetup, topology: str, devices) -> AotReport:
    """The report of ``setup``'s step on ``devices`` before XLA measures it: what is known from the
    config, the fused attention kernel's cost counted analytically."""
    mc, tc = setup.config.model, setup.config.train
    kind, backend = devices[0].device_kind, setup.attention
    kernel_flops, kernel_bytes = (
        # a scanned stack's body is one layer to the cost analysis: count the kernel in it once too
        attention.kernel_cost(
            mc, tc.grad_accum_steps * setup.batch_size, setup.seq_len, layers=1 if mc.scan_layers else None
        )
        if backend.name != "xla"
        else (0, 0)
    )
    return AotReport(
        topology=topology,
        device_kind=kind,
        n_devices=len(devices),
        mesh=partitioning.mesh_shape(setup.mesh),
        global_batch_tokens=setup.tokens_per_step,
        attention=backend.describe(),
        lora=None
        if tc.lora is None
        else f"rank {tc.lora.rank} on {', '.join(tc.lora.projections)}, "
        + ("bfloat16 base" if mc.quantize is None else f"{mc.quantize} base (QLoRA)"),
        argument_bytes=0,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=0,
        peak=chip_peak(kind),
        compile_error=None,
        compiled_flops=0.0,
        bytes_accessed=0.0,
        kernel_flops=kernel_flops / len(devices),
        kernel_bytes=kernel_bytes / len(devices),
        scanned=mc.scan_layers,
        model_flops=mc.flops_per_token(setup.seq_len) * setup.tokens_per_step / len(devices),
    )


# --------------------------------------------------------------------------------------------
# Serving fit: the decode-slot step and a prefill chunk, as gptj-serve runs them

# One-chip topologies whose HBM is known without libtpu: their fit is then computed from shapes,
# the activations estimated from the programs' largest live tensors. (XLA's CPU compiler is no
# stand-in: it computes bfloat16 matmuls in float32, so its temporaries hold float32 copies of the
# weights and caches, 36 GiB for GPT-J-6B.)
XLA_TPU = "XLA:TPU's memory analysis"
ONE_CHIP_KINDS = {"v4:1x1x1": "TPU v4", "v5e:1x1": "TPU v5 lite", "v5p:1x1x1": "TPU v5p", "v6e:1x1": "TPU v6 lite"}


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
    cache_bytes: int  # per device: the slots' cache and the prefill chunk's own one-row cache
    activation_bytes: int  # per device: the larger temporaries of the decode step and a prefill chunk
    hbm_bytes: int | None
    compile_error: str | None

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
        return "\n".join(
            [
                *head,
                f"per device: parameters {self.param_bytes / GiB:.2f} GiB + KV cache {self.cache_bytes / GiB:.2f} GiB"
                f" + activations {self.activation_bytes / GiB:.2f} GiB = {self.total_bytes / GiB:.2f} GiB of {hbm}"
                f" HBM -> {verdict}",
            ]
        )


def serving_fit(
    config: Config, topology: str, *, batch: int, cache_len: int, chunk: int = 128, mesh_spec=None
) -> ServingFit:
    """Will ``gptj-serve`` of ``config`` fit ``topology``? Compiles its two programs for the slice:
    one decode step of ``batch`` slots of ``cache_len`` tokens, and one prefill chunk into a
    one-row cache. The parameters are held in the compute dtype (as ``load(..., dtype=…)`` of
    that dtype holds them), int8 block projections where ``model.quantize`` says so, and the cache
    int8 with its scales where ``model.kv_cache`` does.

    Without libtpu a one-chip topology (:data:`ONE_CHIP_KINDS`) is still answered: parameter and
    cache bytes from the shapes, activations by :func:`serving_activation_estimate`.
    """
    if cache_len > config.model.max_len or chunk > cache_len:
        raise ValueError(f"need chunk {chunk} <= cache length {cache_len} <= model.max_len {config.model.max_len}")
    mc = dataclasses.replace(
        config.model, scan_layers=False, remat_policy="none", param_dtype=config.model.dtype, attention="xla"
    )
    try:
        devices = topology_devices(topology)
        kind, compiler = devices[0].device_kind, XLA_TPU
    except TopologyError:
        if topology not in ONE_CHIP_KINDS:
            raise
        devices, kind = jax.devices("cpu")[:1], ONE_CHIP_KINDS[topology]
        compiler = "estimated from the largest live tensors (no libtpu to compile for the chip)"
    mesh = partitioning.make_mesh(mesh_spec or (1, 1, -1), devices=devices)
    programs, cache_bytes = _serving_programs(mc, mesh, batch, cache_len, chunk)
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
        cache_bytes=cache_bytes,
        activation_bytes=0,
        hbm_bytes=(chip_peak(kind) or ChipPeak(0, 0, 0)).hbm_bytes or None,
        compile_error=None,
    )
    if compiler != XLA_TPU:
        return dataclasses.replace(fit, activation_bytes=serving_activation_estimate(mc, batch, cache_len, chunk))
    temporaries = []
    try:
        with partitioning.sharding_scope(mesh):
            for fn, args, donated in programs:
                compiled = jax.jit(fn, donate_argnums=donated).lower(*args).compile()
                memory = compiled.memory_analysis()
                if memory is None:
                    raise TopologyError(f"XLA gave no memory analysis for {topology}'s serving programs")
                temporaries.append(memory.temp_size_in_bytes)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return dataclasses.replace(fit, compile_error=str(e).split("RESOURCE_EXHAUSTED:")[-1].strip().splitlines()[0])
    return dataclasses.replace(fit, activation_bytes=max(temporaries))


def _serving_programs(mc, mesh, batch: int, cache_len: int, chunk: int) -> tuple[list, int]:
    """``([(program, abstract arguments, donated argument), …], cache bytes per device)`` of the
    decode-slot step and a prefill chunk, as ``gptj-serve`` of ``mc`` runs them on ``mesh``."""
    params, _ = checkpoint.param_targets(mc, mesh)

    def targets(shapes, shardings):
        # shardings: a prefix of shapes (a paged cache has one sharding per layer's pool)
        return jax.tree.map(
            lambda sh, sub: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), sub),
            shardings,
            shapes,
        )

    # The decode slots' pool as one block of one page per row: the bytes of any paging of
    # cache_len tokens a row (a whole number of pages).
    slots = targets(
        jax.eval_shape(lambda: PagedKVCache.empty(mc, (batch,), cache_len, batch)),
        partitioning.logical_to_sharding(PagedKVCache.logical_axes(mc), mesh),
    )
    one_row = targets(
        jax.eval_shape(lambda: KVCache.empty(mc, 1, cache_len)),
        partitioning.logical_to_sharding(KVCache.logical_axes(mc), mesh),
    )
    rows = partitioning.named_sharding(mesh, ("batch", None))
    model = GPTJ(mc)

    def decode_step(params, tokens, positions, active, cache, table):
        return model.apply({"params": params}, tokens, positions, active, cache, table, method=GPTJ.decode_slots)

    def prefill_chunk(params, tokens, cache):
        return model.apply({"params": params}, tokens, None, None, cache, last_logits_only=True, method=GPTJ.decode)

    decode_args = (
        params,
        jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=rows),
        jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=rows),
        jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=partitioning.named_sharding(mesh, ("batch",))),
        slots,
        jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=rows),  # the page table: row r's page is r
    )
    replicated = partitioning.named_sharding(mesh, (None, None))
    prefill_args = (params, jax.ShapeDtypeStruct((1, chunk), jnp.int32, sharding=replicated), one_row)
    cache_bytes = sum(
        math.prod(s.sharding.shard_shape(s.shape)) * np.dtype(s.dtype).itemsize
        for s in jax.tree.leaves((slots, one_row))
    )
    return [(decode_step, decode_args, 4), (prefill_chunk, prefill_args, 2)], cache_bytes


def serving_activation_estimate(mc, batch: int, cache_len: int, chunk: int) -> int:
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
