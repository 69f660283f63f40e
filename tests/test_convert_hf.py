"""HuggingFace ⇄ Orbax conversion: bit-exact round trips, logits equal to HF PyTorch's, any mesh."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import GPTJForCausalLM

from benchmarks.common import write_random_hf
from gptj_flax import checkpoint, convert, partitioning
from gptj_flax.config import Config
from gptj_flax.convert import from_hf, load_init_params, safetensors_io, slim, to_hf
from gptj_flax.convert.hf import HFCheckpoint
from gptj_flax.convert.orbax_io import OrbaxParams
from gptj_flax.model import GPTJ, unstack_layers
from tests import commands
from tests.helpers import hf_model, hf_state_numpy, params_matching, tiny_config

# (n_layers, d_model, n_heads, rotary_dim, vocab): rotary below and at head_dim, odd depth and vocab.
SHAPES = [(1, 32, 2, 4, 48), (3, 64, 4, 16, 128), (5, 96, 6, 8, 100), (12, 32, 8, 2, 64)]
TOKENIZER = {"vocab.json": '{"a": 0}', "merges.txt": "#version: 0.2\n", "tokenizer_config.json": "{}"}


def _logits(params, model_config, tokens):
    cfg = dataclasses.replace(model_config, dtype="float32")
    return np.asarray(GPTJ(cfg).apply({"params": params}, jnp.asarray(tokens)))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def _save_hf(model, directory, **kwargs):
    model.save_pretrained(directory, **kwargs)
    for name, text in TOKENIZER.items():
        (directory / name).write_text(text)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}_d{}_h{}_r{}_v{}".format(*s))
def test_hf_round_trip_is_bit_exact_and_logits_match(tmp_path, shape):
    n_layers, d_model, n_heads, rotary_dim, vocab = shape
    cfg = tiny_config(n_layers=n_layers, d_model=d_model, n_heads=n_heads, rotary_dim=rotary_dim, vocab_size=vocab)
    hf = hf_model(cfg, seed=n_layers)
    _save_hf(hf, tmp_path / "hf")

    from_hf(tmp_path / "hf", tmp_path / "ours")
    config, params, step = convert.load_params(tmp_path / "ours", partitioning.make_mesh((2, 2, 2)))
    assert step == 0 and config.model.n_layers == n_layers and config.model.ff_dim == 4 * d_model
    tokens = np.random.default_rng(0).integers(0, vocab, size=(2, 13))
    np.testing.assert_allclose(_logits(params, config.model, tokens), _hf_logits(hf, tokens), rtol=0, atol=1e-4)
    for name, text in TOKENIZER.items():
        assert (tmp_path / "ours" / "tokenizer" / name).read_text() == text

    to_hf(tmp_path / "ours", tmp_path / "back")
    back, info = GPTJForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    original, exported = hf.state_dict(), back.state_dict()
    assert original.keys() == exported.keys()
    for name in original:
        assert torch.equal(original[name], exported[name]), name
    for name, text in TOKENIZER.items():
        assert (tmp_path / "back" / name).read_text() == text


def test_sharded_safetensors_in_and_out(tmp_path):
    cfg = tiny_config(n_layers=3)
    hf = hf_model(cfg, seed=7)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / safetensors_io.INDEX_FILE).exists()

    from_hf(tmp_path / "hf", tmp_path / "ours", scan_layers=False)
    config, params, _ = convert.load_params(tmp_path / "ours", partitioning.make_mesh((1, 1, 1)))
    assert "layer_2" in params and not config.model.scan_layers
    np.testing.assert_array_equal(
        params["layer_1"]["mlp"]["fc_in"]["kernel"], hf_state_numpy(hf)["transformer.h.1.mlp.fc_in.weight"].T
    )

    to_hf(tmp_path / "ours", tmp_path / "back", max_shard_size="150KB")
    index = json.loads((tmp_path / "back" / safetensors_io.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in hf.state_dict().values())
    for file in files:  # every shard within the limit unless one tensor alone exceeds it
        infos = safetensors_io.read_header(tmp_path / "back" / file)
        assert sum(i.nbytes for i in infos.values()) <= 150_000 or len(infos) == 1
    back = GPTJForCausalLM.from_pretrained(tmp_path / "back")
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, back.state_dict()[name]), name


def test_pytorch_bin_and_half_precision_sources(tmp_path):
    cfg = tiny_config(n_layers=2)
    hf = hf_model(cfg, seed=11)
    (tmp_path / "bin").mkdir()
    hf.config.save_pretrained(tmp_path / "bin")
    state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    halves = {
        "pytorch_model-00001-of-00002.bin": dict(list(state.items())[:10]),
        "pytorch_model-00002-of-00002.bin": dict(list(state.items())[10:]),
    }
    for name, part in halves.items():
        torch.save(part, tmp_path / "bin" / name)
    weight_map = {k: name for name, part in halves.items() for k in part}
    (tmp_path / "bin" / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    from_hf(tmp_path / "bin", tmp_path / "ours")
    _, params, _ = convert.load_params(tmp_path / "ours", partitioning.make_mesh((1, 1, 1)))
    expected = params_matching(hf.to(torch.bfloat16).float(), cfg)["params"]
    np.testing.assert_array_equal(params["lm_head"]["kernel"], expected["lm_head"]["kernel"])
    np.testing.assert_array_equal(params["layers"]["attn"]["k_proj"], expected["layers"]["attn"]["k_proj"])


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_export_in_half_precision(tmp_path, dtype, torch_dtype):
    cfg = tiny_config()
    hf = hf_model(cfg, seed=5)
    hf.save_pretrained(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "ours")
    to_hf(tmp_path / "ours", tmp_path / "back", dtype=dtype)
    back = GPTJForCausalLM.from_pretrained(tmp_path / "back", dtype=torch_dtype)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == str(torch_dtype).split(".")[1]
    for name, tensor in hf.state_dict().items():
        exported = back.state_dict()[name]
        assert exported.dtype == torch_dtype
        assert torch.equal(tensor.to(torch_dtype), exported), name


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A random HF model, its directory, and its Orbax conversion (scanned)."""
    cfg = tiny_config(n_layers=3, d_model=64, n_heads=8, vocab_size=64)
    hf = hf_model(cfg, seed=2)
    root = tmp_path_factory.mktemp("src")
    hf.save_pretrained(root / "hf")
    from_hf(root / "hf", root / "ours", scan_layers=True)
    return cfg, hf, root


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 2, 2), (1, 8, 1), (1, 1, 8)])
@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_init_params_land_on_any_mesh_in_either_layout(converted, mesh_shape, scan):
    cfg, hf, root = converted
    config = Config(model=dataclasses.replace(cfg, scan_layers=scan))
    mesh = partitioning.make_mesh(mesh_shape)
    target, _ = convert.param_targets(config.model, mesh)
    expected = params_matching(hf, config.model)["params"]
    for spec in (f"hf:{root / 'hf'}", str(root / "ours")):
        params = load_init_params(spec, config, mesh)
        assert jax.tree.structure(params) == jax.tree.structure(expected)
        for leaf, want, value in zip(jax.tree.leaves(params), jax.tree.leaves(target), jax.tree.leaves(expected)):
            assert leaf.shape == want.shape and leaf.dtype == want.dtype and leaf.sharding == want.sharding
            np.testing.assert_array_equal(np.asarray(leaf), value)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_init_params_logits_match_huggingface(converted, scan):
    cfg, hf, root = converted
    config = Config(model=dataclasses.replace(cfg, scan_layers=scan))
    params = load_init_params(str(root / "ours"), config, partitioning.make_mesh((2, 2, 2)))
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(2, 9))
    np.testing.assert_allclose(_logits(params, config.model, tokens), _hf_logits(hf, tokens), rtol=0, atol=1e-4)


