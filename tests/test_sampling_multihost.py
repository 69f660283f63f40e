"""Sampling and scoring on two processes × four CPU devices (as two hosts of a slice) equal one process."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import gptj_flax
from gptj_flax.sampling.multihost import fingerprint
from tests.commands import QUICK_COMPILE
from tests.multihost_helpers import free_port, log_of, run_calls, start_processes

WORKER = "tests/workers/infer_worker.py"
MESHES = ("2,2,2", "1,2,4")


@pytest.fixture(scope="module")
def run(eval_checkpoint):
    return eval_checkpoint[0]


@pytest.mark.slow  # two JAX processes on two meshes, then one process's reference on each
def test_two_processes_generate_stream_and_score_as_one_and_fail_clearly(run, tmp_path, repo_root):
    port = free_port()
    argv = [WORKER, run, str(tmp_path), "2"]
    procs = start_processes(lambda pid: [*argv, str(pid), str(port), *MESHES], 2, repo_root, tmp_path)
    procs[1].wait(timeout=900)
    died_at = time.monotonic()
    out_1 = log_of(tmp_path, 1)
    assert procs[1].returncode == 3 and "process 1 exits mid-stream" in out_1, out_1[-4000:]
    # Process 0 was streaming with process 1 when it died: it must fail, not wait for ever.
    procs[0].wait(timeout=300)
    out_0 = log_of(tmp_path, 0)
    assert procs[0].returncode != 0 and "finished a stream" not in out_0, out_0[-4000:]
    assert time.monotonic() - died_at < 90, out_0[-4000:]

    got = [json.loads((tmp_path / f"process_{pid}.json").read_text()) for pid in (0, 1)]
    assert got[0] == got[1]  # every process gets every result, sampled ones too
    one_device = gptj_flax.load(run)
    one_device_greedy = one_device.generate(
        ["The cat sat on the", "def add(a, b):", "Paris is the capital of"],
        max_new_tokens=12,
        temperature=0,
        return_tokens=True,
    )
    for mesh in MESHES:
        multi, single = got[0][mesh], run_calls(gptj_flax.load(run, mesh=mesh))
        assert multi["greedy"] == [[c.tokens, c.text, c.finish_reason] for c in one_device_greedy]
        for key in ("greedy", "stops", "stopped", "sampled", "pieces", "stream_finish"):
            assert multi[key] == single[key], (mesh, key)
        assert all(reason == "stop" for _, _, reason in multi["stopped"])
        assert "".join(multi["pieces"]) == multi["stopped"][0][1]
        # collectives across processes add partial sums in another order than within one: last-bit
        # float32 differences, so the bound is 1e-6 plus 1e-6 relative
        for a, b in zip(multi["scores"] + multi["greedy_logprobs"], single["scores"] + single["greedy_logprobs"]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        assert "process(es) [1] were called with other arguments" in multi["divergent"], multi["divergent"]


@pytest.mark.slow  # two scripts/sample.py processes joined by a coordinator
def test_sample_script_on_two_processes_reads_prompts_on_process_0_and_prints_there(run, tmp_path, repo_root):
    prompts = ["The cat sat on the", "def add(a, b):"]
    port = free_port()
    procs = []
    for pid in (0, 1):
        env = {
            **os.environ,
            "XLA_FLAGS": QUICK_COMPILE,
            "PYTHONPATH": str(repo_root),
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": "4",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(pid),
        }
        command = ["scripts/sample.py", run, "--interactive", "--mesh", "1,2,4", "--temperature", "0"]
        with (
            open(tmp_path / f"in_{pid}", "w+") as stdin,
            open(tmp_path / f"out_{pid}", "w") as stdout,
            open(tmp_path / f"err_{pid}", "w") as stderr,
        ):
            if pid == 0:  # only process 0 has the terminal; process 1 reads nothing
                stdin.write("".join(p + "\n" for p in prompts))
                stdin.seek(0)
            procs.append(
                subprocess.Popen(
                    [sys.executable, *command, "--max-new-tokens", "8"],
                    cwd=repo_root,
                    env=env,
                    stdin=stdin,
                    stdout=stdout,
                    stderr=stderr,
                )
            )
    for pid, proc in enumerate(procs):
        assert proc.wait(timeout=900) == 0, (tmp_path / f"err_{pid}").read_text()[-4000:]
    lm = gptj_flax.load(run)
    texts = [lm.generate(p, max_new_tokens=8, temperature=0).text for p in prompts]
    # stdout carries the completions alone: gloo's connection lines (native code) go to stderr
    assert (tmp_path / "out_0").read_text() == "".join(f"prompt> {t}\n" for t in texts) + "prompt> "
    assert (tmp_path / "out_1").read_text() == ""
    assert "completion done" in (tmp_path / "err_0").read_text()
    assert "completion done" not in (tmp_path / "err_1").read_text()


def test_call_fingerprints_see_every_element_of_long_arrays():
    # numpy abbreviates long arrays in repr: two prompts differing in the middle must still differ
    a, b = np.zeros(5000, np.int32), np.zeros(5000, np.int32)
    b[2500] = 1
    assert repr(a) == repr(b) and fingerprint([a]) != fingerprint([b])
    assert fingerprint([a, {"temperature": 0.0}]) == fingerprint([a.copy(), {"temperature": 0.0}])
    assert fingerprint(([1, 2], 0.0)) != fingerprint(([1, 2], 1e-9))
