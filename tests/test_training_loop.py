"""The training loop end to end: learning, exact resume, preemption, interrupted saves, multi-host."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from gptj_flax import checkpoint, convert, partitioning
from gptj_flax.config import load_config
from gptj_flax.training import TrainingDiverged, train
from tests import commands
from tests.commands import QUICK_COMPILE
from tests.training_helpers import make_config, write_config

WORKER = os.path.join(os.path.dirname(__file__), "workers", "train_worker.py")


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_corpus()


def params_of(run_dir, mesh_shape):
    _, params, step = convert.load_params(run_dir, partitioning.make_mesh(mesh_shape))
    return step, jax.tree.map(np.asarray, params)


def test_loss_falls_and_resume_is_exact(corpus, tmp_path):
    straight = train(make_config(corpus, tmp_path / "straight"), progress=False)
    assert straight.step == 20
    losses = [straight.losses[s] for s in sorted(straight.losses)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    assert straight.val[20]["loss_stdlib"] < straight.val[0]["loss_stdlib"] - 0.5
    for name in ("metrics.jsonl", "loss.png", "tokenizer"):
        assert (tmp_path / "straight" / name).exists()
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "straight" / "tensorboard"))

    first = train(make_config(corpus, tmp_path / "resumed"), stop_after=10, progress=False)
    assert first.step == 10 and checkpoint.Checkpointer(tmp_path / "resumed", read_only=True).latest_step() == 10
    second = train(make_config(corpus, tmp_path / "resumed"), progress=False)  # a fresh call: resumes at 10
    assert second.step == 20 and min(second.losses) == 11
    resumed = {**first.losses, **second.losses}
    for step in range(1, 21):
        assert abs(resumed[step] - straight.losses[step]) <= 1e-6, step
    _, a = params_of(tmp_path / "straight", (1, 1, 1))
    _, b = params_of(tmp_path / "resumed", (1, 1, 1))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_restore_on_other_meshes_is_bit_identical(corpus, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="gptj_flax.training.loop"):
        train(make_config(corpus, tmp_path / "run", total_steps=3), progress=False)
    assert "attention: xla: model.attention=auto on cpu" in caplog.text  # the log names the backend compiled
    _, ref = params_of(tmp_path / "run", (2, 2, 2))
    for shape in [(1, 1, 8), (8, 1, 1), (1, 4, 2), (1, 1, 1)]:
        step, other = params_of(tmp_path / "run", shape)
        assert step == 3
        for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(other), strict=True):
            np.testing.assert_array_equal(x, y)
    # and training continues on another mesh from the same state
    result = train(
        make_config(corpus, tmp_path / "run", total_steps=5), mesh=partitioning.make_mesh((1, 1, 8)), progress=False
    )
    assert result.step == 5


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    run = tmp_path / "nan"
    train(make_config(corpus, run, total_steps=4, ckpt_every=2), progress=False)
    # step 5 runs on finite weights (its loss is fine); its update with lr=1e30 breaks step 6
    with pytest.raises(TrainingDiverged, match=r"loss became (nan|inf) at step 6.*last checkpoint saved \(step 4\)"):
        train(make_config(corpus, run, total_steps=8, lr=1e30, end_lr=1e30, warmup_steps=0), progress=False)
    assert checkpoint.Checkpointer(run, read_only=True).latest_step() == 4


@pytest.mark.slow  # a reference run and a trainer process stopped by SIGTERM, then resumed
def test_sigterm_saves_exits_zero_and_resumes_with_the_same_losses(corpus, tmp_path, repo_root, run_command):
    steps = 60
    reference = train(
        make_config(corpus, tmp_path / "ref", total_steps=steps, val_set={}, ckpt_every=1000), progress=False
    )
    run = tmp_path / "preempted"
    cfg = write_config(make_config(corpus, run, total_steps=steps, val_set={}, ckpt_every=1000), tmp_path / "c.json")
    cmd = [sys.executable, "scripts/train.py", "--config", cfg, "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    stopped = checkpoint.Checkpointer(run, read_only=True).latest_step()
    assert 5 <= stopped < steps and f"step {stopped}: preempted, saved" in out

    rerun = run_command(commands.script("train.py"), *cmd[2:], cwd=repo_root)  # the same command, in this process
    assert rerun.status == 0, rerun.out[-2000:] + rerun.err[-2000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert sorted(losses) == list(range(1, steps + 1))  # every step once: nothing lost, nothing repeated
    for step in range(1, steps + 1):
        assert abs(losses[step] - reference.losses[step]) <= 1e-6, step


def test_a_save_killed_midway_leaves_the_previous_checkpoint_latest(corpus, tmp_path, repo_root):
    run = tmp_path / "killed"
    train(make_config(corpus, run, total_steps=2, ckpt_every=2), progress=False)
    # A process that starts saving step 3 and dies (SIGKILL) before the save is committed.
    script = f"""
import os, signal, jax
jax.config.update("jax_num_cpu_devices", 8)
from gptj_flax import checkpoint, convert, partitioning
config, params, _ = convert.load_params({str(run)!r}, partitioning.make_mesh((2, 2, 2)))
ckpt = checkpoint.Checkpointer({str(run)!r})
ckpt.save(3, params=params, config=config, force=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    killed = subprocess.run([sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    leftovers = [p for p in os.listdir(run) if "tmp" in p]
    assert checkpoint.Checkpointer(run, read_only=True).latest_step() == 2, (os.listdir(run), leftovers)
    result = train(make_config(corpus, run, total_steps=4, ckpt_every=2), progress=False)
    assert result.step == 4 and min(result.losses) == 3
    assert not [p for p in os.listdir(run) if "tmp" in p]  # the half-written save was cleaned up


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(config_path, out_path, n_proc, local_devices, mesh, stop_after, repo_root):
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": QUICK_COMPILE, "PYTHONPATH": str(repo_root)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                config_path,
                out_path,
                str(n_proc),
                str(pid),
                str(port),
                str(local_devices),
                mesh,
                str(stop_after),
            ],
            cwd=repo_root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(n_proc)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    with open(out_path) as f:
        return json.load(f)


@pytest.mark.slow  # two JAX training processes joined by a coordinator, and a reference
def test_two_processes_match_one_and_their_checkpoint_restores_elsewhere(corpus, tmp_path, repo_root):
    overrides = dict(total_steps=8, ckpt_every=5, val_set={})
    single_cfg = write_config(make_config(corpus, tmp_path / "single", **overrides), tmp_path / "single.json")
    multi_cfg = write_config(make_config(corpus, tmp_path / "multi", **overrides), tmp_path / "multi.json")

    # One process (this one, 8 devices as the worker would have) is the reference.
    single = train(load_config(single_cfg), mesh=partitioning.make_mesh("2,2,2"), stop_after=8, progress=False)
    multi = _run_workers(multi_cfg, str(tmp_path / "multi.out"), 2, 4, "2,2,2", 5, repo_root)
    assert multi["step"] == 5
    for step in range(1, 6):
        assert abs(multi["losses"][str(step)] - single.losses[step]) <= 1e-6, step

    # The 2-process checkpoint (step 5) continues in 1 process on a different mesh with the same losses.
    resumed = train(load_config(multi_cfg), mesh=partitioning.make_mesh("1,4,2"), stop_after=3, progress=False)
    assert resumed.step == 8
    for step in range(6, 9):
        assert abs(resumed.losses[step] - single.losses[step]) <= 1e-5, step
