"""Across processes: exact resume in a fresh process, and two JAX processes sharing one global batch."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from data_helpers import make_documents

from gptj_flax.data import create_tfrecords, make_train_iterator

HERE = Path(__file__).resolve().parent


def child_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the parent's 8-device flag is not theirs
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", GPTJ_FLAX_CACHE=str(tmp_path / "cache"))
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_resume_in_a_fresh_process(legacy_dataset, tmp_path):
    index, _ = legacy_dataset(n_rows=90, n_files=3)
    settings = dict(seq_len=16, batch_size=4, grad_accum=2, seed=11, shuffle_buffer=3)
    uninterrupted = make_train_iterator(index, process_index=0, process_count=1, progress=False, **settings)
    reference = [next(uninterrupted) for _ in range(20)]

    first = make_train_iterator(index, process_index=0, process_count=1, progress=False, **settings)
    for _ in range(10):
        next(first)
    (tmp_path / "state.json").write_text(json.dumps(first.state()))
    out = tmp_path / "resumed.npz"
    subprocess.run(
        [
            sys.executable,
            str(HERE / "_child_resume.py"),
            index,
            json.dumps(settings),
            str(tmp_path / "state.json"),
            "10",
            str(out),
        ],
        check=True,
        env=child_env(tmp_path),
        timeout=180,
    )
    resumed = np.load(out)
    for k, batch in enumerate(reference[10:]):
        for field in ("tokens", "segment_ids", "loss_mask"):
            np.testing.assert_array_equal(resumed[f"{field}_{k}"], getattr(batch, field), err_msg=f"batch {11 + k}")


def test_two_processes_share_one_global_batch(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("<|endoftext|>".join(make_documents(300)))
    index = create_tfrecords(
        tmp_path / "a.txt", tmp_path / "out", tokenizer=tokenizer, seq_len=32, sequences_per_file=40, progress=False
    ).index_path
    port = free_port()
    outs = [tmp_path / f"process{p}.npz" for p in range(2)]
    children = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_child_multihost.py"), str(p), str(port), index, str(outs[p])],
            env=child_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in range(2)
    ]
    logs = []
    for child in children:
        try:
            logs.append(child.communicate(timeout=240)[0])
        finally:
            child.kill()
    assert [c.returncode for c in children] == [0, 0], "\n\n".join(log[-3000:] for log in logs)

    whole = make_train_iterator(
        index,
        seq_len=32,
        batch_size=8,
        grad_accum=2,
        seed=7,
        shuffle_buffer=3,
        process_index=0,
        process_count=1,
        progress=False,
    )
    shares = [np.load(out) for out in outs]
    for step in range(5):
        batch = next(whole)
        local = [s[f"tokens_{step}"] for s in shares]
        np.testing.assert_array_equal(np.concatenate(local, axis=1), batch.tokens)  # union, in row order
        rows = [set(map(tuple, part.reshape(-1, 33))) for part in local]
        assert not rows[0] & rows[1]  # disjoint shares
        assert batch.segment_ids.max() > 1  # packed documents are told apart