def test_slim_keeps_step_drops_nothing_else_and_rounds(tmp_path):
    cfg = tiny_config(n_layers=2)
    hf = hf_model(cfg, seed=9)
    _save_hf(hf, tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "ours")
    slim(tmp_path / "ours", tmp_path / "slim", dtype="bf16")

    assert set(OrbaxParams.open(tmp_path / "slim").stored_dtypes().values()) == {np.dtype(jnp.bfloat16)}
    ckpt = checkpoint.Checkpointer(tmp_path / "slim", read_only=True)
    assert ckpt.all_steps() == [0] and not ckpt.has_opt_state()
    ckpt.close()
    _, params, _ = convert.load_params(tmp_path / "slim", partitioning.make_mesh((1, 1, 1)))
    full = params_matching(hf, cfg)["params"]
    np.testing.assert_array_equal(
        unstack_layers(params)["layer_1"]["attn"]["out_proj"],
        unstack_layers(full)["layer_1"]["attn"]["out_proj"].astype(jnp.bfloat16).astype(np.float32),
    )
    assert (tmp_path / "slim" / "tokenizer" / "vocab.json").exists()

    to_hf(tmp_path / "slim", tmp_path / "back")  # a slim checkpoint exports like any other
    back = GPTJForCausalLM.from_pretrained(tmp_path / "back")
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor.to(torch.bfloat16).float(), back.state_dict()[name]), name


