"""Configs: modern and legacy forms, validation messages, the 6B model's size and placement."""

import dataclasses
import json
import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptj_flax import partitioning
from gptj_flax.checkpoint import check_mesh
from gptj_flax.config import (
    LEGACY_KEYS,
    LEGACY_SPECIAL,
    ConfigError,
    MeshConfig,
    ModelConfig,
    apply_overrides,
    dtype_name,
    from_dict,
    load_config,
)
from gptj_flax.model import abstract_params
from gptj_flax.training import TrainSetup, loop

GPTJ_6B_PARAMS = 6_050_882_784


def test_legacy_and_modern_6b_configs_are_the_same(repo_root):
    legacy = load_config(repo_root / "configs/6B_roto_256.json")
    modern = load_config(repo_root / "configs/gptj_6b.json")
    # The legacy keys have no d_ff (the original model's is always 4 · d_model); the modern file spells it out.
    assert legacy.model.d_ff is None and modern.model.d_ff == 16384
    assert dataclasses.replace(legacy.model, d_ff=legacy.model.ff_dim) == modern.model
    assert legacy.replace(model=modern.model) == modern
    m = legacy.model
    assert (m.n_layers, m.d_model, m.n_heads, m.head_dim, m.rotary_dim, m.ff_dim, m.vocab_size, m.max_len) == (
        28,
        4096,
        16,
        256,
        64,
        16384,
        50400,
        2048,
    )
    assert legacy.mesh.model == 8  # cores_per_replica
    assert legacy.train.run_dir == "gs://neo-models/mesh_jax_pile_6B_rotary"
    assert legacy.train.global_batch_size(data_parallel=32) == 32  # per_replica_batch × replicas
    assert legacy.train.grad_accum_steps == 16
    assert dict(legacy.train.val_set) == {"pile": "pile.val.index", "owt": "openwebtext2_new_inputs.val.index"}


def test_every_shipped_config_loads(repo_root):
    for path in sorted((repo_root / "configs").glob("*.json")):
        load_config(path)


@pytest.fixture(scope="module")
def abstract_6b(repo_root):
    cfg = load_config(repo_root / "configs/gptj_6b.json").model
    return cfg, {"params": abstract_params(cfg)}


def test_6b_parameter_count_without_allocating(abstract_6b):
    cfg, abstract = abstract_6b
    leaves = jax.tree.leaves(nn.meta.unbox(abstract))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # shapes only, nothing allocated
    assert sum(x.size for x in leaves) == GPTJ_6B_PARAMS
    assert cfg.param_count() == GPTJ_6B_PARAMS
    assert len(leaves) == 15  # scanned: 10 stacked block tensors + wte, ln_f (2), lm_head (2)


