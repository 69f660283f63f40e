"""gptj_flax.cli: with libtpu installed on a machine without TPUs, the commands name the platforms JAX
may start, although the package root has imported JAX before the cli package runs."""

import json
import os
import subprocess
import sys

import pytest

from gptj_flax.cli import tpu_attached

CHILD = """
import json
import gptj_flax.cli
import jax
print(json.dumps({"config": jax.config.jax_platforms, "env": __import__("os").environ.get("JAX_PLATFORMS"),
                  "platform": jax.devices()[0].platform}))
"""


@pytest.mark.skipif(tpu_attached(), reason="this machine has TPUs: the TPU runtime is meant to start")
def test_libtpu_without_a_tpu_leaves_jax_on_the_cpu(tmp_path):
    # an importable module named libtpu stands for the tpu extra; JAX never loads it here
    (tmp_path / "libtpu").mkdir()
    (tmp_path / "libtpu" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"config": "cpu", "env": "cpu", "platform": "cpu"}
