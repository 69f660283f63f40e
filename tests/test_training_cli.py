"""The command lines: one `error:` line for every bad input, meshes that start with -1, honest summaries."""

import importlib.util
import json
import logging
import os
import subprocess
import sys

import jax
import pytest

from gptj_flax import checkpoint, partitioning
from gptj_flax.cli.args import cli_path, join_negative_values
from gptj_flax.config import ConfigError
from gptj_flax.training import train
from tests import commands
from tests.training_helpers import REPO, make_config, write_config


def run_script(script, *args, cwd=REPO, env=None):
    """Run scripts/SCRIPT with ``args`` in a process of its own; returns (status, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stdout, done.stderr


def one_error_line(status, stderr) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert status == 1 and len(errors) == 1 and "Traceback" not in stderr, (status, stderr[-3000:])
    return errors[0]


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_corpus(max_bytes=100_000)


def test_mesh_values_starting_with_minus_one_reach_the_parser():
    assert join_negative_values(["--mesh", "-1,8,1", "--set", "x=1"]) == ["--mesh=-1,8,1", "--set", "x=1"]
    assert join_negative_values(["--mesh=-1,-1,1"]) == ["--mesh=-1,-1,1"]
    assert join_negative_values(["--mesh", "--debug"]) == ["--mesh", "--debug"]  # no value: argparse says so


def test_cli_paths_are_absolute_and_keep_their_prefixes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_path("runs/a") == str(tmp_path / "runs/a")
    assert cli_path("hf:models/gptj") == f"hf:{tmp_path}/models/gptj"
    assert cli_path("legacy:ckpt") == f"legacy:{tmp_path}/ckpt"
    assert cli_path("gs://bucket/run") == "gs://bucket/run"
    assert cli_path("tfds:wikitext@test") == "tfds:wikitext@test"


@pytest.mark.parametrize(
    "script, args",
    [
        ("train.py", ["--config", "{tiny}"]),
        ("demo.py", ["--config", "{tiny}"]),
        ("aot_check.py", ["--config", "{tiny}", "--topology", "v3:2x2"]),
        ("sample.py", ["missing_run", "--prompt", "hi"]),
        ("eval.py", ["perplexity", "--checkpoint", "missing_run", "--data", "x.txt"]),
    ],
)
def test_every_cli_takes_a_mesh_starting_with_minus_one(script, args, repo_root, tmp_path, run_command):
    args = [a.format(tiny=repo_root / "configs/tiny.json") for a in args]
    ran = run_command(commands.script(script), *args, "--mesh", "-1,-1,1", cwd=tmp_path)
    assert "expected one argument" not in ran.err
    line = one_error_line(ran.status, ran.err)
    if script in ("train.py", "demo.py"):  # those build the mesh before anything else can fail
        assert "at most one axis may be -1" in line


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("train.py", ["--config", "nope.json"], "config file not found: {cwd}/nope.json"),
        ("demo.py", ["--config", "nope.json"], "config file not found: {cwd}/nope.json"),
        ("aot_check.py", ["--config", "nope.json", "--topology", "v3:2x2"], "config file not found: {cwd}/nope.json"),
        ("sample.py", ["missing_run", "--prompt", "hi"], "checkpoint directory not found: {cwd}/missing_run"),
        (
            "eval.py",
            ["perplexity", "--checkpoint", "missing_run", "--data", "x.txt"],
            "checkpoint directory not found: {cwd}/missing_run",
        ),
        ("eval.py", ["compare", "a.json", "b.json"], "{cwd}/a.json"),
        ("bench.py", ["data", "--config", "nope.json"], "config file not found: {cwd}/nope.json"),
    ],
)
def test_bad_inputs_give_one_error_line_with_absolute_paths(script, args, message, tmp_path, run_command):
    ran = run_command(commands.script(script), *args, cwd=tmp_path)
    assert message.format(cwd=tmp_path) in one_error_line(ran.status, ran.err)


def test_debug_shows_the_traceback(tmp_path, run_command):
    ran = run_command(commands.script("sample.py"), "missing_run", "--prompt", "hi", "--debug", cwd=tmp_path)
    assert ran.status != 0 and "Traceback" in ran.err and "CheckpointError" in ran.err


def test_a_config_needing_more_devices_than_the_cpu_has_says_how_to_get_them(repo_root):
    # configs/tiny.json as shipped, on a plain CPU process (one device)
    status, _, stderr = run_script(
        "train.py",
        "--config",
        repo_root / "configs/tiny.json",
        env={"XLA_FLAGS": None, "JAX_NUM_CPU_DEVICES": None, "JAX_PLATFORMS": "cpu"},
    )
    line = one_error_line(status, stderr)
    assert "needs 8 devices but only 1 are available" in line
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in line


def test_a_mesh_using_some_devices_warns_with_the_count(caplog):
    with caplog.at_level(logging.WARNING):
        mesh = partitioning.make_mesh("3,1,1")
    assert mesh.devices.size == 3
    assert "mesh (3, 1, 1) uses 3 of the 8 devices; the other 5 stay idle" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        partitioning.make_mesh((1, 1, 1))  # one device: the sampling default, deliberate
        partitioning.make_mesh("2,-1,2")
    assert "stay idle" not in caplog.text
    with pytest.raises(ConfigError, match="xla_force_host_platform_device_count=8"):
        partitioning.make_mesh((2, 2, 2), devices=jax.devices()[:2])


def test_batch_and_freeze_errors_name_their_field(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"train.batch_size=6 is not divisible by the 4 data-parallel shards"):
        train(make_config(corpus, tmp_path / "a", batch_size=6), progress=False)
    with pytest.raises(ConfigError, match=r"train.freeze patterns \['encoder/\*'\] match no parameter"):
        train(make_config(corpus, tmp_path / "c", freeze=["encoder/*"]), progress=False)


def _train_main(monkeypatch, *argv):
    spec = importlib.util.spec_from_file_location("train_script", REPO / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["train.py", *map(str, argv)])
    return module.main()


def test_stop_after_zero_says_nothing_was_saved(corpus, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    cfg = write_config(make_config(corpus, run, val_set={}), tmp_path / "c.json")
    assert _train_main(monkeypatch, "--config", cfg, "--stop-after", "0", "--no-progress", "--mesh", "-1,8,1") == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"step 0: no training step ran, nothing saved in {run}"
    assert checkpoint.Checkpointer(run, read_only=True).latest_step() is None
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if "train/loss" in r]