@pytest.mark.slow  # two conversions of a model through the command line and a refused third
def test_cli_round_trip_and_error_exit(tmp_path, run_command):
    cfg = tiny_config(n_layers=2)
    write_random_hf(tmp_path / "hf", cfg, seed=1)

    def run(*args):
        return run_command(commands.script("convert.py"), *args)

    done = run("from-hf", tmp_path / "hf", tmp_path / "ours")
    assert done.status == 0, done.err
    done = run("to-hf", tmp_path / "ours", tmp_path / "back", "--dtype", "fp32", "--max-shard-size", "50KB")
    assert done.status == 0, done.err
    for name, info in safetensors_io.read_header(tmp_path / "hf" / "model.safetensors").items():
        index = json.loads((tmp_path / "back" / safetensors_io.INDEX_FILE).read_text())["weight_map"]
        back = safetensors_io.read_header(tmp_path / "back" / index[name])[name]
        np.testing.assert_array_equal(safetensors_io.read_tensor(info), safetensors_io.read_tensor(back))

    failed = run("to-hf", tmp_path / "ours", tmp_path / "back")  # OUT exists: refused, untouched
    assert failed.status != 0 and "already exists" in failed.err


@pytest.mark.parametrize(
    "torch_dtype, declared, expected",
    [
        (torch.float32, "dtype", "float32"),
        (torch.bfloat16, "dtype", "bfloat16"),
        (torch.float16, "torch_dtype", "float16"),  # transformers 4 wrote torch_dtype
        (torch.bfloat16, None, "bfloat16"),  # no declaration: the tensors' own dtype
    ],
)
def test_an_hf_import_computes_in_the_stored_precision(tmp_path, torch_dtype, declared, expected):
    cfg = tiny_config(n_layers=1)
    hf_model(cfg).to(torch_dtype).save_pretrained(tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json"
    raw = json.loads(config_path.read_text())
    stored = raw.pop("dtype", None) or raw.pop("torch_dtype", None)
    assert stored == str(torch_dtype).removeprefix("torch.")
    if declared:
        raw[declared] = stored
    config_path.write_text(json.dumps(raw))
    source = HFCheckpoint.open(tmp_path / "hf")
    assert (source.stored_dtype, source.model_config.dtype, source.model_config.param_dtype) == (
        expected,
        expected,
        "float32",
    )
    assert HFCheckpoint.open(tmp_path / "hf", dtype="fp32").model_config.dtype == "float32"  # asked otherwise

    from_hf(tmp_path / "hf", tmp_path / "ours", tokenizer=False)
    assert OrbaxParams.open(tmp_path / "ours").config.model.dtype == expected


def test_convert_cli_takes_either_dtype_spelling_and_prints_the_canonical_one(tmp_path, run_command):
    cfg = tiny_config(n_layers=1)
    hf_model(cfg).save_pretrained(tmp_path / "hf")

    def run(*args):
        return run_command(commands.script("convert.py"), *args)

    done = run("from-hf", tmp_path / "hf", tmp_path / "bf16", "--no-tokenizer", "--dtype", "bf16")
    assert done.status == 0, done.err
    assert done.out.strip() == f"wrote {tmp_path / 'bf16'}: parameters float32, compute bfloat16"
    assert OrbaxParams.open(tmp_path / "bf16").config.model.dtype == "bfloat16"
    done = run("from-hf", tmp_path / "hf", tmp_path / "default", "--no-tokenizer")
    assert done.out.strip().endswith("compute float32")
    done = run("slim", tmp_path / "default", tmp_path / "slim", "--dtype", "half")
    assert done.status == 0 and done.out.strip().endswith("parameters float16"), done.err
    bad = run("from-hf", tmp_path / "hf", tmp_path / "bad", "--no-tokenizer", "--dtype", "fp64")
    assert bad.status == 2 and "argument --dtype: 'fp64' is not a supported dtype; use one of float32" in bad.err
    assert not (tmp_path / "bad").exists()
