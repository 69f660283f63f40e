"""Logical axis rules, meshes, sharded initialisation. The only place that names mesh axes."""

from gptj_flax.partitioning.mesh import (
    ONE_DEVICE,
    MeshSpec,
    data_parallel_size,
    initialize_distributed,
    make_mesh,
    mesh_config,
    mesh_shape,
    spare_mesh,
)
from gptj_flax.partitioning.rules import DEFAULT_RULES, LAYOUTS, MESH_AXES, Rules, replica_axes
from gptj_flax.partitioning.sharding import (
    bytes_per_device,
    check_divisible,
    logical_to_sharding,
    named_sharding,
    restore_targets,
    sharded_init,
    sharding_rows,
    sharding_scope,
    sharding_table,
    within_replica,
)

__all__ = [
    "DEFAULT_RULES",
    "LAYOUTS",
    "MESH_AXES",
    "MeshSpec",
    "ONE_DEVICE",
    "Rules",
    "bytes_per_device",
    "check_divisible",
    "data_parallel_size",
    "initialize_distributed",
    "logical_to_sharding",
    "make_mesh",
    "mesh_config",
    "mesh_shape",
    "named_sharding",
    "replica_axes",
    "restore_targets",
    "sharded_init",
    "sharding_rows",
    "sharding_scope",
    "sharding_table",
    "spare_mesh",
    "within_replica",
]
