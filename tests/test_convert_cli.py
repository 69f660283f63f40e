"""``scripts/convert.py`` as a user runs it: relative paths from any directory, one ``error:`` line,
and no ``OUT`` or ``OUT.tmp-*`` left behind by a failure or Ctrl-C; tokenizers checked on import."""

import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks.common import write_random_hf
from gptj_flax import checkpoint, convert, partitioning
from gptj_flax.convert import ConversionError, config_for_legacy, from_hf, from_legacy, safetensors_io
from gptj_flax.training import make_optimizer
from tests import commands
from tests.helpers import tiny_config
from tests.legacy_writer import dense_model, dense_moments, legacy_config_dict, write_legacy_checkpoint
from tests.test_sampling_api import make_tokenizer

CFG = tiny_config(n_layers=3, d_model=32, n_heads=4, rotary_dim=4, vocab_size=64)


def _convert(run_command, *args, cwd):
    return run_command(commands.script("convert.py"), *args, cwd=cwd)


def _leftovers(directory, name):
    return [p for p in os.listdir(directory) if p == name or p.startswith(f"{name}.tmp-")]


def _full_legacy(directory):
    model = dense_model(CFG, 0)
    write_legacy_checkpoint(
        directory / "step_5",
        model,
        CFG,
        shards=2,
        step=5,
        moments=(dense_moments(model, 1), dense_moments(model, 2)),
        adam_count=5,
    )
    (directory / "legacy.json").write_text(json.dumps(legacy_config_dict(CFG, 2)))
    return directory / "step_5", directory / "legacy.json"


def test_every_subcommand_takes_paths_relative_to_where_it_is_run(tmp_path, run_command):
    write_random_hf(tmp_path / "hf", CFG)
    _full_legacy(tmp_path)
    commands = [
        ("from-hf", "hf", "ours", "--no-tokenizer"),
        ("to-hf", "ours", "back"),
        ("slim", "ours/0", "slimmed"),
        ("from-legacy", "step_5", "from_legacy", "--config", "legacy.json", "--with-opt-state"),
    ]
    for command in commands:
        result = _convert(run_command, *command, cwd=tmp_path)  # not the repository: the paths are tmp_path's
        assert result.status == 0, result.err[-3000:]
        assert f"wrote {tmp_path / command[2]}" in result.out

    original, exported = (safetensors_io.read_header(tmp_path / d / "model.safetensors") for d in ("hf", "back"))
    assert original.keys() == exported.keys()
    for name in original:
        np.testing.assert_array_equal(
            safetensors_io.read_tensor(original[name]), safetensors_io.read_tensor(exported[name])
        )
    mesh = partitioning.make_mesh((1, 1, 1))
    assert convert.load_params(tmp_path / "slimmed", mesh)[2] == 0
    ckpt = checkpoint.Checkpointer(tmp_path / "from_legacy", read_only=True)
    assert ckpt.all_steps() == [5] and ckpt.has_opt_state(5) and ckpt.has_checksums(5)
    ckpt.close()


def test_a_conversion_failing_half_way_leaves_no_temporary_directory(tmp_path):
    """The optimiser-state writer fails on a damaged piece while the params writer is still writing."""
    step_dir, config_path = _full_legacy(tmp_path)
    piece = max((step_dir / "shard_1").glob("*.npz"), key=lambda p: p.stat().st_size)
    data = bytearray(piece.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 10] = b"\xff" * 10  # inside an array; the zip directory stays readable
    piece.write_bytes(bytes(data))
    config, shards = config_for_legacy(config_path)
    for _ in range(3):  # the writers race: before, a leftover showed in most runs
        with pytest.raises(ConversionError, match=rf"{piece} arr_\d+ .*unreadable"):
            from_legacy(step_dir, tmp_path / "out", config, shards, opt_init=make_optimizer(config.train).init)
        time.sleep(0.5)  # anything still writing would show now
        assert not _leftovers(tmp_path, "out")


# SIGINT is first handled as Python does by default: a suite run in the background of a
# non-interactive shell hands its processes SIGINT ignored, and the signal below would be lost.
# gptj-convert in a process that sends itself Ctrl-C's signal as the writer takes up its fifth tensor:
# mid-write every time. (Sending it from here once found data files on disk raced the conversion,
# which once ran to its end first.)
CTRL_C_MID_WRITE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's shell starts it
from gptj_flax.cli.convert import main
from gptj_flax.convert.layout import StreamedArray
materialize, taken = StreamedArray.materialize, []
def interrupting(self):
    taken.append(self.name)
    if len(taken) == 5:
        os.kill(os.getpid(), signal.SIGINT)
    return materialize(self)
StreamedArray.materialize = interrupting
sys.argv = ["gptj-convert", "from-hf", "hf", "out", "--no-tokenizer"]
sys.exit(main())
"""


def test_ctrl_c_during_a_conversion_leaves_nothing_behind(tmp_path, repo_root):
    write_random_hf(tmp_path / "hf", tiny_config(n_layers=4, d_model=256, vocab_size=4096))  # 15 tensors to write
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_MID_WRITE],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 130, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip() and "params:" not in line]  # progress bars aside
    assert lines == ["error: interrupted"], done.stderr[-3000:]
    time.sleep(0.5)
    assert not _leftovers(tmp_path, "out")


def test_from_hf_checks_the_tokenizer_it_carries(tmp_path, caplog, run_command):
    write_random_hf(tmp_path / "hf", CFG)
    with caplog.at_level(logging.WARNING, logger="gptj_flax.convert.hf"):
        from_hf(tmp_path / "hf", tmp_path / "weights_only")
    warnings = [r.getMessage() for r in caplog.records if "has no tokenizer files" in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path / "hf") in warnings[0] and "--no-tokenizer" in warnings[0]
    assert checkpoint.tokenizer_dir(tmp_path / "weights_only") is None

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gptj_flax.convert.hf"):
        from_hf(tmp_path / "hf", tmp_path / "said_so", tokenizer=False)
    assert not caplog.records and checkpoint.tokenizer_dir(tmp_path / "said_so") is None

    make_tokenizer().save_pretrained(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "with_tokenizer")
    carried = checkpoint.tokenizer_dir(tmp_path / "with_tokenizer")
    assert (carried / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()

    (tmp_path / "hf" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    refused = (
        rf"^{tmp_path / 'hf'}: its tokenizer files \(tokenizer\.json, .*\) do not load as a tokenizer "
        r"\(.*\); fix or remove them, or pass --no-tokenizer"
    )
    with pytest.raises(ConversionError, match=refused):
        from_hf(tmp_path / "hf", tmp_path / "garbage")
    assert not _leftovers(tmp_path, "garbage")
    result = _convert(run_command, "from-hf", "hf", "garbage", cwd=tmp_path)
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert result.status == 1 and len(lines) == 1, result.err[-3000:]
    assert lines[0].startswith(f"error: {tmp_path / 'hf'}: its tokenizer files (")
    assert not _leftovers(tmp_path, "garbage")
    result = _convert(run_command, "from-hf", "hf", "garbage", "--no-tokenizer", cwd=tmp_path)
    assert result.status == 0, result.err[-2000:]
    assert checkpoint.tokenizer_dir(tmp_path / "garbage") is None