def test_6b_bytes_per_device(abstract_6b):
    cfg, abstract = abstract_6b
    d, f, v, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    # Tensor parallel (1,1,8): everything with a heads/mlp/vocab dim is split 8 ways; LayerNorms
    # and the fc_out bias (d_model only) stay replicated.
    replicated = L * 3 * d + 2 * d
    tp8 = partitioning.bytes_per_device(abstract, partitioning.make_mesh((1, 1, 8)))
    assert tp8 == 4 * ((GPTJ_6B_PARAMS - replicated) // 8 + replicated)
    # FSDP (1,8,1): everything with a d_model dim is split; fc_in and lm_head biases are not.
    replicated = L * f + v
    fsdp8 = partitioning.bytes_per_device(abstract, partitioning.make_mesh((1, 8, 1)))
    assert fsdp8 == 4 * ((GPTJ_6B_PARAMS - replicated) // 8 + replicated)
    table = partitioning.sharding_table(abstract, partitioning.make_mesh((1, 1, 8)))
    assert "6,050,882,784 parameters" in table and "params/layers/attn/q_proj" in table
    print(f"6B float32 params per device: tp8 {tp8 / 2**30:.2f} GiB, fsdp8 {fsdp8 / 2**30:.2f} GiB")


def _model(**changes):
    base = dict(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=128)
    base.update(changes)
    return {"model": base}


@pytest.mark.parametrize(
    "changes, field, hint",
    [
        ({"n_heads": 5}, "model.d_model=64 is not divisible by model.n_heads=5", "choose n_heads"),
        ({"rotary_dim": 7}, "model.rotary_dim=7 must be even", "pairs"),
        ({"rotary_dim": 32}, "model.rotary_dim=32 exceeds the head dimension", "rotary_dim <= 16"),
        ({"n_layers": 0}, "model.n_layers must be a positive integer", "got 0"),
        ({"dtype": "fp8"}, "model.dtype='fp8'", "bfloat16"),
        ({"remat_policy": "sometimes"}, "model.remat_policy='sometimes'", "dots"),
        ({"attention": "flash"}, "model.attention='flash'", "splash"),
        ({"n_layer": 3}, "unknown key model.'n_layer'", "did you mean 'n_layers'"),
    ],
)
def test_bad_model_config_names_the_field(changes, field, hint):
    with pytest.raises(ConfigError) as e:
        from_dict(_model(**changes))
    assert field in str(e.value) and hint in str(e.value)


def test_missing_required_key_is_named():
    with pytest.raises(ConfigError, match="missing required key.*rotary_dim"):
        from_dict({"model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 128}})


def test_unknown_top_level_and_legacy_keys_are_named(repo_root):
    with pytest.raises(ConfigError, match="unknown top-level config key 'modle'.*did you mean 'model'"):
        from_dict({"modle": {}})
    legacy = json.loads((repo_root / "configs/6B_roto_256.json").read_text())
    legacy["pe_rotary_dim"] = 64
    with pytest.raises(ConfigError, match="unknown legacy config key 'pe_rotary_dim'.*'pe_rotary_dims'"):
        from_dict(legacy)
    legacy.pop("pe_rotary_dim")
    legacy["pe"] = "fixed"
    with pytest.raises(ConfigError, match="legacy key 'pe'='fixed'.*rotary"):
        from_dict(legacy)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_dir": None}, "legacy key 'bucket'='neo-models' is set without 'model_dir': .* add 'model_dir'"),
        ({"model_dir": "gs://elsewhere/run"}, "legacy keys 'bucket'='neo-models' and 'model_dir'=.* disagree"),
    ],
)
def test_a_bucket_that_would_be_ignored_is_refused(repo_root, changes, message):
    legacy = json.loads((repo_root / "configs/6B_roto_256.json").read_text())
    legacy = {k: v for k, v in {**legacy, **changes}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        from_dict(legacy)
    assert from_dict({**legacy, "model_dir": "gs://neo-models/run"}).train.run_dir == "gs://neo-models/run"


def test_the_reference_lists_every_legacy_key(repo_root):
    """docs/reference.md's legacy-key table has a row for each key the loader reads."""
    table = (repo_root / "docs/reference.md").read_text().split("## 2. Legacy JSON config keys")[1].split("\n## ")[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    listed = {key for row in rows for key in re.findall(r"`(\w+)`", row)}
    assert set(LEGACY_KEYS) | set(LEGACY_SPECIAL) <= listed, set(LEGACY_KEYS) | set(LEGACY_SPECIAL) - listed


def test_a_tpu_size_other_than_the_run_s_devices_is_named_in_a_warning(repo_root, caplog):
    config = load_config(repo_root / "configs/6B_roto_256.json")
    with caplog.at_level(logging.WARNING, logger="gptj_flax.training"):
        loop._warn_unused_settings(TrainSetup.build(config))  # the 8 test devices; the config says 256
    assert (
        "train.tpu_size=256 (legacy tpu_size) does not size this run: its 8 devices do, and a step trains on "
        "16 sequences (512 on 256 devices)" in caplog.text
    )
    caplog.clear()
    loop._warn_unused_settings(TrainSetup.build(apply_overrides(config, ["train.tpu_size=8"])))
    assert "tpu_size" not in caplog.text


@pytest.mark.parametrize(
    "mesh, message",
    [
        (
            (1, 1, 3),
            "model.n_heads=4 is not divisible by the 'model' mesh axis of size 3 in mesh (data=1, fsdp=1, model=3)",
        ),
        ((1, 1, 8), "model.n_heads=4 is not divisible by the 'model' mesh axis of size 8"),
        ((1, 3, 1), "model.d_model=64 is not divisible by the 'fsdp' mesh axis of size 3"),
    ],
)
def test_mesh_divisibility_names_field_and_mesh(mesh, message):
    cfg = from_dict(_model()).model
    with pytest.raises(ConfigError) as e:
        check_mesh(cfg, partitioning.make_mesh(mesh))
    assert message in str(e.value)
    assert "parameter layers/attn/" in str(e.value)  # the first parameter the rules split that way


def test_vocab_divisibility_suggests_padding():
    cfg = ModelConfig(n_layers=1, d_model=64, n_heads=8, rotary_dim=8, vocab_size=50257)
    with pytest.raises(
        ConfigError, match="vocab_size=50257.*parameter lm_head/bias splits its 'vocab' axis.*pad the vocabulary"
    ):
        check_mesh(cfg, partitioning.make_mesh((1, 1, 8)))


def test_the_divisibility_check_follows_the_rules_table():
    """Rules that split the MLP over fsdp instead of model make d_ff, not n_heads, the constraint there."""
    cfg = ModelConfig(n_layers=1, d_model=64, n_heads=4, rotary_dim=8, vocab_size=128, d_ff=96)
    mesh = partitioning.make_mesh((1, 8, 1))
    check_mesh(cfg, partitioning.make_mesh((1, 4, 2)))  # d_model 64 / 4, n_heads 4 / 2, d_ff 96 / 2, vocab 128 / 2
    rules = tuple(("mlp", "fsdp") if name == "mlp" else (name, axes) for name, axes in partitioning.DEFAULT_RULES)
    with pytest.raises(ConfigError, match="model.d_model=36 .*'fsdp' mesh axis of size 8"):
        check_mesh(dataclasses.replace(cfg, d_model=36, n_heads=4, rotary_dim=8), mesh, rules)
    check_mesh(cfg, mesh, rules)  # d_ff=96 and d_model=64 both divide by 8
    with pytest.raises(
        ConfigError,
        match=r"model.d_ff=100 is not divisible by the 'fsdp' mesh axis of size 8.*"
        r"layers/mlp/fc_in/bias splits its 'mlp' axis",
    ):
        check_mesh(dataclasses.replace(cfg, d_ff=100), mesh, rules)
    check_mesh(dataclasses.replace(cfg, d_ff=100), mesh)  # the default rules put mlp on 'model' (size 1)


def test_data_parallel_size_is_what_the_rules_split_the_batch_over():
    assert partitioning.data_parallel_size(partitioning.make_mesh((2, 2, 2))) == 4
    assert partitioning.data_parallel_size(partitioning.make_mesh((1, 1, 8))) == 1
    rules = tuple(("batch", "data") if name == "batch" else (name, axes) for name, axes in partitioning.DEFAULT_RULES)
    assert partitioning.data_parallel_size(partitioning.make_mesh((2, 4, 1)), rules) == 2


@pytest.mark.parametrize(
    "spelling, canonical",
    [
        ("float32", "float32"),
        ("fp32", "float32"),
        ("F32", "float32"),
        (np.float32, "float32"),
        (jnp.float32, "float32"),
        ("bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        (jnp.bfloat16, "bfloat16"),
        (np.dtype(jnp.bfloat16), "bfloat16"),
        ("float16", "float16"),
        ("fp16", "float16"),
        ("half", "float16"),
        (np.float16, "float16"),
    ],
)
def test_every_dtype_spelling_has_one_name(spelling, canonical):
    assert dtype_name(spelling) == canonical
    assert ModelConfig(n_layers=1, d_model=8, n_heads=1, rotary_dim=2, vocab_size=8, dtype=spelling).dtype == canonical


def test_an_unknown_dtype_names_the_accepted_spellings():
    with pytest.raises(
        ConfigError,
        match=r"model.dtype='float64' is not a supported dtype; use one of float32 "
        r"\(float32/fp32/f32\), bfloat16 \(bfloat16/bf16\), float16",
    ):
        ModelConfig(n_layers=1, d_model=8, n_heads=1, rotary_dim=2, vocab_size=8, dtype="float64")
    with pytest.raises(ConfigError, match="not a supported dtype"):
        dtype_name(np.int8)


def test_mesh_resolution_and_errors():
    assert MeshConfig(2, -1, 2).resolve(8) == (2, 2, 2)
    assert partitioning.mesh_config("1,1,-1").resolve(8) == (1, 1, 8)
    assert partitioning.mesh_config("2x1x4") == partitioning.mesh_config((2, 1, 4)) == MeshConfig(2, 1, 4)
    mesh = partitioning.make_mesh((2, 1, 4))
    assert partitioning.make_mesh(mesh) is mesh
    assert partitioning.mesh_config("fsdp").resolve(8) == (1, 8, 1)
    with pytest.raises(ConfigError, match="does not divide the 8 available"):
        MeshConfig(3, -1, 1).resolve(8)
    with pytest.raises(ConfigError, match="needs 16 devices but only 8"):
        MeshConfig(2, 2, 4).resolve(8)
    with pytest.raises(ConfigError, match="at most one axis may be -1"):
        MeshConfig(-1, -1, 1)
    with pytest.raises(
        ConfigError,
        match="mesh '2,4': expected three sizes; give data,fsdp,model sizes .* or a layout name: dp, fsdp, tp",
    ):
        partitioning.mesh_config("2,4")
    with pytest.raises(ConfigError, match="sizes must be integers"):
        partitioning.mesh_config("a,b,c")


def test_overrides(repo_root):
    cfg = load_config(repo_root / "configs/tiny.json", ["train.lr=3e-4", "model.scan_layers=false", "mesh.model=1"])
    assert cfg.train.lr == 3e-4 and cfg.model.scan_layers is False and cfg.mesh.model == 1
    legacy = load_config(repo_root / "configs/6B_roto_256.json", ["train.batch_size=64"])
    assert legacy.train.global_batch_size(data_parallel=4) == 64
    with pytest.raises(ConfigError, match="unknown key train.'learning_rate'; known keys:.* lr, end_lr"):
        apply_overrides(cfg, ["train.learning_rate=1"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        apply_overrides(cfg, ["train.lr"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        load_config(bad)


def _train_config(**train):
    return {
        "model": dict(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=128, max_len=64),
        "train": {"batch_size": 8, **train},
    }


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("train", "lr", float("nan"), "train.lr must be a finite non-negative number, got nan"),
        ("train", "lr", float("inf"), "train.lr must be a finite non-negative number, got inf"),
        ("train", "weight_decay", float("nan"), "train.weight_decay must be a finite"),
        ("train", "z_loss", float("inf"), "train.z_loss must be a finite"),
        ("train", "end_lr", float("-inf"), "train.end_lr must be a finite"),
        ("model", "layer_norm_eps", float("nan"), "model.layer_norm_eps must be a finite positive number"),
        ("train", "lr", True, "train.lr must be a finite non-negative number, got True"),
        ("train", "total_steps", True, "train.total_steps must be a positive integer, got True"),
        ("train", "batch_size", True, "train.batch_size must be a positive integer or null, got True"),
        ("train", "warmup_steps", False, "train.warmup_steps must be a non-negative integer, got False"),
        ("model", "n_layers", True, "model.n_layers must be a positive integer, got True"),
        ("train", "freeze", "wte", "train.freeze must be a list of strings, got the string 'wte': write [\"wte\"]"),
        ("train", "eval_harness_tasks", "lambada", "train.eval_harness_tasks must be a list of strings"),
        ("train", "freeze", ["wte", 3], "train.freeze must be a list of non-empty strings, got ['wte', 3]"),
        ("train", "run_dir", 3, "train.run_dir must be a non-empty string, got 3"),
        ("train", "run_dir", ["runs/a"], "train.run_dir must be a non-empty string"),
        ("train", "train_set", 7, "train.train_set must be a non-empty string or null, got 7"),
        ("train", "tokenizer", {"dir": "x"}, "train.tokenizer must be a non-empty string or null"),
        ("train", "seed", 1.5, "train.seed must be an integer in [0, 2**32), got 1.5"),
        ("train", "seed", "1", "train.seed must be an integer in [0, 2**32), got '1'"),
        ("train", "seed", 2**32, "train.seed must be an integer in [0, 2**32)"),
        ("train", "val_set", {"pile": 3}, "train.val_set.pile must be a non-empty string, got 3"),
        ("train", "seq_len", 128, "train.seq_len=128 exceeds model.max_len=64"),
        ("model", "dtype", ["bfloat16"], "model.dtype=['bfloat16'] is not a supported dtype"),
        ("train", "adam_mu_dtype", {}, "train.adam_mu_dtype={} is not a supported dtype"),
    ],
)
def test_values_that_used_to_pass_validation_are_refused_by_name(section, key, value, message):
    raw = _train_config()
    raw[section][key] = value
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "literal, shown", [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf"), ("1e309", "inf")]
)
def test_json_non_finite_literals_are_refused_by_field(tmp_path, literal, shown):
    path = tmp_path / "c.json"
    path.write_text(
        '{"model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "rotary_dim": 8, "vocab_size": 128},\n'
        f' "train": {{"batch_size": 8, "lr": {literal}}}}}'
    )
    with pytest.raises(ConfigError, match=rf"c.json: train.lr must be a finite non-negative number, got {shown}"):
        load_config(path)


def test_overrides_get_the_same_validation(repo_root):
    tiny = repo_root / "configs/tiny.json"
    for override, message in [
        ("train.lr=NaN", "train.lr must be a finite non-negative number, got nan"),
        ("train.lr=nan", "train.lr must be a finite non-negative number, got 'nan'"),
        ("train.lr=true", "got True"),
        ("train.freeze=wte", "train.freeze must be a list of strings, got the string 'wte'"),
        ("train.seed=-1", "train.seed must be an integer in [0, 2**32), got -1"),
        ("train.seq_len=65", "train.seq_len=65 exceeds model.max_len=64"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(tiny, [override])
        assert message in str(e.value), override
    assert load_config(tiny, ['train.freeze=["wte"]']).train.freeze == ("wte",)


def test_comment_lines_are_accepted_and_a_trailing_comment_is_named_by_line(tmp_path, repo_root):
    body = (repo_root / "configs/tiny.json").read_text().splitlines()
    commented = tmp_path / "commented.json"
    commented.write_text("\n".join(["// a tiny model", "# for tests", body[0], "  // the model", *body[1:]]))
    assert load_config(commented) == load_config(repo_root / "configs/tiny.json")
    trailing = tmp_path / "trailing.json"
    trailing.write_text('{"model": {"n_layers": 2, // two\n "d_model": 64}}')
    with pytest.raises(ConfigError) as e:
        load_config(trailing)
    assert "trailing.json: not valid JSON at line 1, column 27" in str(e.value)
    assert "comments are allowed only on lines of their own" in str(e.value)
    assert '\'{"model": {"n_layers": 2, // two\'' in str(e.value)
