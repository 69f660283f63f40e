"""Checkpoint integrity and damaged checkpoints: every chunk is checksummed, every read verifies it,
and a damaged, incomplete or mismatched step is refused in one line naming it.

The checkpoints here are written by the project itself (``Checkpointer`` and the converters) and
damaged the way disks and crashes damage them: bytes flipped inside a chunk file, a JSON item
truncated or missing, a disk that fills up in the middle of an async save.
"""

import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from etils import epath

import gptj_flax
from benchmarks.common import write_random_hf
from gptj_flax import checkpoint, convert, partitioning
from gptj_flax.checkpoint import CheckpointCorrupted, CheckpointDiskFull, Checkpointer, CheckpointError
from gptj_flax.config import Config, TrainConfig
from gptj_flax.convert import from_hf
from gptj_flax.model import GPTJ
from tests import commands
from tests.commands import QUICK_COMPILE
from tests.helpers import tiny_config
from tests.test_sampling_api import make_tokenizer

CFG = tiny_config(n_layers=2, d_model=32, n_heads=4, rotary_dim=4, vocab_size=64, max_len=32)
CONFIG = Config(model=CFG, train=TrainConfig(batch_size=2))


@functools.cache
def _random_params(seed: int, model=CFG):
    params = nn.meta.unbox(GPTJ(model).init(jax.random.key(seed), jnp.zeros((1, 1), jnp.int32)))["params"]
    return jax.tree.map(lambda x: x + 0.01 * seed, params)


def _sharded_state(seed: int, mesh):
    """Params and Adam state of CFG, sharded over ``mesh`` as training shards them."""
    target, _ = convert.param_targets(CONFIG.model, mesh)
    params = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), _random_params(seed), target)
    opt_state = optax.adam(1e-3).init(params)
    moments = np.random.default_rng(seed)
    opt_state = jax.tree.map(  # moments that are not all zero (noise: chunks that do not compress away)
        lambda x: x + jnp.asarray(moments.random(x.shape), x.dtype) if x.ndim else x, opt_state
    )
    return params, opt_state


def _targets(mesh, opt_state):
    params_target, _ = convert.param_targets(CONFIG.model, mesh)
    opt_target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), opt_state)
    return params_target, opt_target


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """Steps 1 and 2 (params and optimiser state) saved by the Checkpointer from a (2, 2, 2) mesh."""
    run = tmp_path_factory.mktemp("base") / "run"
    mesh = partitioning.make_mesh((2, 2, 2))
    states = {step: _sharded_state(step, mesh) for step in (1, 2)}
    ckpt = Checkpointer(run)
    for step, (params, opt_state) in states.items():
        ckpt.save(step, params=params, opt_state=opt_state, config=CONFIG)
    ckpt.close()
    return run, {step: jax.tree.map(np.asarray, s) for step, s in states.items()}


@pytest.fixture
def run(base_run, tmp_path):
    shutil.copytree(base_run[0], tmp_path / "run")
    return tmp_path / "run"


