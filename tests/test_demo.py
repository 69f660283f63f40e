"""The README's main command, run as a user would."""

import subprocess
import sys


def test_demo_script_runs(repo_root):
    result = subprocess.run([sys.executable, "scripts/demo.py"], cwd=repo_root, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "8 cpu devices, mesh {'data': 2, 'fsdp': 2, 'model': 2}" in out
    assert "5,254,656 parameters" in out
    assert "params/layers/attn/q_proj        (layers, embed, heads, kv)  (-, fsdp, model, -)" in out
    assert "logits (16, 256, 4096) float32" in out
