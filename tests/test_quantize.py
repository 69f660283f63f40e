"""Weight-only int8 (``model.quantize="int8"``): the round trip against a numpy reference, parameter
memory against bf16 measured on the devices, the sharding of every layout, ``gptj-convert
quantize``, ``gptj-sample --quantize`` and the refusals. Generation and perplexity:
``test_quantize_generation.py``."""

from __future__ import annotations

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import gptj_flax
from gptj_flax import convert, partitioning
from gptj_flax.checkpoint import Checkpointer
from gptj_flax.config import Config, ConfigError, TrainConfig, load_config
from gptj_flax.convert import ConversionError
from gptj_flax.convert.quantize import quantize_kernel, quantized_kernels
from gptj_flax.model import GPTJ, abstract_params
from gptj_flax.sampling import SamplingError
from gptj_flax.training import train
from tests import commands
from tests.helpers import tiny_config
from tests.test_sampling_api import make_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The kernels quantised, by path inside a block, and their number of output dims.
BLOCK_KERNELS = {
    ("attn", "q_proj"): 2,
    ("attn", "k_proj"): 2,
    ("attn", "v_proj"): 2,
    ("attn", "out_proj"): 1,
    ("mlp", "fc_in", "kernel"): 1,
    ("mlp", "fc_out", "kernel"): 1,
}


def random_params(config, seed: int = 0) -> dict:
    return nn.meta.unbox(GPTJ(config).init(jax.random.key(seed), jnp.zeros((1, 1), jnp.int32)))["params"]


def save(directory, config, params, step: int = 0) -> str:
    ckpt = Checkpointer(directory)
    ckpt.save(step, params=params, config=Config(model=config, train=TrainConfig(batch_size=2)))
    ckpt.close()
    return str(directory)


def dequantized_reference(int8_params: dict) -> dict:
    """Float params holding what an unrolled int8 tree stands for: each kernel times its scale, in numpy."""
    flat = {k: np.asarray(v) for k, v in traverse_util.flatten_dict(jax.device_get(int8_params)).items()}
    out = {}
    for path, value in flat.items():
        scale = flat.get((*path[:-1], path[-1] + "_scale"))
        if path[-1].endswith("_scale"):
            continue
        if scale is None:
            out[path] = value
        else:  # the scale broadcast over the kernel's leading input dims
            out[path] = value.astype(np.float32) * scale.reshape((1,) * (value.ndim - scale.ndim) + scale.shape)
    return traverse_util.unflatten_dict(out)


# ------------------------------------------------------------------------------------------------
# The round trip


@pytest.mark.parametrize("shape, n_out, lead", [((64, 8, 16), 2, 0), ((8, 16, 64), 1, 0), ((3, 64, 256), 1, 1)])
def test_dequantised_weights_are_within_half_a_step_of_the_originals(shape, n_out, lead):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32) * 0.02
    w.reshape(-1)[7] = 0.5  # an outlier: only its own channel's step grows
    w[..., 3] = 0.0  # an all-zero channel (or part of one)
    q, scale = quantize_kernel(w, n_out, lead)
    assert q.dtype == np.int8 and scale.dtype == np.float32
    assert scale.shape == shape[:lead] + shape[len(shape) - n_out :]
    # numpy reference, one output channel of one layer at a time: [layers, inputs, channels]
    layers, channels = int(np.prod(shape[:lead])), int(np.prod(shape[len(shape) - n_out :]))
    w3, q3, s2 = w.reshape(layers, -1, channels), q.reshape(layers, -1, channels), scale.reshape(layers, channels)
    for layer in range(layers):
        for c in range(channels):
            original, codes, step = w3[layer, :, c], q3[layer, :, c].astype(np.float64), s2[layer, c]
            largest = np.abs(original).max()
            assert step == pytest.approx(largest / 127 if largest > 0 else 1.0, rel=1e-6)
            assert np.abs(codes).max() <= 127
            assert np.all(np.abs(codes * step - original) <= step / 2 * (1 + 1e-5))