def flip_bytes_in_a_chunk(item_dir, n=64) -> str:
    """Flip ``n`` bytes in the middle of the largest chunk data file of an Orbax array item."""
    files = [p for p in item_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    for i in range(n):
        data[middle + i] ^= 0xFF
    target.write_bytes(bytes(data))
    return str(target)


def flip_bytes_throughout(item_dir, stride=256) -> None:
    """Flip one byte in every ``stride`` of every chunk data file under ``item_dir``.

    A process's data may be flushed into several files, some holding mostly its own B-tree nodes,
    which the merged checkpoint no longer reads: damage in one spot of one file may miss every chunk.
    """
    for path in item_dir.rglob("*"):
        if path.is_file() and path.parent.name == "d":
            data = bytearray(path.read_bytes())
            for i in range(stride // 2, len(data), stride):
                data[i] ^= 0xFF
            path.write_bytes(bytes(data))


def stored_codecs(item_dir) -> dict[str, list[str]]:
    """Each array's inner chunk codecs, read from the zarr.json entries of the item's OCDBT database."""
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item_dir}"}).result()
    codecs = {}
    for key in store.list().result():
        if key.endswith(b"zarr.json"):
            meta = json.loads(store.read(key).result().value)
            (sharding,) = meta["codecs"]
            codecs[key.decode().removesuffix("/zarr.json")] = [c["name"] for c in sharding["configuration"]["codecs"]]
    return codecs


def test_every_chunk_is_stored_with_a_crc32c_checksum(run, tmp_path):
    n_params = len(jax.tree.leaves(_random_params(0)))
    for item, n_arrays in (("params", n_params), ("opt_state", 1 + 2 * n_params)):  # Adam: count, mu, nu
        codecs = stored_codecs(run / "2" / item)
        assert len(codecs) == n_arrays
        assert all(names[-1] == "crc32c" for names in codecs.values()), codecs
    assert Checkpointer(run, read_only=True).has_checksums(2)

    # The converters' streamed writer too.
    write_random_hf(tmp_path / "hf", CFG)
    from_hf(tmp_path / "hf", tmp_path / "ours", tokenizer=False)
    codecs = stored_codecs(tmp_path / "ours" / "0" / "params")
    assert codecs and all(names == ["bytes", "crc32c"] for names in codecs.values()), codecs
    assert Checkpointer(tmp_path / "ours", read_only=True).has_checksums(0)


def test_a_corrupted_params_chunk_is_refused_by_load_naming_the_step_and_the_previous_one(run, base_run):
    flip_bytes_in_a_chunk(run / "2" / "params")
    with pytest.raises(CheckpointCorrupted) as caught:
        gptj_flax.load(run)
    error = caught.value
    assert (error.step, error.item, error.previous_step) == (2, "params", 1)
    message = str(error)
    assert "\n" not in message
    assert f"checkpoint step 2 in {run} is corrupted: the stored data of array " in message
    assert " of its params is damaged (" in message and f"load {run / '1'} (or step=1) instead" in message

    # The previous step loads, by path or by step=, and holds exactly what was saved.
    assert gptj_flax.load(run / "1").step == gptj_flax.load(run, step=1).step == 1
    _, params, _ = convert.load_params(run, partitioning.make_mesh((1, 1, 1)), step=1)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), base_run[1][1][0])


