"""scripts/aot_check.py without a TPU library: a clear message, not a traceback from deep inside JAX."""

import importlib.util
import json
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptj_flax import partitioning
from gptj_flax.config import load_config
from gptj_flax.model import GPTJ
from gptj_flax.sampling import LanguageModel, slot_programs
from gptj_flax.sampling.multihost import to_device
from gptj_flax.sampling.samplers import SamplingParams
from gptj_flax.sampling.serving_fit import SERVE_TOP_LOGPROBS, lowered_programs, serving_fit, serving_shape
from gptj_flax.sampling.slot_programs import SlotPrograms
from gptj_flax.sampling.slots import Request
from gptj_flax.serving import schemas
from gptj_flax.training.aot import topology_devices
from tests import commands
from tests.helpers import tiny_config


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


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu installed: XLA:TPU measures")
def test_the_serving_fit_says_how_many_lora_adapters_fit_beside_the_6b_base(repo_root, run_command):
    int8 = load_config(repo_root / "configs" / "gptj_6b.json", ["model.quantize=int8"])
    fit = serving_fit(int8, "v5e:1x1", batch=8, cache_len=2048, adapter_rank=16)
    L, d, r = 28, 4096, 16
    # q_proj and v_proj: A [d_model, r] and B [r, heads x head_dim] in bfloat16, and a float32 scale each
    assert fit.adapter_bytes == L * 2 * (2 * d * r * 2 + 4)
    assert fit.adapters_that_fit == (fit.hbm_bytes - fit.total_bytes) // fit.adapter_bytes > 50
    assert f"LoRA adapters of rank 16 on q_proj, v_proj: 14.00 MiB each per device; {fit.adapters_that_fit:,} fit" in (
        fit.format()
    )
    args = ["--serve", "--config", "configs/gptj_6b.json", "--topology", "v5e:1x1", "--quantize", "int8"]
    ran = run_command(
        commands.script("aot_check.py"), *args, "--cache-len", "2048", "--adapter-rank", "16", cwd=repo_root
    )
    assert ran.status == 0 and f"{fit.adapters_that_fit:,} fit beside" in ran.out, ran.err
    refused = run_command(commands.script("aot_check.py"), *args, "--adapter-rank", "0", cwd=repo_root)
    assert refused.status == 2 and "--adapter-rank must be >= 1" in refused.err


def test_aot_check_refuses_serving_flags_without_serve(repo_root, run_command):
    args = ["--config", "configs/tiny.json", "--topology", "v5e:1x1", "--quantize", "int8"]
    result = run_command(commands.script("aot_check.py"), *args, cwd=repo_root)
    assert result.status == 2 and "--quantize only apply with --serve" in result.err
    result = run_command(commands.script("aot_check.py"), *args[:-2], "--adapter-rank", "16", cwd=repo_root)
    assert result.status == 2 and "--adapter-rank only apply with --serve" in result.err


def test_the_serving_fit_compiles_the_programs_the_decode_slots_run():
    """The fit's programs are the slots' own, lowered for their mesh: its decode step, compiled,
    takes the slots' state as it is and chooses the tokens that the slots' step chooses."""
    config = tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=96, scan_layers=False)
    params = nn.unbox(GPTJ(config).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    lm = LanguageModel(config, params)
    slots = lm.slots(slots=4, length=64, chunk=16, top_logprobs=3)
    lowered = lowered_programs(slots.programs, lm.mesh)
    assert sorted(lowered) == ["admit", "chunk", "decode", "insert"]
    decode = lowered["decode"].compile()
    sampling = SamplingParams.build(1, temperature=0.8, top_p=0.9)
    slots.admit(
        [Request([5, 6, 7], 10, -1, 1, sampling, want_top=True), Request([9] * 20, 10, -1, 2, sampling)], [0, 2]
    )
    for _ in range(4):
        state = jax.tree.map(lambda x: x.copy(), slots.state)  # the slots' own call donates theirs
        want = slots.decode([], 1)
        _, got = decode(lm.decoder.params, state, np.zeros(4, bool), np.int32(1), slots.table.ids)
        for name in ("tokens", "top_ids", "finish", "num_generated"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), getattr(want, name), err_msg=name)
        np.testing.assert_allclose(np.asarray(got.logprobs), want.logprobs, rtol=1e-6)
    assert want.tokens[[0, 2], 0].all()  # both rows ran


def _engine_lowered(slots, params) -> dict:
    """The slot programs lowered as the slots call them, with the real arguments they pass: every
    slot decoding over the whole pool, four short prompts admitted, a prompt of the slots' whole
    length prefilled by chunks and inserted."""
    sampling = SamplingParams.build(1, temperature=0.0)
    short = [Request([1, 2, 3], 4, -1, 0, sampling)] * 4
    long = Request(list(range(1, slots.length + 1)), 4, -1, 0, sampling)
    programs, table = slots.programs, slots.table.ids
    release = to_device(np.zeros(slots.slots, bool), partitioning.named_sharding(slots.decoder.mesh, ("batch",)))
    prefill = slots.start_prefill(long)
    new_cache = prefill.cache
    slots.prefill_chunk(prefill)
    with partitioning.sharding_scope(slots.decoder.mesh, slots.decoder.rules):
        step = (params, slots.state, release, np.int32(1), table)
        return {
            "decode": programs.decode.lower(*step, rows=slots.slots),
            "admit": programs.admit.lower(params, slots._prompts(short, [0, 1, 2, 3])),
            "chunk": programs.chunk.lower(
                params, new_cache, prefill.tokens, np.int32(slots.length), np.int32(0), np.int32(0)
            ),
            "insert": programs.insert.lower(slots.state, prefill.cache, slots._long_prompt(prefill, 0), table),
        }


def test_the_serving_fit_lowers_the_engines_own_functions_for_the_engines_shape():
    """The fit builds the shape that the engine's slots build, jits the same module functions, and
    each program it measures lowers to the very program the slots run (the same StableHLO, from
    abstract arguments against the slots' real ones)."""
    assert SERVE_TOP_LOGPROBS == schemas.MAX_LOGPROBS  # the alternatives gptj-serve's slots are built for
    config = tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=96, scan_layers=False)
    params = nn.unbox(GPTJ(config).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    lm = LanguageModel(config, params)
    slots = lm.slots(slots=4, length=64, chunk=16, top_logprobs=3)  # one step a call, as the engine's
    decoder = lm.decoder
    shape = serving_shape(
        decoder.config, lm.mesh, batch=4, cache_len=64, chunk=16, top_logprobs=3, page=decoder.page_columns
    )
    assert shape == slots.shape
    fit = SlotPrograms(shape)
    for name in ("decode", "admit", "chunk", "insert"):
        module_function = getattr(slot_programs, name)
        assert getattr(fit, name).__wrapped__.__wrapped__ is module_function  # jit(with_rules(function))
        assert getattr(slots.programs, name).__wrapped__.__wrapped__ is module_function
    measured, run = lowered_programs(fit, lm.mesh), _engine_lowered(slots, decoder.params)
    assert sorted(measured) == sorted(run)
    for name, lowered in measured.items():
        assert lowered.as_text() == run[name].as_text(), name
