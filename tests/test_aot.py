"""scripts/aot_check.py without a TPU library: a clear message, not a traceback from deep inside JAX."""

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu installed: the TPU path runs")
def test_aot_check_without_libtpu_says_how_to_get_it(repo_root):
    result = subprocess.run(
        [sys.executable, "scripts/aot_check.py", "--config", "configs/tiny.json", "--topology", "v3:2x2"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "cannot describe TPU topology 'v3:2x2'" in result.stderr and "pip install -e '.[tpu]'" in result.stderr