def test_a_truncated_params_file_is_refused_as_corrupted_by_load_and_by_init_from(run):
    """A data file cut short (a crash mid-copy, a full disk) names the step, as damaged bytes do, whether
    the step is loaded or read tensor by tensor as a base to train from (QLoRA quantises as it reads)."""
    files = [p for p in (run / "2" / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    target = max(files, key=lambda p: p.stat().st_size)
    os.truncate(target, 100)
    with pytest.raises(CheckpointCorrupted, match=f"checkpoint step 2 in {run} is corrupted"):
        gptj_flax.load(run)
    config = checkpoint.Checkpointer(run, read_only=True).read_config(1)
    qlora = config.replace(model=dataclasses.replace(config.model, quantize="int8"))
    with pytest.raises(CheckpointCorrupted, match=f"checkpoint step 2 in {run} is corrupted"):
        convert.load_init_params(str(run / "2"), qlora, partitioning.make_mesh((1, 1, 1)))


def test_a_corrupted_optimiser_state_chunk_is_refused(tmp_path):
    # Saved unsharded, so each moment is one chunk larger than OCDBT keeps inline in its b-tree:
    # the flipped bytes land in chunk data, not in a node.
    mesh = partitioning.make_mesh((1, 1, 1))
    ckpt = Checkpointer(tmp_path / "run")
    for step in (1, 2):
        params, opt_state = _sharded_state(step, mesh)
        ckpt.save(step, params=params, opt_state=opt_state, config=CONFIG)
    ckpt.close()
    flip_bytes_in_a_chunk(tmp_path / "run" / "2" / "opt_state")

    other = partitioning.make_mesh((1, 2, 4))  # restored onto another mesh: verification does not depend on it
    params_target, opt_target = _targets(other, _sharded_state(0, other)[1])
    ckpt = Checkpointer(tmp_path / "run", read_only=True)
    with pytest.raises(
        CheckpointCorrupted,
        match=r"step 2 .* is corrupted: the stored data of array 0/(mu|nu)/\S+ "
        r"of its opt_state is damaged",
    ) as caught:
        ckpt.restore(params_target=params_target, opt_state_target=opt_target)
    assert (caught.value.item, caught.value.previous_step) == ("opt_state", 1)
    restored = ckpt.restore(1, params_target=params_target, opt_state_target=opt_target)
    ckpt.close()
    assert restored.step == 1
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.tree.map(np.asarray, restored.opt_state),
        jax.tree.map(np.asarray, _sharded_state(1, mesh)[1]),
    )


def test_to_hf_on_a_corrupted_checkpoint_is_one_error_line(run, tmp_path, repo_root, run_command):
    flip_bytes_in_a_chunk(run / "2" / "params")
    result = run_command(commands.script("convert.py"), "to-hf", run, tmp_path / "hf", cwd=repo_root)
    assert result.status == 1
    lines = [line for line in result.err.splitlines() if line.strip() and "writing safetensors" not in line]
    assert len(lines) == 1 and "Traceback" not in result.err, result.err  # progress bars aside
    assert lines[0].startswith(f"error: checkpoint step 2 in {run} is corrupted: the stored data of array ")
    assert lines[0].endswith(f"The previous step is 1: load {run / '1'} (or step=1) instead.")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob("hf.tmp-*"))


def test_checkpoints_written_before_checksums_still_load_with_one_notice(tmp_path, caplog):
    """A step as the previous version wrote it: Orbax's default zarr v2 arrays, no checksums, no marker."""
    params = _random_params(3)
    manager = ocp.CheckpointManager(epath.Path(tmp_path / "old"), item_names=("params", "meta", "config"))
    manager.save(
        7,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            meta=ocp.args.JsonSave({"step": 7}),
            config=ocp.args.JsonSave(CONFIG.to_dict()),
        ),
    )
    manager.wait_until_finished()
    manager.close()
    assert (tmp_path / "old" / "7" / "params" / "_METADATA").exists()
    assert not json.loads((tmp_path / "old" / "7" / "params" / "_METADATA").read_text()).get("use_zarr3")

    with caplog.at_level(logging.WARNING, logger="gptj_flax.checkpoint"):
        assert gptj_flax.load(tmp_path / "old").step == 7
        _, loaded, _ = convert.load_params(tmp_path / "old", partitioning.make_mesh((2, 2, 2)))
    notices = [r for r in caplog.records if "written without chunk checksums" in r.getMessage()]
    assert len(notices) == 1 and str(tmp_path / "old" / "7") in notices[0].getMessage()
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded), jax.tree.map(np.asarray, params))
    assert not Checkpointer(tmp_path / "old", read_only=True).has_checksums(7)


def test_a_damaged_or_missing_json_item_is_one_error_naming_the_file(run, capfd):
    (run / "2" / "config" / "metadata").write_text('{"model": {"n_layers": ')
    with pytest.raises(CheckpointError) as caught:
        gptj_flax.load(run)
    message = str(caught.value)
    assert message.startswith(f"{run / '2' / 'config' / 'metadata'} is not valid JSON (")
    assert "step 2 is damaged; use another step (available: [1, 2])" in message and "\n" not in message
    assert "Event loop is closed" not in capfd.readouterr().err

    shutil.rmtree(run / "1" / "meta")
    with pytest.raises(CheckpointError, match=rf"^{run / '1' / 'meta'} is missing: step 1 is incomplete"):
        gptj_flax.load(run, step=1)