def test_the_quantised_kernels_are_the_six_block_projections():
    for scan in (True, False):
        config = tiny_config(quantize="int8", scan_layers=scan)
        found = quantized_kernels(config)
        want = {
            (("layers",) if scan else (f"layer_{i}",)) + path: (int(scan), n_out)
            for i in range(1 if scan else config.n_layers)
            for path, n_out in BLOCK_KERNELS.items()
        }
        assert found == want
    dtypes = {
        "/".join(p): str(x.dtype) for p, x in traverse_util.flatten_dict(nn.meta.unbox(abstract_params(config))).items()
    }
    assert dtypes["wte"] == dtypes["lm_head/kernel"] == "float32"  # embedding and head stay float
    assert dtypes["layer_0/attn/q_proj"] == "int8" and dtypes["layer_0/attn/q_proj_scale"] == "float32"


# ------------------------------------------------------------------------------------------------
# Sharding: every layout, and the table


@pytest.mark.parametrize("layout", sorted(partitioning.LAYOUTS))
def test_every_layout_places_the_int8_weights_and_their_scales(layout):
    config = tiny_config(quantize="int8", n_heads=8, vocab_size=256)
    mesh = partitioning.make_mesh(layout)
    targets, _ = convert.param_targets(config, mesh)  # the divisibility check included
    flat = traverse_util.flatten_dict(targets)

    def spec(x):
        return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))

    for path, (lead, n_out) in quantized_kernels(config).items():
        kernel, scale = flat[path], flat[(*path[:-1], path[-1] + "_scale")]
        assert kernel.dtype == jnp.int8
        # the scale is split as its kernel's output dims are, so scaling the output needs no transfer
        assert spec(scale) == spec(kernel)[:lead] + spec(kernel)[kernel.ndim - n_out :]


def test_the_sharding_table_shows_int8_bytes_and_scales():
    config = tiny_config(quantize="int8", n_heads=8)
    table = partitioning.sharding_table(abstract_params(config), partitioning.make_mesh((1, 1, 8)))
    q_line = next(line for line in table.splitlines() if line.startswith("layers/attn/q_proj "))
    assert (
        "int8" in q_line and "(layers, embed, heads, kv)" in q_line and q_line.endswith("1.0 KiB")
    )  # 2·64·1·8 one-byte codes
    scale_line = next(line for line in table.splitlines() if line.startswith("layers/attn/q_proj_scale"))
    assert "(layers, heads, kv)" in scale_line and "float32" in scale_line
    assert "per device (int8 " in table.splitlines()[-1]


# ------------------------------------------------------------------------------------------------
# Memory on the devices


def device_bytes(params, device) -> int:
    return sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards if s.device == device)


def test_parameter_memory_per_device_is_about_half_of_bf16(tmp_path):
    # Shaped like GPT-J-6B in the share that matters: the block projections dwarf embedding and head.
    config = tiny_config(n_layers=2, d_model=256, n_heads=8, vocab_size=256, rotary_dim=8)
    path = save(tmp_path / "ckpt", config, random_params(config))
    mesh = partitioning.make_mesh((1, 1, 8))
    bf16 = gptj_flax.load(path, mesh=mesh, dtype="bf16")
    int8 = gptj_flax.load(path, mesh=mesh, dtype="bf16", quantize="int8")
    device = mesh.devices.flat[0]
    bf16_bytes, int8_bytes = device_bytes(bf16.decoder.params, device), device_bytes(int8.decoder.params, device)
    # what the shapes say a device holds is what it holds
    assert int8_bytes == partitioning.bytes_per_device(abstract_params(int8.decoder.config), mesh)
    print(
        f"\nparameter bytes on one of 8 devices: bf16 {bf16_bytes:,}, int8 {int8_bytes:,} ({int8_bytes / bf16_bytes:.3f}x)"
    )
    assert 0.5 < int8_bytes / bf16_bytes < 0.58  # the float embedding and head are 8% here, 7% in 6B
    six_b = load_config(os.path.join(REPO, "configs", "gptj_6b.json")).model
    bf16_6b = dataclasses.replace(six_b, param_dtype="bfloat16")
    ratio_6b = partitioning.bytes_per_device(
        abstract_params(dataclasses.replace(bf16_6b, quantize="int8")), mesh
    ) / partitioning.bytes_per_device(abstract_params(bf16_6b), mesh)
    print(f"GPT-J-6B, tp8, from shapes: int8 / bf16 = {ratio_6b:.3f}")
    assert 0.5 < ratio_6b < 0.56


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    config = tiny_config(n_layers=2, d_model=64, n_heads=8, vocab_size=320, max_len=64)
    params = random_params(config, seed=3)
    path = save(tmp_path_factory.mktemp("float"), config, params)
    make_tokenizer().save_pretrained(os.path.join(path, "tokenizer"))
    return config, params, path


