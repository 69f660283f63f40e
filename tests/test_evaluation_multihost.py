"""lm-eval on two processes × four CPU devices (as two hosts of a slice): the ``scripts/eval.py
harness`` results equal one process's, and a training run's harness hook runs on both processes."""

import json
import sys

import pytest

from gptj_flax.cli import eval as eval_cli
from tests.evaluation_helpers import write_tasks
from tests.multihost_helpers import free_port, log_of, start_processes
from tests.training_helpers import make_config, write_config

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
TASKS = ["tiny_choice", "tiny_text", "tiny_generation"]


def harness_command(run, tasks, output) -> list[str]:
    return [
        "harness",
        "--checkpoint",
        run,
        "--tasks",
        ",".join(TASKS),
        "--include-path",
        str(tasks),
        "--no-builtin-tasks",
        "--output",
        str(output),
        "--mesh",
        "2,2,2",
        "--batch-size",
        "3",
        "--bootstrap-iters",
        "0",
    ]


@pytest.mark.slow  # two JAX processes joined by a coordinator, then one in-process reference
def test_eval_harness_on_two_processes_writes_one_results_file_equal_to_one_process(
    tmp_path, repo_root, monkeypatch, eval_checkpoint
):
    run = eval_checkpoint[0]
    tasks = write_tasks(tmp_path / "tasks")
    output = tmp_path / "multi" / "results.json"
    output.parent.mkdir()
    port = free_port()
    procs = start_processes(
        lambda pid: ["scripts/eval.py", *harness_command(run, tasks, output)],
        2,
        repo_root,
        tmp_path,
        env_of=lambda pid: {
            **OFFLINE,
            "HF_HOME": str(tmp_path / f"hf{pid}"),  # as on hosts of their own
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": "4",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(pid),
        },
    )
    for pid, proc in enumerate(procs):
        assert proc.wait(timeout=900) == 0, log_of(tmp_path, pid)[-4000:]
    assert "results written to" in log_of(tmp_path, 0) and "results written to" not in log_of(tmp_path, 1)
    assert sorted(p.name for p in output.parent.iterdir()) == ["results.json"]  # one file, no leftovers

    for key, value in {**OFFLINE, "HF_HOME": str(tmp_path / "hf")}.items():
        monkeypatch.setenv(key, value)
    single_output = tmp_path / "single.json"
    monkeypatch.setattr(sys, "argv", ["eval.py", *harness_command(run, tasks, single_output)])
    assert eval_cli.main() == 0
    multi, single = json.loads(output.read_text()), json.loads(single_output.read_text())
    assert multi["n-samples"] == single["n-samples"]
    assert set(multi["results"]) == set(TASKS)
    for task in TASKS:
        for metric, value in single["results"][task].items():
            expected = pytest.approx(value, rel=1e-6) if isinstance(value, float) else value
            assert multi["results"][task][metric] == expected, (task, metric)


@pytest.mark.slow  # a two-process training run with lm-eval at its validation steps
def test_training_harness_hook_runs_on_both_processes(tmp_path, repo_root, stdlib_corpus):
    corpus = stdlib_corpus(max_bytes=100_000)
    tasks = write_tasks(tmp_path / "tasks")
    run_dir = tmp_path / "run"
    config = make_config(
        corpus, run_dir, total_steps=2, val_every=2, ckpt_every=2, val_set={}, eval_harness_tasks=TASKS
    )
    config_path = write_config(config, tmp_path / "config.json")
    port = free_port()
    worker = "tests/workers/train_harness_worker.py"
    procs = start_processes(
        lambda pid: [worker, config_path, str(tasks), str(tmp_path), "2", str(pid), str(port), "2,2,2"],
        2,
        repo_root,
        tmp_path,
        env_of=lambda pid: {**OFFLINE, "HF_HOME": str(tmp_path / f"hf{pid}")},
    )
    for pid, proc in enumerate(procs):
        assert proc.wait(timeout=900) == 0, log_of(tmp_path, pid)[-4000:]
    got = [json.loads((tmp_path / f"process_{pid}.json").read_text()) for pid in (0, 1)]
    assert got[0] == got[1]
    assert {"harness/tiny_choice/acc", "harness/tiny_text/bits_per_byte", "harness/tiny_generation/exact_match"} <= set(
        got[0]["2"]
    )
    saved = json.loads((run_dir / "harness" / "harness_2.json").read_text())
    assert saved["config"]["step"] == 2 and set(saved["results"]) == set(TASKS)
