"""One trainer per run directory: a second one is refused by name, a dead one's lock is taken over."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys

import pytest

from gptj_flax import checkpoint
from gptj_flax.errors import LAUNCHED_ENV
from gptj_flax.training import RunDirLocked
from gptj_flax.training.lock import LOCK_NAME, RunDirLock
from tests import commands
from tests.training_helpers import REPO, make_config, start_trainer, train_losses, wait_for, write_config

HOST = socket.gethostname()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_lock_is_refused_naming_the_holder_and_released_on_exit(tmp_path):
    with RunDirLock(tmp_path / "run") as held:
        info = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert info["host"] == HOST and info["pid"] == os.getpid() and info["started"]
        with pytest.raises(RunDirLocked) as refused:
            RunDirLock(tmp_path / "run").acquire()
        message = str(refused.value)
        assert f"pid {os.getpid()} on host {HOST}" in message and held.path in message
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    with RunDirLock(tmp_path / "run"):  # free again
        pass


def test_a_stale_lock_of_a_dead_pid_on_this_host_is_taken_over_with_a_notice(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    pid = _dead_pid()
    (run / LOCK_NAME).write_text(json.dumps({"host": HOST, "pid": pid, "started": "2020-01-01T00:00:00+00:00"}))
    with caplog.at_level(logging.WARNING), RunDirLock(run):
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"taking over the stale lock of pid {pid} on host {HOST}" in caplog.text


def test_a_lock_left_by_another_host_is_not_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(json.dumps({"host": "tpu-vm-7", "pid": 4242, "started": "2020-01-01T00:00:00+00:00"}))
    with pytest.raises(RunDirLocked, match=r"pid 4242 on host tpu-vm-7.*cannot tell whether.*delete .*train.lock"):
        RunDirLock(run).acquire()


def test_on_an_object_store_a_live_holder_is_refused_and_a_dead_one_replaced(tmp_path, caplog):
    # The gs:// code path, run against a local directory (the logic is the same; GCS needs the network).
    def object_store_lock():
        lock = RunDirLock(tmp_path)
        lock.is_url = True
        return lock

    first = object_store_lock()
    first.acquire()
    with pytest.raises(RunDirLocked, match=f"pid {os.getpid()} on host {HOST}"):
        object_store_lock().acquire()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    pid = _dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": HOST, "pid": pid, "started": "x"}))
    with caplog.at_level(logging.WARNING):
        object_store_lock().acquire()
    assert f"taking over the stale lock of pid {pid}" in caplog.text
    assert "which has no locks" in caplog.text


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_corpus(max_bytes=200_000)


def _refused(run_command, config_path, holder_pid):
    """Run a second scripts/train.py (in this process: the holder is a process of its own) and check
    it is refused with one line naming the holder."""
    second = run_command(commands.script("train.py"), "--config", config_path, "--no-progress", cwd=REPO)
    out = second.out + second.err
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert second.status == 1, out[-3000:]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert f"is in use by another trainer: pid {holder_pid} on host {HOST}" in errors[0]


@pytest.mark.slow  # a trainer process holds the lock while it trains, is stopped and resumed
def test_a_second_trainer_is_refused_on_a_fresh_run_dir_and_on_one_with_checkpoints(corpus, tmp_path, run_command):
    run = tmp_path / "run"
    cfg = write_config(make_config(corpus, run, total_steps=1000, val_set={}, ckpt_every=1000), tmp_path / "c.json")

    first = start_trainer(cfg, tmp_path / "first.log")
    wait_for(lambda: (run / LOCK_NAME).exists(), first, tmp_path / "first.log", what="taking the lock")
    _refused(run_command, cfg, first.pid)
    assert checkpoint.Checkpointer(run, read_only=True).latest_step() is None  # still a fresh run dir
    wait_for(lambda: len(train_losses(run)) >= 3, first, tmp_path / "first.log", what="three steps")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=300) == 0, open(tmp_path / "first.log").read()[-3000:]
    saved = checkpoint.Checkpointer(run, read_only=True).latest_step()
    assert saved >= 3

    resumed = start_trainer(cfg, tmp_path / "resumed.log")
    wait_for(lambda: len(train_losses(run)) >= saved + 2, resumed, tmp_path / "resumed.log", what="resuming")
    _refused(run_command, cfg, resumed.pid)
    resumed.send_signal(signal.SIGTERM)
    assert resumed.wait(timeout=300) == 0, open(tmp_path / "resumed.log").read()[-3000:]
    steps = [step for step, _ in train_losses(run)]
    assert steps == list(range(1, len(steps) + 1))  # the refused trainers wrote nothing
    assert not (run / LOCK_NAME).exists()


def test_a_run_that_wrote_nothing_leaves_no_empty_directory(tmp_path):
    with RunDirLock(tmp_path / "new" / "run"):
        assert (tmp_path / "new" / "run").is_dir()
    assert not (tmp_path / "new" / "run").exists()
    (tmp_path / "kept").mkdir()
    with RunDirLock(tmp_path / "kept"):
        pass
    assert (tmp_path / "kept").is_dir()  # it existed before: left alone


def test_gptj_launch_takes_over_the_lock_of_its_own_earlier_attempt_from_any_host(tmp_path, monkeypatch, caplog):
    # After a preemption the job's process 0 may run on a new host: the launcher ended the earlier one.
    run = tmp_path / "run"
    run.mkdir()
    left = {"host": "tpu-vm-7", "pid": 4242, "started": "2020-01-01T00:00:00+00:00", "launch": "job1:0"}
    for ours in ("job1:0", "job2:1", None):  # the same attempt, another job, no launcher: refused
        (run / LOCK_NAME).write_text(json.dumps(left))
        if ours is None:
            monkeypatch.delenv(LAUNCHED_ENV, raising=False)
        else:
            monkeypatch.setenv(LAUNCHED_ENV, ours)
        with pytest.raises(RunDirLocked, match="pid 4242 on host tpu-vm-7"):
            RunDirLock(run).acquire()
    monkeypatch.setenv(LAUNCHED_ENV, "job1:1")
    for object_store in (False, True):
        (run / LOCK_NAME).write_text(json.dumps(left))
        lock = RunDirLock(run)
        lock.is_url = object_store
        with caplog.at_level(logging.WARNING):
            lock.acquire()
        assert json.loads((run / LOCK_NAME).read_text())["launch"] == "job1:1"
        lock.release()
    assert caplog.text.count("taking over the lock of pid 4242 on host tpu-vm-7") == 2
