"""Ahead-of-time compilation of the train step for a TPU slice, on a machine without one.

With ``libtpu`` installed (the ``tpu`` extra), ``jax.experimental.topologies`` describes a slice
(``v3:2x2``, ``v4:2x2x1``, ``v5e:2x4`` …) and XLA compiles the real sharded train step for it;
``memory_analysis()`` then says how many bytes each chip needs, before anyone rents the slice.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gptj_flax import checkpoint, partitioning
from gptj_flax.config import Config
from gptj_flax.data import Batch
from gptj_flax.errors import GptjFlaxError
from gptj_flax.model import GPTJ
from gptj_flax.training import optimizer, steps

GiB = 2**30
# Nominal HBM per JAX device (a v2/v3 device is one core with its own HBM). XLA keeps a little for
# itself (e.g. 15.48 GiB usable of a v3 core's 16) and is the judge: it refuses to compile a step
# that would not fit.
HBM_BYTES = {
    "TPU v2": 8 * GiB,
    "TPU v3": 16 * GiB,
    "TPU v4": 32 * GiB,
    "TPU v5 lite": 16 * GiB,
    "TPU v5e": 16 * GiB,
    "TPU v5p": 95 * GiB,
    "TPU v6 lite": 32 * GiB,
    "TPU v6e": 32 * GiB,
}


@dataclasses.dataclass
class AotReport:
    topology: str
    device_kind: str
    n_devices: int
    mesh: dict
    global_batch_tokens: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    hbm_bytes: int | None
    compile_error: str | None  # XLA refused: e.g. "temporaries (16.22G) exceed available HBM (15.48G)"
    compiled_flops: float  # per device, one step (XLA's cost analysis)
    scanned: bool  # nn.scan over layers: the cost analysis sees one layer
    model_flops: float  # 6·N·tokens + attention, per device, one step

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs − donated + temporaries: an upper bound (XLA may reuse donated buffers)."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool:
        """XLA's verdict: the TPU compiler refuses (RESOURCE_EXHAUSTED) a program that cannot fit."""
        return not self.compile_error

    def format(self) -> str:
        hbm = f"{self.hbm_bytes / GiB:.1f} GiB" if self.hbm_bytes else "unknown"
        verdict = "FITS (XLA compiled it for this chip)" if self.fits else "DOES NOT FIT"
        head = [
            f"topology {self.topology}: {self.n_devices} x {self.device_kind}, mesh {self.mesh}",
            f"global batch {self.global_batch_tokens:,} tokens per optimiser step",
        ]
        if self.compile_error:
            return "\n".join([*head, f"XLA: {self.compile_error} -> {verdict}"])
        return "\n".join(
            [
                *head,
                f"per device: arguments {self.argument_bytes / GiB:.2f} GiB + outputs {self.output_bytes / GiB:.2f} GiB"
                f" - aliased {self.alias_bytes / GiB:.2f} GiB + temporaries {self.temp_bytes / GiB:.2f} GiB"
                f" = {self.peak_bytes / GiB:.2f} GiB (at most) of {hbm} HBM -> {verdict}",
                f"FLOPs per device per step: compiled {self.compiled_flops:.3e}, model (6N + attention) "
                f"{self.model_flops:.3e} (ratio {self.compiled_flops / self.model_flops:.2f}"
                + ("; XLA counts a scanned layer's body once" if self.scanned else "")
                + ")",
            ]
        )


class TopologyError(GptjFlaxError, RuntimeError):
    """The TPU slice cannot be described here (libtpu missing, or an unknown name)."""


def topology_devices(topology: str):
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology, "tpu").devices
    except Exception as e:  # noqa: BLE001 - libtpu missing or an unknown name: say which
        raise TopologyError(
            f"cannot describe TPU topology {topology!r} ({e}); install the extra: pip install "
            "-e '.[tpu]', and name a slice like v3:2x2, v4:2x2x1 or v5e:2x4"
        ) from None


def compile_for_topology(config: Config, topology: str, mesh_spec=None) -> AotReport:
    devices = topology_devices(topology)
    mesh = partitioning.make_mesh(mesh_spec or config.mesh, devices=devices)
    shape = partitioning.mesh_shape(mesh)
    checkpoint.check_mesh(config.model, mesh)
    tc = config.train
    seq_len = tc.seq_len or config.model.max_len
    batch = tc.global_batch_size(partitioning.data_parallel_size(mesh))

    model = GPTJ(config.model)
    tx = optimizer.make_optimizer(tc)
    abstract, shardings = steps.state_targets(model, tx, mesh)
    data_sharding = steps.batch_sharding(mesh, accumulated=True)

    tokens = jax.ShapeDtypeStruct((tc.grad_accum_steps, batch, seq_len + 1), jnp.int32, sharding=data_sharding)
    mask = jax.ShapeDtypeStruct((tc.grad_accum_steps, batch, seq_len), jnp.float32, sharding=data_sharding)
    abstract_batch = Batch(tokens, tokens, mask)
    step = steps.compile_train_step(model, tx, mesh, shardings, optimizer.schedule(tc), tc.z_loss, accumulated=True)
    kind = devices[0].device_kind
    n_tokens = tc.grad_accum_steps * batch * seq_len
    report = AotReport(
        topology=topology,
        device_kind=kind,
        n_devices=len(devices),
        mesh=shape,
        global_batch_tokens=n_tokens,
        argument_bytes=0,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=0,
        hbm_bytes=next((v for k, v in HBM_BYTES.items() if kind.startswith(k)), None),
        compile_error=None,
        compiled_flops=0.0,
        scanned=config.model.scan_layers,
        model_flops=config.model.flops_per_token(seq_len) * n_tokens / len(devices),
    )
    try:
        with partitioning.sharding_scope(mesh):
            compiled = step.lower(abstract, abstract_batch).compile()
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
    )
