"""gptj-launch: a training job on 2 processes x 4 CPU devices on a local Ray cluster (127.0.0.1), which
survives a SIGKILLed process with the losses of an uninterrupted run, reports a program's own error
after one attempt, and stops on SIGTERM after the program saved; how it judges an attempt, how it
relays output, and its command line with and without Ray."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.launch import LocalCluster
from gptj_flax import checkpoint
from gptj_flax.cli import launch as launch_cli
from gptj_flax.errors import EXIT_PREEMPTED, UNEXPECTED_HINT
from gptj_flax.launch import Ending, LaunchError, judge
from gptj_flax.launch.job import Restarts
from gptj_flax.launch.output import Relay
from gptj_flax.training import train
from tests.commands import QUICK_COMPILE
from tests.training_helpers import make_config, train_losses, write_config

STARTED = re.compile(r"started gptj-train on (\d) host\(s\): #0 \S+ \(pid (\d+)\)(?:, #1 \S+ \(pid (\d+)\))?")
PROGRAM_ENV = ["--env", f"XLA_FLAGS={QUICK_COMPILE}", "--env", "JAX_PLATFORMS=cpu", "--env", "JAX_NUM_CPU_DEVICES=4"]


def saved_step(run) -> int:
    """The newest complete checkpoint's step in ``run`` (0 before the first)."""
    return (checkpoint.Checkpointer(run, read_only=True).latest_step() or 0) if run.exists() else 0


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_corpus()


@pytest.fixture(scope="module")
def cluster(repo_root):
    """One Ray node on 127.0.0.1 with room for two 1-CPU processes, for this module's jobs."""
    with LocalCluster(num_cpus=2) as started:
        yield started


@pytest.fixture
def start_launcher(cluster, repo_root, tmp_path):
    """Starts scripts/launch.py ARGS against ``cluster`` ($RAY_ADDRESS), stdout and stderr into files;
    a launcher a failed test leaves running is killed, and Ray then ends its agents and their programs."""
    started = []

    def start(*args: str) -> subprocess.Popen:
        out, err = open(tmp_path / "launch.out", "wb"), open(tmp_path / "launch.err", "wb")
        with out, err:
            started.append(
                subprocess.Popen(
                    [sys.executable, "scripts/launch.py", *args], cwd=repo_root, env=cluster.env, stdout=out, stderr=err
                )
            )
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_for_start(proc, tmp_path, timeout=600) -> list[int]:
    """The pids the launcher reports for its first attempt's processes."""
    deadline = time.time() + timeout
    while not (match := STARTED.search((tmp_path / "launch.err").read_text())):
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "launch.err").read_text()[-4000:]
        time.sleep(0.2)
    return [int(pid) for pid in match.groups()[1:] if pid]


@pytest.mark.slow  # two 2-process trainings (the killed one and its restart) and a reference: minutes on 2 cores
def test_a_killed_process_restarts_the_job_which_finishes_with_the_uninterrupted_losses(
    start_launcher, corpus, tmp_path
):
    steps, run = 40, tmp_path / "run"
    reference = train(make_config(corpus, tmp_path / "ref", total_steps=steps, val_set={}), progress=False)
    config = write_config(make_config(corpus, run, total_steps=steps, val_set={}, ckpt_every=4), tmp_path / "c.json")
    proc = start_launcher("--hosts", "2", *PROGRAM_ENV, "train", "--config", config)
    pids = wait_for_start(proc, tmp_path)
    deadline = time.time() + 600
    while saved_step(run) < 4:
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "launch.err").read_text()[-4000:]
        time.sleep(0.2)
    os.kill(pids[1], signal.SIGKILL)
    assert proc.wait(timeout=900) == 0, (tmp_path / "launch.err").read_text()[-6000:]

    err, out = (tmp_path / "launch.err").read_text(), (tmp_path / "launch.out").read_text()
    assert (
        "process 1 on" in err and "was killed by SIGKILL; a preemption: starting every process again (restart 1)" in err
    )
    assert len(STARTED.findall(err)) == 2 and "the job finished (1 restart(s))" in err
    resumed = [int(s) for s in re.findall(rf"\[#0 \S+\] .*resumed from {re.escape(str(run))} at step (\d+)", err)]
    assert len(resumed) == 1 and 4 <= resumed[0] < steps and resumed[0] % 4 == 0
    # process 0's stdout, and only it, unchanged: its final line; process 1's came on stderr
    assert f"step {steps}: saved in {run}\n" in out and "[#" not in out
    assert re.search(rf"^\[#1 \S+\] step {steps}: saved in {re.escape(str(run))}$", err, re.MULTILINE)
    logged = train_losses(run)
    assert [step for step, _ in logged] == list(range(1, steps + 1))  # each step once, in order
    for step, loss in logged:  # 2 processes' collectives against 1's: last-bit float32 differences
        assert abs(loss - reference.losses[step]) <= 1e-6, step


