"""Stopping a trainer: Ctrl-C saves (a second one quits at once), SIGTERM to one process of a
multi-process run stops every process at the same step, and a crash's repeated steps are not
recorded twice."""

import json
import logging
import re
import signal
import subprocess
import sys
import time

import pytest

from gptj_flax import checkpoint
from gptj_flax.training import train
from gptj_flax.training.lock import LOCK_NAME
from gptj_flax.training.metrics import MetricsWriter, drop_records_from
from tests.multihost_helpers import free_port, log_of, start_processes
from tests.training_helpers import make_config, start_trainer, train_losses, wait_for, write_config

STEPS = 40


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_corpus(max_bytes=200_000)


def _config(corpus, run_dir, ckpt_every=1000):
    return make_config(corpus, run_dir, total_steps=STEPS, val_set={}, ckpt_every=ckpt_every)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Training losses of an uninterrupted run (they do not depend on how often it saves)."""
    return train(_config(corpus, tmp_path_factory.mktemp("reference") / "run"), progress=False).losses


def _assert_each_step_once_with_the_reference_losses(run, reference):
    rows = train_losses(run)
    assert [step for step, _ in rows] == list(range(1, STEPS + 1))
    for step, loss in rows:
        assert abs(loss - reference[step]) <= 1e-6, step


def test_records_past_the_resumed_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "train/loss": 1.0 / s} for s in range(1, 8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "train/lo')  # torn by a crash
    assert drop_records_from(str(path), 6) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    writer = MetricsWriter(str(tmp_path), drop_from_step=3)
    writer.write(3, {"train/loss": 0.5})
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.slow  # a trainer process stopped by SIGINT mid-run, then resumed
def test_ctrl_c_saves_the_current_step_exits_130_and_resumes_with_the_same_losses(corpus, reference, tmp_path):
    run, log = tmp_path / "run", tmp_path / "train.log"
    proc = start_trainer(write_config(_config(corpus, run), tmp_path / "c.json"), log)
    wait_for(lambda: len(train_losses(run)) >= 5, proc, log, what="five steps")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 130, log.read_text()[-3000:]
    out = log.read_text()
    stopped = checkpoint.Checkpointer(run, read_only=True).latest_step()
    assert stopped is not None and 5 <= stopped < STEPS, out[-3000:]
    assert f"step {stopped}: interrupted, saved in {run}" in out and "Traceback" not in out
    assert [step for step, _ in train_losses(run)] == list(range(1, stopped + 1))  # saved where it stopped

    resumed = train(_config(corpus, run), progress=False)
    assert min(resumed.losses) == stopped + 1
    _assert_each_step_once_with_the_reference_losses(run, reference)


# The trainer's handler, in a process of its own that takes a first Ctrl-C and then works on for a
# minute (a save that takes long): the second Ctrl-C must end it at once. A real trainer on a tiny
# model saves in milliseconds, too fast to send the second one in the middle of it.
SECOND_CTRL_C = """
import os, signal, sys, time
from gptj_flax.training.loop import _StopRequests
with _StopRequests() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    while not stop.requested:
        time.sleep(0.01)
    print("saving", flush=True)
    time.sleep(60)
sys.exit(130)
"""


def test_a_second_ctrl_c_quits_at_once(tmp_path, repo_root):
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", SECOND_CTRL_C], cwd=repo_root, stdout=out, stderr=subprocess.STDOUT
        )
    wait_for(lambda: "saving" in log.read_text(), proc, log, what="the first Ctrl-C")
    assert "press Ctrl-C again to quit at once without saving" in log.read_text()
    second = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == -signal.SIGINT, log.read_text()[-3000:]  # killed, not the graceful 130
    assert time.monotonic() - second < 5


@pytest.mark.slow  # a trainer process killed by SIGKILL after a checkpoint, then resumed
def test_after_a_crash_and_a_resume_metrics_hold_each_step_once(corpus, reference, tmp_path, caplog):
    run, log = tmp_path / "run", tmp_path / "train.log"
    proc = start_trainer(write_config(_config(corpus, run, ckpt_every=10), tmp_path / "c.json"), log)
    wait_for(lambda: (run / "10").is_dir() and len(train_losses(run)) >= 13, proc, log, what="step 13")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    latest = checkpoint.Checkpointer(run, read_only=True).latest_step()
    recorded = [step for step, _ in train_losses(run)]
    assert latest is not None and max(recorded) > latest  # steps past the checkpoint, which will run again
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == proc.pid  # the dead trainer's lock is left

    with caplog.at_level(logging.WARNING):
        resumed = train(_config(corpus, run, ckpt_every=10), progress=False)
    assert min(resumed.losses) == latest + 1
    assert f"taking over the stale lock of pid {proc.pid}" in caplog.text
    _assert_each_step_once_with_the_reference_losses(run, reference)


@pytest.mark.slow  # two processes start JAX, compile and train (about a minute on 2 cores)
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(corpus, tmp_path, repo_root):
    """Each process used to decide alone: the one signalled went into its save while the other
    waited in the next step's collectives, and both hung."""
    run = tmp_path / "run"
    config = write_config(make_config(corpus, run, total_steps=500, val_set={}, ckpt_every=1000), tmp_path / "c.json")
    port = free_port()
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"}
    procs = start_processes(
        lambda pid: ["scripts/train.py", "--config", config, "--no-progress"],
        2,
        repo_root,
        tmp_path,
        env_of=lambda pid: {**env, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid)},
    )
    try:
        wait_for(lambda: len(train_losses(run)) >= 3, procs[0], tmp_path / "process_0.log", what="three steps")
        procs[1].send_signal(signal.SIGTERM)  # process 1 only: process 0 writes the metrics
        codes = [p.wait(timeout=240) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [log_of(tmp_path, pid) for pid in range(2)]
    hung = "" if codes is not None else "the processes were still running 240 s after the SIGTERM (hung)\n"
    assert codes == [0, 0], hung + "\n\n".join(f"process {pid}:\n{log[-3000:]}" for pid, log in enumerate(logs))
    stopped = [re.findall(r"step (\d+): preempted, saved", log) for log in logs]
    assert stopped[0] == stopped[1] and len(stopped[0]) == 1, stopped
    step = int(stopped[0][0])
    assert checkpoint.Checkpointer(run, read_only=True).latest_step() == step
    assert [s for s, _ in train_losses(run)] == list(range(1, step + 1))
    assert "another process of this run was asked to stop" in logs[0] and "SIGTERM received" in logs[1]
