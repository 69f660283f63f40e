"""Ahead-of-time compilation of the train step for a TPU slice, on a machine without one (serving's
programs: :mod:`gptj_flax.sampling.serving_fit`).

With ``libtpu`` installed (the ``tpu`` extra), ``jax.experimental.topologies`` describes a slice
(``v3:2x2``, ``v4:2x2x1``, ``v5e:2x4`` …) and XLA compiles the real sharded train step for it;
``memory_analysis()`` then says how many bytes each chip needs, before anyone rents the slice.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from gptj_flax import attention, partitioning
from gptj_flax.config import Config
from gptj_flax.errors import GptjFlaxError
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
