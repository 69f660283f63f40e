"""Helpers of the multi-process inference tests: the calls every process makes, and starting
processes that share one mesh over 127.0.0.1 (each with 4 CPU devices, as hosts of a slice)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.commands import QUICK_COMPILE

PROMPTS = ["The cat sat on the", "def add(a, b):", "Paris is the capital of"]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "One two three four five six seven eight nine ten."]


def run_calls(lm) -> dict:
    """Greedy generation (with and without stop strings), sampling, streaming and scoring, as JSON."""
    greedy = lm.generate(PROMPTS, max_new_tokens=12, temperature=0, return_tokens=True, return_logprobs=True)
    # stop strings taken from the middle of each greedy text, so that every row stops early
    stops = [[c.text[3:5]] for c in greedy]
    stopped = lm.generate(PROMPTS, max_new_tokens=12, temperature=0, stop=stops, return_tokens=True)
    sampled = lm.generate(PROMPTS, max_new_tokens=12, temperature=0.8, top_p=0.9, seed=5, return_tokens=True)
    stream = lm.stream(PROMPTS[0], max_new_tokens=12, temperature=0, stop=stops[0])
    pieces = list(stream)
    return {
        "greedy": [[c.tokens, c.text, c.finish_reason] for c in greedy],
        "greedy_logprobs": [c.logprobs for c in greedy],
        "stops": stops,
        "stopped": [[c.tokens, c.text, c.finish_reason] for c in stopped],
        "sampled": [c.tokens for c in sampled],
        "pieces": pieces,
        "stream_finish": [c.finish_reason for c in stream.completions],
        "scores": [s.logprobs.tolist() for s in lm.score(TEXTS)],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_processes(argv_of, n: int, repo_root, log_dir, env_of=None) -> list[subprocess.Popen]:
    """``n`` processes running ``argv_of(process_id)`` with ``env_of(process_id)`` added to the
    environment, each one's output in ``log_dir/process_ID.log`` (files, not pipes: a process
    blocked on a full pipe would look like a hang)."""
    procs = []
    for pid in range(n):
        environment = {
            **os.environ,
            "XLA_FLAGS": QUICK_COMPILE,
            "PYTHONPATH": str(repo_root),
            **(env_of(pid) if env_of else {}),
        }
        with open(os.path.join(log_dir, f"process_{pid}.log"), "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv_of(pid)],
                    cwd=repo_root,
                    env=environment,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def log_of(log_dir, pid: int) -> str:
    with open(os.path.join(log_dir, f"process_{pid}.log")) as f:
        return f.read()
