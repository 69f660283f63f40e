"""The README's main command, run as a user would (with no arguments, from a temporary directory)."""

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.slow  # the README's demo trains 240 steps to a perplexity that falls five-fold
def test_demo_trains_and_samples(repo_root, tmp_path):
    # No arguments, from a directory outside the checkout: the checkout's config, the run under it.
    run = tmp_path / "runs" / "demo"
    # the user's environment: none of the tests' XLA flags (the demo picks its own devices, and its 240
    # steps run faster with the LLVM optimisations the tests' flags leave out)
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": str(repo_root)}
    cmd = [sys.executable, str(repo_root / "scripts" / "demo.py")]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout
    assert "8 cpu devices, mesh {'data': 2, 'fsdp': 2, 'model': 2}" in out
    first, last = map(
        float, re.search(r"validation perplexity: ([\d.]+) at step 0 -> ([\d.]+) at step 240", out).groups()
    )
    assert last < first / 5, (first, last)  # falls clearly, not just by noise
    sample = out.split("sample (", 1)[1]
    assert re.match(r"(length|eos|stop), \d+ tokens\):\ndef ", sample)
    assert len(sample.split("\n", 1)[1].strip()) > 20
    for name in ("loss.png", "metrics.jsonl", "tokenizer", "240"):
        assert (run / name).exists(), name
