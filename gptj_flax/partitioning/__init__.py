"""Logical axis rules, meshes, sharded initialisation. The only place that names mesh axes."""

from gptj_flax.partitioning.mesh import initialize_distributed, make_mesh, mesh_config, mesh_shape
from gptj_flax.partitioning.rules import DEFAULT_RULES, LAYOUTS, MESH_AXES, Rules
from gptj_flax.partitioning.sharding import (
    abstract_init,
    activate,
    bytes_per_device,
    format_bytes,
    logical_to_sharding,
    named_sharding,
    sharded_init,
    sharding_rows,
    sharding_table,
)

__all__ = [
    "DEFAULT_RULES", "LAYOUTS", "MESH_AXES", "Rules", "abstract_init", "activate", "bytes_per_device",
    "format_bytes", "initialize_distributed", "logical_to_sharding", "make_mesh", "mesh_config",
    "mesh_shape", "named_sharding", "sharded_init", "sharding_rows", "sharding_table",
]
