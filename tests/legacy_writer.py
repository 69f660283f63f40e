"""Legacy mesh-transformer-jax checkpoints written exactly as the original writer did, for tests.

Independent of ``gptj_flax.convert``: it starts from a *dense* reference model and shards it the way
the original's layers held their parameters (docs/reference.md §4, and mesh-transformer-jax's
``layers.py`` / ``checkpoint.py``):

- per shard, the state ``{"opt_state": chain state, "params": {module: {name: array}}, "step": n}``
  (slim: no ``opt_state``) flattened with ``jax.tree.leaves`` — dict keys sorted, so layers go in
  string order 0, 1, 10, 11, 2, … — cut into 16 contiguous pieces (``k, m = divmod(n, 16)``, the
  first ``m`` pieces one leaf longer), piece ``i`` written to ``shard_s/i.npz`` as ``arr_0, arr_1, …``;
- column-parallel weights split by columns, row-parallel by rows; the embedding and fc_out biases
  split into per-shard parts whose **sum** is the dense bias; LayerNorms real on shard 0 and
  untrained (scale 1, offset 0) on the others;
- slim bf16 stored with the ``<V2`` header old numpy wrote for bfloat16; ``--f16`` slims as float16.

Every value of the dense model lies on a grid exactly representable in bfloat16, float16 and
float32, and the bias parts are chosen so their float sums are exact, so every storage dtype holds
the dense model exactly and a converter must reproduce it bit for bit.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gptj_flax.config import ModelConfig

ROOT = "causal_transformer_shard/~/"
GRID = 2.0**-10  # bias parts are integers × GRID, |integer| < 256: exact in bf16, fp16 and sums thereof


def _weights(rng, shape) -> np.ndarray:
    """Random values of magnitude 0.05…~1 rounded to bf16: exact in every storage dtype, no subnormals."""
    x = rng.choice([-1.0, 1.0], size=shape) * (0.05 + 0.2 * np.abs(rng.standard_normal(shape)))
    return x.astype(np.float32).astype(jnp.bfloat16).astype(np.float32)


def _grid(rng, shape, limit) -> np.ndarray:
    return (rng.integers(-limit, limit + 1, size=shape) * GRID).astype(np.float32)


def dense_model(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """A dense GPT-J in the original's orientation (Haiku weights are (in, out)).

    Keys: ``embed_w`` (V, d), ``embed_b`` (d), ``layer_{i}/{q,k,v,out,fc_in_w,fc_in_b,fc_out_w,fc_out_b,
    ln_scale,ln_offset}``, ``head_w`` (d, V), ``head_b`` (V), ``ln_f_scale``, ``ln_f_offset``.
    """
    rng = np.random.default_rng(seed)
    d, f, v = config.d_model, config.ff_dim, config.vocab_size
    model = {
        "embed_w": _weights(rng, (v, d)),
        "embed_b": _grid(rng, (d,), 64),
        "head_w": _weights(rng, (d, v)),
        "head_b": _weights(rng, (v,)),
        "ln_f_scale": 1.0 + _weights(rng, (d,)) / 4,
        "ln_f_offset": _weights(rng, (d,)),
    }
    for i in range(config.n_layers):
        for name, shape in (
            ("q", (d, d)),
            ("k", (d, d)),
            ("v", (d, d)),
            ("out", (d, d)),
            ("fc_in_w", (d, f)),
            ("fc_in_b", (f,)),
            ("fc_out_w", (f, d)),
            ("ln_offset", (d,)),
        ):
            model[f"layer_{i}/{name}"] = _weights(rng, shape)
        model[f"layer_{i}/fc_out_b"] = _grid(rng, (d,), 64)
        model[f"layer_{i}/ln_scale"] = 1.0 + _weights(rng, (d,)) / 4
    # Rounded to bf16 (a no-op for the grid-valued biases): exact in every storage dtype.
    return {k: v.astype(jnp.bfloat16).astype(np.float32) for k, v in model.items()}


def dense_moments(model: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Random Adam moments, one per dense tensor (positive, like nu, is fine for mu too)."""
    rng = np.random.default_rng(seed)
    return {k: (GRID * rng.integers(1, 200, size=v.shape)).astype(np.float32) for k, v in model.items()}


