"""Device meshes and the multi-controller runtime."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from gptj_flax.config import ConfigError, MeshConfig
from gptj_flax.partitioning.rules import DEFAULT_RULES, LAYOUTS, MESH_AXES, Rules, replica_axes

MeshSpec = Mesh | MeshConfig | str | Sequence[int] | None
ONE_DEVICE = (1, 1, 1)  # the default mesh of sampling, scoring and evaluation

log = logging.getLogger(__name__)


def mesh_config(spec: MeshConfig | str | Sequence[int] | None) -> MeshConfig:
    """The one reader of mesh specs: a MeshConfig, a layout name from ``LAYOUTS``, sizes ``"d,f,m"``
    (or ``"dxfxm"``, for places that split on commas) or a sequence of three sizes; None → the
    default MeshConfig."""
    if spec is None:
        return MeshConfig()
    if isinstance(spec, MeshConfig):
        return spec
    if isinstance(spec, str):
        if spec in LAYOUTS:
            return MeshConfig(*LAYOUTS[spec])
        parts = [p.strip() for p in spec.replace("x", ",").split(",")]
        hint = f"give data,fsdp,model sizes such as 1,-1,8 (-1: the remaining devices) or a layout name: {', '.join(LAYOUTS)}"
        if len(parts) != len(MESH_AXES):
            raise ConfigError(f"mesh {spec!r}: expected three sizes; {hint}")
        try:
            sizes = [int(p) for p in parts]
        except ValueError:
            raise ConfigError(f"mesh {spec!r}: sizes must be integers; {hint}") from None
        return MeshConfig(*sizes)  # outside the try: its own errors (two -1s, zero) are ConfigErrors
    if not isinstance(spec, Sequence) or len(spec) != len(MESH_AXES):
        raise ConfigError(f'mesh {spec!r}: expected a mesh, a layout name, "data,fsdp,model" or three sizes')
    return MeshConfig(*spec)


def make_mesh(spec: MeshSpec = None, devices=None) -> Mesh:
    """A mesh over axes (data, fsdp, model) with Auto axis types (linen's constraints need Auto);
    ``spec`` is anything :func:`mesh_config` reads, or a ``Mesh``, returned as it is.

    With fewer devices requested than exist (e.g. (2,1,1) on 8), the first ones are used, with a
    warning; a one-device mesh is taken as deliberate (it is the default for sampling).
    """
    if isinstance(spec, Mesh):
        return spec
    devices = list(jax.devices() if devices is None else devices)
    config = mesh_config(spec)
    try:
        shape = config.resolve(len(devices))
    except ConfigError as e:
        needed = math.prod(s for s in config.shape if s != -1)
        if devices[0].platform == "cpu" and needed > len(devices):
            raise ConfigError(
                f"{e}; on CPU, get {needed} virtual devices by starting with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}"
            ) from None
        raise
    n = math.prod(shape)
    if 1 < n < len(devices):
        log.warning(
            "mesh %s uses %d of the %d devices; the other %d stay idle (put -1 on one axis to use them all)",
            shape,
            n,
            len(devices),
            len(devices) - n,
        )
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:n])


def spare_mesh(mesh: Mesh) -> Mesh | None:
    """A mesh of ``mesh``'s shape over this process's next devices outside it, or None where there
    are too few (or several processes: each would need spares of its own)."""
    if jax.process_count() > 1:
        return None
    used = set(mesh.devices.flat)
    spare = [d for d in jax.local_devices(backend=mesh.devices.flat[0].platform) if d not in used]
    if len(spare) < mesh.devices.size:
        return None
    return Mesh(
        np.array(spare[: mesh.devices.size]).reshape(mesh.devices.shape), mesh.axis_names, axis_types=mesh.axis_types
    )


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    return {name: int(mesh.shape[name]) for name in MESH_AXES}


def data_parallel_size(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    """How many ways the batch is split: the product of the mesh axes the rules map ``batch`` to."""
    return math.prod(int(mesh.shape[a]) for a in replica_axes(rules))


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """Start JAX's multi-controller runtime when running on several hosts.

    On TPU VMs (and SLURM/GKE) JAX discovers everything itself; elsewhere pass the coordinator
    address, process count and this process's id (or set JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID). A single process with no flags stays single-host.
    """
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    on_tpu_pod = "TPU_WORKER_HOSTNAMES" in os.environ or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ
    if coordinator is None and not on_tpu_pod:
        return
    jax.distributed.initialize(coordinator, num_processes, process_id)
    log.info(
        "process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
