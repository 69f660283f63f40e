"""Bad inputs give an error naming the file, and leave no output directory behind (not even a temporary one)."""

import json
import os

import jax.numpy as jnp
import pytest

from benchmarks.common import write_random_hf
from gptj_flax import checkpoint, partitioning
from gptj_flax.config import Config
from gptj_flax.convert import ConversionError, config_for_legacy, from_hf, from_legacy, load_init_params, to_hf
from tests.helpers import tiny_config
from tests.legacy_writer import dense_model, legacy_config_dict, write_legacy_checkpoint

CFG = tiny_config(n_layers=3, d_model=32, n_heads=4, rotary_dim=4, vocab_size=64)


def _assert_no_output(tmp_path, name="out"):
    assert not (tmp_path / name).exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(f"{name}.tmp-")]


@pytest.fixture
def legacy(tmp_path):
    """A 4-shard slim legacy checkpoint of CFG and its legacy config file."""
    write_legacy_checkpoint(tmp_path / "step_5", dense_model(CFG, 0), CFG, shards=4, step=5, dtype=jnp.bfloat16)
    path = tmp_path / "legacy.json"
    path.write_text(json.dumps(legacy_config_dict(CFG, 4)))
    return tmp_path / "step_5", path


def _convert_legacy(step_dir, config_path, out):
    config, shards = config_for_legacy(config_path)
    return from_legacy(step_dir, out, config, shards)


def test_wrong_shard_count(tmp_path, legacy):
    step_dir, _ = legacy
    wrong = tmp_path / "eight.json"
    wrong.write_text(json.dumps(legacy_config_dict(CFG, 8)))
    with pytest.raises(
        ConversionError, match=rf"{step_dir}: has 4 shard directories but the config's cores_per_replica is 8"
    ):
        _convert_legacy(step_dir, wrong, tmp_path / "out")
    _assert_no_output(tmp_path)

    (step_dir / "shard_2").rename(tmp_path / "moved")  # a gap in the shard directories
    with pytest.raises(ConversionError, match=rf"{step_dir / 'shard_2'}: missing"):
        _convert_legacy(step_dir, legacy[1], tmp_path / "out")
    _assert_no_output(tmp_path)


def test_missing_piece(tmp_path, legacy):
    step_dir, config_path = legacy
    (step_dir / "shard_1" / "7.npz").unlink()
    with pytest.raises(ConversionError, match=rf"{step_dir / 'shard_1' / '7.npz'}: missing"):
        _convert_legacy(step_dir, config_path, tmp_path / "out")
    _assert_no_output(tmp_path)


def test_shapes_that_disagree_with_the_config(tmp_path, legacy):
    step_dir, _ = legacy
    wider = tmp_path / "wider.json"
    wider.write_text(json.dumps({**legacy_config_dict(CFG, 4), "d_model": 64}))
    with pytest.raises(
        ConversionError, match=r"shard_0/0\.npz arr_0 \(params/.*embedding.*\): shape \(32,\).*expects \(64,\)"
    ):
        _convert_legacy(step_dir, wider, tmp_path / "out")
    deeper = tmp_path / "deeper.json"
    deeper.write_text(json.dumps({**legacy_config_dict(CFG, 4), "layers": 4}))
    with pytest.raises(ConversionError, match=r"shard_0: holds 37 arrays, but a 4-layer GPT-J checkpoint holds 47"):
        _convert_legacy(step_dir, deeper, tmp_path / "out")
    _assert_no_output(tmp_path)


def test_truncated_npz(tmp_path, legacy):
    step_dir, config_path = legacy
    piece = step_dir / "shard_3" / "2.npz"
    piece.write_bytes(piece.read_bytes()[: piece.stat().st_size // 2])
    with pytest.raises(ConversionError, match=rf"{piece}: not a readable \.npz \(truncated or corrupt\)"):
        _convert_legacy(step_dir, config_path, tmp_path / "out")
    _assert_no_output(tmp_path)


def test_corrupt_data_found_mid_write_leaves_nothing(tmp_path, legacy):
    """Damage only discoverable while streaming (a CRC failure inside a member) after writing began."""
    step_dir, config_path = legacy
    piece = step_dir / "shard_2" / "15.npz"
    data = bytearray(piece.read_bytes())
    data[200:210] = b"\xff" * 10  # inside the first member's array data; the zip directory stays intact
    piece.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match=rf"{piece} arr_0 .*unreadable"):
        _convert_legacy(step_dir, config_path, tmp_path / "out")
    _assert_no_output(tmp_path)


def test_non_gptj_hf_directory(tmp_path):
    write_random_hf(tmp_path / "hf", CFG)
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    with pytest.raises(ConversionError, match=rf"{tmp_path / 'hf' / 'config.json'}: model_type is 'gpt2', not 'gptj'"):
        from_hf(tmp_path / "hf", tmp_path / "out")
    _assert_no_output(tmp_path)
    with pytest.raises(ConversionError, match=r"config\.json not found"):
        from_hf(tmp_path, tmp_path / "out")
    _assert_no_output(tmp_path)


def test_truncated_safetensors_and_mismatched_hf_shapes(tmp_path):
    write_random_hf(tmp_path / "hf", CFG)
    weights = tmp_path / "hf" / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:-100])
    with pytest.raises(ConversionError, match=rf"{weights}: truncated: tensor 'lm_head.bias' ends at byte"):
        from_hf(tmp_path / "hf", tmp_path / "out")
    _assert_no_output(tmp_path)

    weights.write_bytes(intact)
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**raw, "n_inner": 64}))
    with pytest.raises(
        ConversionError, match=rf"{weights}: tensor 'transformer.h.0.mlp.fc_in.weight' has shape \(128, 32\)"
    ):
        from_hf(tmp_path / "hf", tmp_path / "out")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**raw, "n_layer": 2}))
    with pytest.raises(ConversionError, match=rf"{weights}: unexpected tensor\(s\) for a 2-layer GPT-J"):
        from_hf(tmp_path / "hf", tmp_path / "out")
    _assert_no_output(tmp_path)


def test_existing_output_is_refused_and_kept(tmp_path):
    write_random_hf(tmp_path / "hf", CFG)
    from_hf(tmp_path / "hf", tmp_path / "ours")
    (tmp_path / "back").mkdir()
    (tmp_path / "back" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists"):
        to_hf(tmp_path / "ours", tmp_path / "back")
    assert (tmp_path / "back" / "keep.txt").read_text() == "mine"


def test_init_from_a_source_that_does_not_fit_the_config(tmp_path):
    write_random_hf(tmp_path / "hf", CFG)
    from_hf(tmp_path / "hf", tmp_path / "ours")
    other = Config(model=tiny_config(n_layers=3, d_model=32, n_heads=4, rotary_dim=4, vocab_size=128))
    mesh = partitioning.make_mesh((1, 1, 1))
    for spec, where in ((f"hf:{tmp_path / 'hf'}", "config.json"), (str(tmp_path / "ours"), str(tmp_path / "ours"))):
        with pytest.raises(ConversionError, match=rf"{where} does not fit the model config: vocab_size: 64 there, 128"):
            load_init_params(spec, other, mesh)
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint directory not found"):
        load_init_params(str(tmp_path / "nowhere"), Config(model=CFG), mesh)