def hf_state_dict(model: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """The dense model as HF ``GPTJForCausalLM`` tensors (torch Linear is (out, in)).

    The embedding bias, which HF lacks, folds into every row of ``wte``.
    """
    sd = {
        "transformer.wte.weight": model["embed_w"] + model["embed_b"][None],
        "transformer.ln_f.weight": model["ln_f_scale"],
        "transformer.ln_f.bias": model["ln_f_offset"],
        "lm_head.weight": model["head_w"].T,
        "lm_head.bias": model["head_b"],
    }
    for i in range(config.n_layers):
        p, h = f"layer_{i}/", f"transformer.h.{i}."
        sd.update(
            {
                h + "ln_1.weight": model[p + "ln_scale"],
                h + "ln_1.bias": model[p + "ln_offset"],
                h + "attn.q_proj.weight": model[p + "q"].T,
                h + "attn.k_proj.weight": model[p + "k"].T,
                h + "attn.v_proj.weight": model[p + "v"].T,
                h + "attn.out_proj.weight": model[p + "out"].T,
                h + "mlp.fc_in.weight": model[p + "fc_in_w"].T,
                h + "mlp.fc_in.bias": model[p + "fc_in_b"],
                h + "mlp.fc_out.weight": model[p + "fc_out_w"].T,
                h + "mlp.fc_out.bias": model[p + "fc_out_b"],
            }
        )
    return {k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}


def _split_sum(rng, dense: np.ndarray, shards: int) -> list[np.ndarray]:
    """Per-shard parts on the grid whose float32 (and bf16/fp16-stored) sum is exactly ``dense``."""
    parts = [_grid(rng, dense.shape, 16) for _ in range(shards - 1)]
    last = dense - sum(parts, np.zeros_like(dense))
    assert np.all(np.abs(last / GRID) < 256)
    return parts + [last.astype(np.float32)]


def _shard_params(model, config, shards, rng, *, moments: bool) -> list[dict]:
    """The dense model (or its moments) as the original's per-shard Haiku param dicts."""
    s = shards

    def cols(x, i):
        return np.split(x, s, axis=-1)[i]

    def rows(x, i):
        return np.split(x, s, axis=0)[i]

    def summed(x):  # moments of a psum'd bias were the same on every shard; params were split parts
        return [x] * s if moments else _split_sum(rng, x, s)

    def norm(x, i, untrained):  # shards >= 1 hold untrained copies (zero moments)
        return x if i == 0 else np.full_like(x, 0.0 if moments else untrained)

    embed_b, out = summed(model["embed_b"]), []
    fc_out_b = {layer: summed(model[f"layer_{layer}/fc_out_b"]) for layer in range(config.n_layers)}
    for i in range(s):
        params = {
            ROOT + "embedding_shard/~/linear": {"w": rows(model["embed_w"], i), "b": embed_b[i]},
            ROOT + "projection_shard/~/linear": {"w": cols(model["head_w"], i), "b": cols(model["head_b"], i)},
            ROOT + "projection_shard/~/replicated_layer_norm": {
                "scale": norm(model["ln_f_scale"], i, 1.0),
                "offset": norm(model["ln_f_offset"], i, 0.0),
            },
        }
        for layer in range(config.n_layers):
            p, m = f"layer_{layer}/", f"{ROOT}layer_{layer}/~/"
            params.update(
                {
                    m + "linear": {"w": cols(model[p + "q"], i)},
                    m + "linear_1": {"w": cols(model[p + "v"], i)},
                    m + "linear_2": {"w": cols(model[p + "k"], i)},
                    m + "linear_3": {"w": rows(model[p + "out"], i)},
                    m + "linear_4": {"w": cols(model[p + "fc_in_w"], i), "b": cols(model[p + "fc_in_b"], i)},
                    m + "linear_5": {"w": rows(model[p + "fc_out_w"], i), "b": fc_out_b[layer][i]},
                    m + "replicated_layer_norm": {
                        "scale": norm(model[p + "ln_scale"], i, 1.0),
                        "offset": norm(model[p + "ln_offset"], i, 0.0),
                    },
                }
            )
        out.append(params)
    return out


def _savez(path: Path, arrays: list[np.ndarray]) -> None:
    """``np.savez(f, *arrays)`` as old numpy did it, bfloat16 included (header descr ``<V2``)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for j, array in enumerate(arrays):
            with z.open(f"arr_{j}.npy", "w", force_zip64=True) as f:
                if array.dtype == jnp.bfloat16:
                    header = {"descr": "<V2", "fortran_order": False, "shape": array.shape}
                    np.lib.format.write_array_header_1_0(f, header)
                    f.write(np.asarray(array, order="C").tobytes())
                else:
                    np.lib.format.write_array(f, np.asarray(array, order="C"), allow_pickle=False)


def write_legacy_checkpoint(
    step_dir: Path,
    model: dict[str, np.ndarray],
    config: ModelConfig,
    *,
    shards: int,
    step: int = 1000,
    dtype=np.float32,
    moments: tuple[dict, dict] | None = None,
    adam_count: int = 0,
    schedule_count: int = 0,
    seed: int = 0,
) -> None:
    """Write ``model`` as the original did: full (with ``moments`` = (mu, nu)) or slim (without)."""
    rng = np.random.default_rng(seed)
    params = _shard_params(model, config, shards, rng, moments=False)
    if moments is not None:
        mus = _shard_params(moments[0], config, shards, rng, moments=True)
        nus = _shard_params(moments[1], config, shards, rng, moments=True)
    for i in range(shards):
        state = {
            "params": jax.tree.map(lambda x: np.asarray(x).astype(dtype), params[i]),
            "step": np.array(step, np.int32),
        }
        if moments is not None:  # the original chain: scale, clip, adam, weight decay, scale, schedule
            state["opt_state"] = (
                optax.EmptyState(),
                optax.EmptyState(),
                optax.ScaleByAdamState(count=np.array(adam_count, np.int32), mu=mus[i], nu=nus[i]),
                optax.EmptyState(),
                optax.EmptyState(),
                optax.ScaleByScheduleState(count=np.array(schedule_count, np.int32)),
            )
        leaves = jax.tree.leaves(state)
        shard_dir = step_dir / f"shard_{i}"
        shard_dir.mkdir(parents=True)
        k, m = divmod(len(leaves), 16)
        for piece in range(16):
            _savez(shard_dir / f"{piece}.npz", leaves[piece * k + min(piece, m) : (piece + 1) * k + min(piece + 1, m)])
    meta = {"step": step, "checkpoints": [step], "aux": {str(step): {}}}
    (step_dir.parent / "meta.json").write_text(json.dumps(meta))


def legacy_config_dict(config: ModelConfig, shards: int) -> dict:
    """The original's JSON config for ``config`` trained on ``shards`` cores per replica."""
    return {
        "layers": config.n_layers,
        "d_model": config.d_model,
        "n_heads": config.n_heads,
        "n_vocab": config.vocab_size,
        "norm": "layernorm",
        "pe": "rotary",
        "pe_rotary_dims": config.rotary_dim,
        "seq": config.max_len,
        "cores_per_replica": shards,
        "per_replica_batch": 1,
        "gradient_accumulation_steps": 1,
        "warmup_steps": 1,
        "anneal_steps": 1,
        "lr": 1e-4,
        "end_lr": 1e-5,
        "weight_decay": 0.1,
        "total_steps": 2,
    }
