"""Sampling and scoring on two processes × four CPU devices (as two hosts of a slice) equal one process."""

import json
import time

import numpy as np
import pytest

import gptj_flax
from gptj_flax.sampling.multihost import fingerprint
from tests.evaluation_helpers import make_checkpoint
from tests.multihost_helpers import free_port, log_of, run_calls, start_processes

WORKER = "tests/workers/infer_worker.py"
MESHES = ("2,2,2", "1,2,4")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("run"))
    make_checkpoint(directory)
    return directory


@pytest.mark.slow
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
        for a, b in zip(multi["scores"] + multi["greedy_logprobs"], single["scores"] + single["greedy_logprobs"]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        assert "process(es) [1] were called with other arguments" in multi["divergent"], multi["divergent"]


def test_call_fingerprints_see_every_element_of_long_arrays():
    # numpy abbreviates long arrays in repr: two prompts differing in the middle must still differ
    a, b = np.zeros(5000, np.int32), np.zeros(5000, np.int32)
    b[2500] = 1
    assert repr(a) == repr(b) and fingerprint([a]) != fingerprint([b])
    assert fingerprint([a, {"temperature": 0.0}]) == fingerprint([a.copy(), {"temperature": 0.0}])
    assert fingerprint(([1, 2], 0.0)) != fingerprint(([1, 2], 1e-9))