# ------------------------------------------------------------------------------------------------
# The command line and the refusals


def test_convert_quantize_then_sample_and_the_refusals(float_checkpoint, tmp_path, run_command):
    config, _, path = float_checkpoint

    def run_script(script, *args):
        return run_command(commands.script(script), *args, cwd=REPO)

    out = tmp_path / "int8"
    done = run_script("convert.py", "quantize", path, str(out))
    assert done.status == 0, done.err
    assert "block projections int8" in done.out
    assert json.loads((out / "0" / "config" / "metadata").read_text())["model"]["quantize"] == "int8"
    lm = gptj_flax.load(out)
    assert lm.config.quantize == "int8" and "block projections int8" in repr(lm)
    again = run_script("convert.py", "quantize", str(out), str(tmp_path / "twice"))
    assert again.status != 0 and "already quantised" in again.err and not (tmp_path / "twice").exists()
    for command in ("slim", "to-hf"):
        refused = run_script("convert.py", command, str(out), str(tmp_path / command))
        assert refused.status != 0 and "holds a quantised model" in refused.err, refused.err
    bad = run_script("sample.py", path, "--prompt", "x", "--quantize", "int4")
    assert bad.status == 2 and "invalid choice: 'int4' (choose from 'int8')" in bad.err
    sampled = run_script(
        "sample.py",
        path,
        "--prompt",
        "def",
        "--quantize",
        "int8",
        "--temperature",
        "0",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
    )
    assert sampled.status == 0, sampled.err
    assert "block projections int8" in sampled.err and sampled.out.strip()


def test_bad_quantize_values_are_refused_naming_the_choices(float_checkpoint, tmp_path):
    _, _, path = float_checkpoint
    with pytest.raises(SamplingError, match=r"quantize='int4' is not one of \['int8'\]"):
        gptj_flax.load(path, quantize="int4")
    with pytest.raises(ConfigError, match=r"model.quantize='int4' is not one of \['int8'\]"):
        tiny_config(quantize="int4")
    with pytest.raises(ConversionError, match="already quantised"):
        convert.quantize(convert.quantize(path, tmp_path / "once"), tmp_path / "twice")


def test_training_an_int8_model_needs_lora_and_a_float_source(float_checkpoint, tmp_path):
    config, _, path = float_checkpoint
    int8_dir = convert.quantize(path, tmp_path / "int8")
    run = Config(model=dataclasses.replace(config, quantize="int8"), train=TrainConfig(batch_size=8, train_set="x"))
    with pytest.raises(ConfigError, match="without train.lora: int8 weights take no gradient"):
        train(run, progress=False)
    float_run = Config(model=config, train=TrainConfig(batch_size=8))
    with pytest.raises(ConversionError, match="training needs float weights"):
        convert.load_init_params(str(int8_dir), float_run, partitioning.make_mesh((1, 1, 1)))