def test_a_config_error_is_reported_once_with_its_line_and_not_retried(start_launcher, corpus, tmp_path):
    config = write_config(make_config(corpus, tmp_path / "run"), tmp_path / "c.json")
    proc = start_launcher("--hosts", "2", *PROGRAM_ENV, "train", "--config", config, "--set", "train.lr=-1")
    assert proc.wait(timeout=600) == 1
    err = (tmp_path / "launch.err").read_text()
    assert len(STARTED.findall(err)) == 1 and "restart" not in err, err[-4000:]
    last = err.rstrip("\n").splitlines()[-1]
    assert re.fullmatch(
        r"error: the program failed, not retried: process [01] on \S+ exited with status 1: "
        rf"{re.escape(config)}: train.lr must be a finite non-negative number, got -1",
        last,
    ), err[-4000:]
    assert (tmp_path / "launch.out").read_text() == ""


@pytest.mark.slow  # one training process's start and save
def test_sigterm_on_the_launcher_stops_the_program_which_saves(start_launcher, corpus, tmp_path):
    run = tmp_path / "run"
    config = write_config(make_config(corpus, run, total_steps=10_000, val_set={}, ckpt_every=10_000), tmp_path / "c")
    one_host = [*PROGRAM_ENV[:-1], "JAX_NUM_CPU_DEVICES=8"]  # the config's 2x2x2 mesh on one process
    proc = start_launcher("--hosts", "1", *one_host, "train", "--config", config)
    wait_for_start(proc, tmp_path)
    deadline = time.time() + 600
    while len(train_losses(run)) < 3:
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "launch.err").read_text()[-4000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == 128 + signal.SIGTERM
    err = (tmp_path / "launch.err").read_text()
    saved = saved_step(run)
    assert 3 <= saved < 10_000
    assert f"saved and stopped on SIGTERM (status {EXIT_PREEMPTED})" in err, err[-3000:]
    assert f"step {saved}: preempted, saved in {run}\n" in (tmp_path / "launch.out").read_text()


# -- how an attempt is judged ------------------------------------------------------------------------


def exited(process: int, status: int, error: str | None = None, unexpected: bool = False) -> Ending:
    return Ending(process, "host", "exit", status, error, unexpected)


def test_a_lost_or_killed_process_makes_a_preemption_whatever_the_others_said():
    gloo = exited(0, 1, "JaxRuntimeError: Gloo all-reduce failed", unexpected=True)
    for cause in (Ending(1, "host", "killed", signal.SIGKILL), Ending(1, "host", "lost")):
        assert judge([gloo, cause, Ending(2, "host", "stopped", signal.SIGKILL)]) == ("preempted", cause)
    saved = exited(1, EXIT_PREEMPTED)
    assert judge([exited(0, 0), saved]) == ("preempted", saved)


def test_the_first_failure_decides_and_only_zeros_finish():
    config = exited(1, 1, "c.json: train.lr must be a finite non-negative number, got -1")
    assert judge([config, Ending(0, "host", "stopped", signal.SIGKILL)]) == ("failed", config)
    assert judge([exited(0, 0), exited(1, 0)]) == ("finished", None)


def test_an_unexpected_error_runs_again_once_and_the_same_one_twice_in_a_row_ends_the_job(capsys):
    gloo = exited(0, 1, "JaxRuntimeError: Gloo all-reduce failed", unexpected=True)
    killed = Ending(1, "host", "killed", signal.SIGKILL)
    restarts = Restarts(limit=10)
    restarts.after("failed", gloo)
    restarts.after("preempted", killed)
    restarts.after("failed", gloo)  # not twice in a row: a preemption came between
    with pytest.raises(LaunchError, match="not retried: process 0 on host exited with status 1: JaxRuntimeError"):
        restarts.after("failed", gloo)
    assert restarts.count == 3
    assert "process 0 on host exited with status 1: JaxRuntimeError: Gloo all-reduce failed; an unexpected error: " in (
        capsys.readouterr().err
    )


def test_a_program_error_ends_the_job_at_once_and_preemptions_end_it_past_max_restarts():
    with pytest.raises(LaunchError, match="not retried: process 1 on host exited with status 1: c.json: bad"):
        Restarts(limit=10).after("failed", exited(1, 1, "c.json: bad"))
    restarts = Restarts(limit=2)
    killed = Ending(1, "host", "killed", signal.SIGKILL)
    restarts.after("preempted", killed)
    restarts.after("preempted", killed)
    with pytest.raises(LaunchError, match=r"killed by SIGKILL, and the job was already started again 2 time\(s\), "):
        restarts.after("preempted", killed)


def test_output_keeps_process_0s_stdout_as_it_is_and_prefixes_every_other_line():
    out, err = io.BytesIO(), io.BytesIO()
    relay = Relay(out, err)
    relay.name(0, "h0")
    relay.name(1, "h1")
    relay.write(0, "stdout", b"a completion without a newline")
    relay.write(1, "stdout", b"one\ntw")
    relay.write(0, "stderr", b"log line\n")
    relay.write(1, "stdout", b"o\n")
    relay.write(1, "stderr", b"error: c.json: bad\n" + UNEXPECTED_HINT.encode())
    relay.close(1)
    assert out.getvalue() == b"a completion without a newline"
    assert err.getvalue().decode().splitlines() == [
        "[#1 h1] one",
        "[#0 h0] log line",
        "[#1 h1] two",
        "[#1 h1] error: c.json: bad",
        f"[#1 h1] {UNEXPECTED_HINT}",
    ]
    assert relay.error_line(1) == ("c.json: bad", True)
    assert relay.error_line(0) == ("log line", True)  # no error line: the last line, as a traceback ends


# -- the command line ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hosts", "0", "train"], "error: --hosts must be at least 1, got 0"),
        (["--tpu", "v4-16", "train"], "error: --tpu 'v4-16': expected a TPU generation and the slice's topology"),
    ],
)
def test_bad_hosts_are_one_error_line(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gptj-launch", *argv])
    assert launch_cli.main() == 1
    assert capsys.readouterr().err.startswith(message)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hosts", "2", "--tpu", "v4:2x2x2", "train"], "argument --tpu: not allowed with argument --hosts"),
        (["--hosts", "2", "serve"], "argument command: invalid choice: 'serve'"),
        (["--hosts", "2", "--max-restarts", "-1", "train"], "--max-restarts must be >= 0, got -1"),
    ],
)
def test_usage_errors(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gptj-launch", *argv])
    with pytest.raises(SystemExit) as exit_:
        launch_cli.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err


WITHOUT_RAY = """
import json, subprocess, sys
sys.modules["ray"] = None  # as if the pod extra were not installed
import gptj_flax, gptj_flax.cli.train, gptj_flax.cli.sample, gptj_flax.cli.eval
from gptj_flax.cli import launch
sys.argv = ["gptj-launch", "--hosts", "2", "train", "--config", "c.json"]
status = launch.main()
print(json.dumps({"status": status, "ray": [m for m in sys.modules if m.split(".")[0] == "ray"]}))
"""


def test_without_ray_the_package_and_other_commands_import_and_launch_names_the_extra(repo_root):
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY],
        cwd=repo_root,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert json.loads(done.stdout.splitlines()[-1]) == {"status": 1, "ray": ["ray"]}, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        "error: this command needs the 'pod' extra (ray is not installed): "
        "pip install -c constraints.txt -e '.[pod]' in the project's checkout"
    )