def test_a_changed_shape_names_the_parameter_and_both_shapes(run, capfd):
    wider = Config(model=tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=4, vocab_size=64, max_len=32))
    mesh = partitioning.make_mesh((1, 1, 1))
    target, _ = convert.param_targets(wider.model, mesh)
    ckpt = Checkpointer(run, read_only=True)
    with pytest.raises(CheckpointError) as caught:
        ckpt.restore(params_target=target)
    ckpt.close()
    message = str(caught.value)
    assert "\n" not in message
    found = re.fullmatch(
        rf"{run}/2: params (\S+) was saved with shape \((.*)\) but the model being restored "
        r"expects \((.*)\) \(the model config differs from the one this checkpoint was trained with\)",
        message,
    )
    assert found, message
    path = tuple(found.group(1).split("/"))
    saved = ocp.tree.to_flat_dict(convert.param_targets(CONFIG.model, mesh)[0])[path].shape
    assert (found.group(2), found.group(3)) == (str(saved)[1:-1], str(ocp.tree.to_flat_dict(target)[path].shape)[1:-1])
    assert saved != ocp.tree.to_flat_dict(target)[path].shape
    assert "Event loop is closed" not in capfd.readouterr().err


def test_relative_paths_load_from_any_directory(run, tmp_path, monkeypatch):
    make_tokenizer().save_pretrained(run / "tokenizer")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for path in ("../run", "../run/1"):
        loaded = gptj_flax.load(path)
        assert loaded.tokenizer is not None and loaded.step == (1 if path.endswith("1") else 2)


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB tmpfs (needs root and a kernel that lets us mount one)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_disk_during_an_async_save_is_one_error_and_keeps_the_previous_steps(small_disk, caplog):
    mesh = partitioning.make_mesh((2, 2, 2))
    params, _ = _sharded_state(1, mesh)
    run = small_disk / "run"
    ckpt = Checkpointer(run, keep_last=2)  # async saves, as training does
    ckpt.save(1, params=params, config=CONFIG)
    ckpt.wait()
    ckpt.save(2, params=params, config=CONFIG)
    ckpt.wait()
    # Fill the disk but for a few KB, less than one step needs.
    with open(small_disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(small_disk / "filler", os.path.getsize(small_disk / "filler") - 16384)

    with caplog.at_level(logging.WARNING):
        ckpt.save(3, params=params, config=CONFIG)
        with pytest.raises(CheckpointDiskFull) as caught:
            ckpt.wait()
        ckpt.close()  # the failure was reported: closing does not raise it again
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"no space left on the device writing checkpoint step 3 into {run} (")
    assert re.search(
        r" \((\d+ B|\d+\.\d KB) free there\): the step was not saved; step 2 stays the latest "
        r"complete checkpoint\. Free some space",
        message,
    ), message
    assert caught.value.step == 3 and caught.value.free_bytes < 20000
    assert not [r for r in caplog.records if "No space left" in r.getMessage() or r.exc_info]  # no tracebacks

    os.remove(small_disk / "filler")
    again = Checkpointer(run, read_only=True)
    assert again.all_steps() == [1, 2]
    target, _ = convert.param_targets(CONFIG.model, mesh)
    restored = again.restore(params_target=target)
    again.close()
    jax.tree.map(
        np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.params), jax.tree.map(np.asarray, params)
    )
    # Space freed, the run goes on: its first save clears the half-written step.
    resumed = Checkpointer(run, keep_last=2)
    resumed.save(3, params=params, config=CONFIG)
    resumed.close()
    assert sorted(os.listdir(run)) == ["2", "3"]


