"""The README's main command, run as a user would (in a temporary run directory)."""

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_trains_and_samples(repo_root, tmp_path):
    run, data_dir = tmp_path / "demo", tmp_path / "demo_data"
    overrides = [
        f"train.run_dir={run}",
        f"train.train_set={data_dir}/train.txt",
        f'train.val_set={{"stdlib": "{data_dir}/val.txt"}}',
        f"train.tokenizer={data_dir}/tokenizer",
    ]
    cmd = [sys.executable, "scripts/demo.py", *[a for o in overrides for a in ("--set", o)]]
    result = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=900)
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
