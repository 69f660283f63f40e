"""Fused attention kernels for training and scoring, and the choice between them per platform.

``model.attention`` names a backend: ``xla`` (the model's own einsum-softmax-einsum, exact on
every platform), ``splash`` (Pallas' Splash attention, a TPU kernel; off TPU it runs in Pallas'
interpreter, which is exact but slow: for tests), ``cudnn`` (cuDNN's fused attention through
``jax.nn.dot_product_attention``) or ``auto``: Splash on TPU, cuDNN on GPU, XLA elsewhere. A
kernel that cannot take the shape, dtype or platform falls back to XLA, with one notice per
process naming the reason.

The kernels run under ``jax.shard_map`` with the batch and head dimensions placed by the logical
axis rules in scope, so each sees its own device's [batch, heads, length, head_dim] block.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Literal

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

from gptj_flax import partitioning
from gptj_flax.config import ModelConfig

log = logging.getLogger(__name__)

Array = jax.Array

# Logical axes of q, k and v as the kernels take them: [batch, heads, length, head_dim].
KERNEL_AXES = ("batch", "heads", "length", "kv")

# Splash tiles the sequence in blocks of this many positions (the largest that divides it); 512 is
# what the TPU kernel's authors run with head_dim 256, and 128 is the smallest its layout allows.
SPLASH_BLOCKS = (512, 256, 128)

# Chips Mosaic (the Pallas TPU compiler) cannot compile Splash for: its matmuls are refused there
# (E2001 CompileTimeMosaicUnsupportedRhsType on a v3).
MOSAIC_UNSUPPORTED = ("TPU v2", "TPU v3")

# cuDNN's flash attention takes head_dim up to 256 from compute capability 9.0 (Hopper) on, up to
# 128 before (jax/_src/cudnn/fused_attention_stablehlo.py), and only half-precision inputs.
CUDNN_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Backend:
    """The attention actually compiled: ``name`` is ``xla``, ``splash`` or ``cudnn``."""

    name: str
    reason: str
    interpret: bool = False  # Splash through Pallas' interpreter (not on a TPU)
    block: int = 0  # Splash's block size along the sequence

    def describe(self) -> str:
        mode = " (Pallas interpret mode)" if self.interpret else ""
        block = f", block {self.block}" if self.block else ""
        return f"{self.name}{mode}{block}: {self.reason}"


_notices_given: set[str] = set()


def _notice(message: str) -> None:
    if message not in _notices_given:
        _notices_given.add(message)
        log.warning("%s", message)


def _fallback(reason: str) -> Backend:
    _notice(f"attention: {reason}; using the XLA attention")
    return Backend("xla", reason)


def current_device():
    """The device kind the code being traced compiles for: the mesh in scope's (which, for an
    ahead-of-time compile, describes a slice this machine does not have), else JAX's first device."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device if device is not None else jax.devices()[0]


def _compute_capability() -> tuple[int, ...]:
    capability = getattr(jax.devices()[0], "compute_capability", None) or "0.0"
    return tuple(int(part) for part in str(capability).split("."))


def choose(config: ModelConfig, seq_len: int, device=None) -> Backend:
    """The backend ``config.attention`` gives for sequences of ``seq_len`` on ``device`` (default:
    :func:`current_device`)."""
    requested = config.attention
    if requested == "xla":
        return Backend("xla", "model.attention=xla")
    device = device or current_device()
    platform = device.platform
    if requested == "auto":
        if platform not in ("tpu", "gpu"):
            return Backend("xla", f"model.attention=auto on {platform}")
        requested = "splash" if platform == "tpu" else "cudnn"
        origin = f"model.attention=auto on {platform}"
    else:
        origin = f"model.attention={requested}"
    if requested == "splash":
        if platform == "gpu":
            return _fallback(f"{origin}: Splash attention is a TPU kernel and this is a GPU")
        kind = getattr(device, "device_kind", "")
        if kind.startswith(MOSAIC_UNSUPPORTED):
            return _fallback(f"{origin}: Mosaic cannot compile the Splash kernel for {kind} (TPU v4 or later needed)")
        if seq_len < SPLASH_BLOCKS[-1]:  # e.g. the one-token trace of parameter init: no notice
            return Backend("xla", f"{origin}: {seq_len} tokens are fewer than one Splash block")
        block = next((b for b in SPLASH_BLOCKS if seq_len % b == 0), None)
        if block is None:
            return _fallback(f"{origin}: Splash needs the sequence length ({seq_len}) to be a multiple of 128")
        interpret = platform != "tpu"
        if interpret:
            _notice(f"attention: {origin} on {platform} runs Splash in Pallas' interpreter: exact, but slow")
        return Backend("splash", origin, interpret=interpret, block=block)
    if platform != "gpu":
        return _fallback(f"{origin}: cuDNN's fused attention needs an NVIDIA GPU and this is {platform}")
    if config.dtype not in CUDNN_DTYPES:
        return _fallback(f"{origin}: cuDNN's fused attention takes bfloat16 or float16, model.dtype is {config.dtype}")
    max_head_dim = 256 if _compute_capability() >= (9, 0) else 128
    if config.head_dim > max_head_dim or config.head_dim % 8:
        return _fallback(
            f"{origin}: cuDNN's fused attention takes head_dim <= {max_head_dim} (a multiple of 8) on this GPU, "
            f"the model's is {config.head_dim}"
        )
    return Backend("cudnn", origin)