MULTI_PROCESS_SAVE = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")
jax.distributed.initialize(f"127.0.0.1:{sys.argv[2]}", 2, int(sys.argv[1]))
import numpy as np
from gptj_flax import checkpoint, convert, partitioning
from gptj_flax.config import Config
from tests.helpers import tiny_config
config = Config(model=tiny_config(**{k: int(v) for k, v in (kv.split("=") for kv in sys.argv[4].split(","))}))
mesh = partitioning.make_mesh((2, 2, 2))
target, _ = convert.param_targets(config.model, mesh)
def values(t):  # the same on every process: noise seeded by the shape alone
    return np.random.default_rng(list(t.shape)).random(t.shape, dtype=np.float32)
params = jax.tree.map(lambda t: jax.make_array_from_callback(t.shape, t.sharding, lambda i: values(t)[i]), target)
ckpt = checkpoint.Checkpointer(sys.argv[3])
ckpt.save(4, params=params, config=config)
ckpt.close()
"""


def test_a_two_process_save_is_checksummed_by_each_process_and_verified_on_one(tmp_path, repo_root):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": QUICK_COMPILE, "PYTHONPATH": str(repo_root)}
    model = ",".join(
        f"{k}={getattr(CFG, k)}" for k in ("n_layers", "d_model", "n_heads", "rotary_dim", "vocab_size", "max_len")
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MULTI_PROCESS_SAVE, str(pid), str(port), str(tmp_path / "run"), model],
            cwd=repo_root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]
    for proc in procs:
        out = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, out[-3000:]
    params_dir = tmp_path / "run" / "4" / "params"
    assert {p.name for p in params_dir.glob("ocdbt.process_*")} == {"ocdbt.process_0", "ocdbt.process_1"}
    codecs = stored_codecs(params_dir)
    assert codecs and all(names[-1] == "crc32c" for names in codecs.values())

    _, params, _ = convert.load_params(tmp_path / "run", partitioning.make_mesh((1, 4, 2)))
    for leaf in jax.tree.leaves(params):  # what both processes wrote, read back on another mesh
        np.testing.assert_array_equal(
            np.asarray(leaf), np.random.default_rng(list(leaf.shape)).random(leaf.shape, dtype=np.float32)
        )
    flip_bytes_throughout(params_dir / "ocdbt.process_1")  # chunks only process 1 wrote
    with pytest.raises(CheckpointCorrupted, match=r"checkpoint step 4 .* is corrupted"):
        convert.load_params(tmp_path / "run", partitioning.make_mesh((1, 4, 2)))


def test_a_tree_mismatch_names_the_arrays_on_each_side(run):
    # Orbax's own message lists them on the lines after "tree structures do not match:", which a one-line error dropped
    unrolled, _ = convert.param_targets(dataclasses.replace(CFG, scan_layers=False), partitioning.make_mesh((1, 1, 1)))
    ckpt = Checkpointer(run, read_only=True)
    with pytest.raises(CheckpointError) as caught:
        ckpt.restore_item(2, "params", unrolled)
    ckpt.close()
    assert str(caught.value) == (
        f"{run}/2/params does not match the model being restored: expected but not stored: layer_0/attn/k_proj, "
        "layer_0/attn/out_proj, layer_0/attn/q_proj and 17 more; stored but not expected: layers/attn/k_proj, "
        "layers/attn/out_proj, layers/attn/q_proj and 7 more; one holds the layers stacked, the other one by one: "
        "model.scan_layers differs"
    )


def test_an_optimiser_state_of_another_optimiser_names_what_differs(run):
    mesh = partitioning.make_mesh((1, 1, 1))
    params, _ = convert.param_targets(CFG, mesh)
    clipped = jax.eval_shape(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)).init, params)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), clipped)
    with pytest.raises(convert.ConversionError) as caught:
        convert.load_init_opt_state(str(run), CONFIG, mesh, target)
    message = str(caught.value)
    assert "expected but not stored: 1/0/count, 1/0/mu/layers/attn/k_proj" in message, message
    assert "stored but not expected: 0/count, 0/mu/layers/attn/k_proj" in message, message
