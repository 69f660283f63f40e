"""scripts/aot_check.py without a TPU library: a clear message, not a traceback from deep inside JAX."""

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from gptj_flax import partitioning
from gptj_flax.config import load_config
from gptj_flax.training.aot import serving_fit, topology_devices
from tests import commands


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu installed: the TPU path runs")
def test_aot_check_without_libtpu_says_how_to_get_it(repo_root, run_command):
    aot_check = commands.script("aot_check.py")
    result = run_command(aot_check, "--config", "configs/tiny.json", "--topology", "v3:2x2", cwd=repo_root)
    assert result.status != 0
    assert "cannot describe TPU topology 'v3:2x2'" in result.err and "pip install -e '.[tpu]'" in result.err


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the tpu extra)")
def test_aot_check_compiles_splash_for_a_tpu_slice_by_default_and_reports_its_cost(repo_root, tmp_path):
    config = tmp_path / "small.json"
    config.write_text(
        json.dumps(
            {
                "model": {
                    "n_layers": 2,
                    "d_model": 256,
                    "n_heads": 2,
                    "rotary_dim": 32,
                    "vocab_size": 512,
                    "scan_layers": False,
                },
                "mesh": {"data": 1, "fsdp": -1, "model": 2},
                "train": {"batch_size": 4, "seq_len": 256},
            }
        )
    )
    result = subprocess.run(
        [sys.executable, "scripts/aot_check.py", "--config", str(config), "--topology", "v5e:2x4"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert "attention: splash, block 256: model.attention=auto on tpu" in out, out
    assert "FITS (XLA compiled it for this chip)" in out
    cost = re.search(r"XLA cost analysis per device per step: ([\d.e+]+) FLOPs, ([\d.e+]+) bytes accessed", out)
    kernel = re.search(r"fused attention kernel \(counted analytically; .*\): ([\d.e+]+) FLOPs, ([\d.e+]+) bytes", out)
    assert cost and kernel, out
    assert all(float(x) > 0 for x in (*cost.groups(), *kernel.groups()))
    # 2 layers x (forward + 2.5x backward) x causal half of q.k and p.v, 4 rows over 8 devices
    assert float(kernel.group(1)) == pytest.approx(
        2 * 3.5 * 2 * 256 * 256 * 128 * 2 * 4 / 8, rel=1e-3
    )  # printed to 4 digits
    assert re.search(r"roofline on TPU v5 lite \(197 TFLOP/s, 819 GB/s\): [\d.]+ ms per step, MFU at most \d+%", out)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the tpu extra)")
def test_a_v4_slice_is_described_one_device_per_chip_as_jax_meshes_need():
    devices = topology_devices("v4:2x2x1")  # 4 chips of 2 cores each
    assert len(devices) == 4 and devices[0].device_kind == "TPU v4"
    assert partitioning.mesh_shape(partitioning.make_mesh((1, -1, 1), devices=devices)) == {
        "data": 1,
        "fsdp": 4,
        "model": 1,
    }


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu installed: XLA:TPU measures")
def test_int8_gptj_6b_serving_fits_one_v5e_chip_and_bf16_does_not(repo_root):
    """The serving fit without libtpu: parameter and cache bytes from the shapes (checked here
    against an independent count), activations estimated."""
    config = load_config(repo_root / "configs" / "gptj_6b.json")
    int8 = load_config(repo_root / "configs" / "gptj_6b.json", ["model.quantize=int8"])
    L, d, f, v = 28, 4096, 16384, 50400
    blocks = L * (4 * d * d + 2 * d * f)
    scales = L * (3 * d + d + f + d)  # q/k/v: heads x head_dim; out_proj, fc_out: d_model; fc_in: d_ff
    rest = L * (2 * d + f + d) + 2 * d + 2 * v * d + v  # LayerNorms, biases, embedding, head
    # keys and values of 8 slots + the prefill chunk's row in bf16, that row's int32 segment ids, and
    # the int32 indices (a length per slot, the prefill's one)
    cache = 2 * L * (8 + 1) * 2048 * d * 2 + 2048 * 4 + (8 + 1) * 4
    for topology, hbm in (("v5e:1x1", 16), ("v4:1x1x1", 32)):
        q = serving_fit(int8, topology, batch=8, cache_len=2048)
        assert (q.param_bytes, q.cache_bytes, q.hbm_bytes) == (blocks + 4 * scales + 2 * rest, cache, hbm * 2**30)
        assert 0 < q.activation_bytes < 2**30 and q.fits, q.format()
        b = serving_fit(config, topology, batch=8, cache_len=2048)
        assert b.param_bytes == 2 * (blocks + rest) and b.fits == (hbm == 32), b.format()
        print("\n" + q.format() + "\n" + b.format())
    assert "FITS" in q.format() and "parameters 6.02 GiB + KV cache 7.88 GiB" in q.format()


def test_aot_check_refuses_serving_flags_without_serve(repo_root, run_command):
    args = ["--config", "configs/tiny.json", "--topology", "v5e:1x1", "--quantize", "int8"]
    result = run_command(commands.script("aot_check.py"), *args, cwd=repo_root)
    assert result.status == 2 and "--quantize only apply with --serve" in result.err