def _splash_per_device(backend: Backend, q: Array, k: Array, v: Array, segment_ids: Array) -> Array:
    heads, length = q.shape[1], q.shape[2]
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * heads)
    b = backend.block
    blocks = splash.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    kernel = splash.make_splash_mha(
        mask, head_shards=1, q_seq_shards=1, block_sizes=blocks, interpret=backend.interpret
    )
    # Splash does not scale the scores itself.
    q = (q.astype(jnp.float32) / np.sqrt(q.shape[-1]).astype(np.float32)).astype(q.dtype)
    return jax.vmap(kernel)(q, k, v, splash.SegmentIds(segment_ids, segment_ids))


def dot_product_attention(
    q: Array, k: Array, v: Array, segment_ids: Array, implementation: Literal["xla", "cudnn"] | None
) -> Array:
    """``jax.nn.dot_product_attention`` of q, k, v [B, heads, T, head_dim], causal within each segment
    (the ``cudnn`` backend, and with ``implementation="xla"`` its reference)."""
    same_segment = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    query, key, value = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    out = jax.nn.dot_product_attention(
        query, key, value, mask=same_segment, is_causal=True, implementation=implementation
    )
    return out.transpose(0, 2, 1, 3)


def _spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh) -> PartitionSpec:
    """The rules' placement of ``axes``, keeping only the splits that divide ``shape`` (a dimension
    that does not divide is computed whole on every device of that axis: slower, still right)."""
    rules = tuple(nn.get_logical_axis_rules())
    placed = partitioning.mesh_axes(axes, rules, "the attention kernels' q, k and v") if rules else (None,) * len(axes)
    spec = []
    for size, where in zip(shape, placed):
        names = () if where is None else (where,) if isinstance(where, str) else tuple(where)
        ways = math.prod(int(mesh.shape[name]) for name in names)
        spec.append(where if names and size % ways == 0 else None)
    return PartitionSpec(*spec)


def kernel_attention(backend: Backend, q: Array, k: Array, v: Array, segment_ids: Array) -> Array:
    """Causal attention within segments by a fused kernel: q, k, v [B, heads, T, head_dim] (q not
    yet scaled), segment ids int [B, T] (0: padding). Returns [B, heads, T, head_dim].

    Queries see only keys of their own segment, so real tokens never see padding; a padding query
    sees the padding before it (the XLA path's padding rows differ, and no loss weighs them).
    """
    if backend.name not in ("splash", "cudnn"):
        raise ValueError(f"no fused kernel for attention backend {backend.name!r}")

    def per_device(q: Array, k: Array, v: Array, segment_ids: Array) -> Array:
        if backend.name == "splash":
            return _splash_per_device(backend, q, k, v, segment_ids)
        return dot_product_attention(q, k, v, segment_ids, implementation="cudnn")

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return per_device(q, k, v, segment_ids)
    qkv_spec = _spec(KERNEL_AXES, q.shape, mesh)
    segment_spec = PartitionSpec(qkv_spec[0], None)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(qkv_spec, qkv_spec, qkv_spec, segment_spec),
        out_specs=qkv_spec,
        check_vma=False,
    )(q, k, v, segment_ids)


def kernel_cost(
    config: ModelConfig, batch: int, seq_len: int, *, training: bool = True, layers: int | None = None
) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of the fused attention of one step over ``layers`` (default all), counted
    analytically: XLA's cost analysis does not see inside a Pallas or cuDNN kernel.

    FLOPs: q·kᵀ and p·v over the causal half of the scores; training adds the backward (2.5x the
    forward: flash attention recomputes the scores) and, under remat, the forward again (a kernel
    output is never a saved dot). Bytes: q, k, v and the output once per forward, twice that for
    the backward, in the compute dtype.
    """
    h, d, t = config.n_heads, config.head_dim, seq_len
    forward = 2 * 2 * batch * h * t * t * d / 2
    io = 4 * batch * h * t * d * np.dtype(config.compute_dtype).itemsize
    forwards = 1 + (config.remat_policy != "none") if training else 1
    flops = forward * (forwards + (2.5 if training else 0))
    moved = io * (forwards + (2 if training else 0))
    layers = config.n_layers if layers is None else layers
    return layers * flops, layers * moved


@flax.struct.dataclass
class SegmentMask:
    """What a fused kernel takes instead of a boolean mask: the segment ids and the backend."""

    segment_ids: Array  # int [B, T]
    backend: Backend = flax.struct.field(pytree_node=False)
