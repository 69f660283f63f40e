"""What the benchmarks share: the benchmark model, its HuggingFace twin, machine facts, random HF weights."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from pathlib import Path

import numpy as np

from gptj_flax.config import ModelConfig, jnp_dtype
from gptj_flax.convert import safetensors_io
from gptj_flax.convert.common import atomic_directory, progress
from gptj_flax.convert.hf import DEFAULT_MAX_SHARD_SIZE, hf_config_dict
from gptj_flax.convert.hf_names import hf_names, hf_shape

REPO = Path(__file__).resolve().parent.parent

# The model of the train, sample and serve benchmarks: 27.3M parameters with the embedding and LM
# head. max_len bounds the sample benchmark's prompt + new tokens; the train benchmark sets it to
# its sequence length (rotary positions: the parameter count does not depend on it).
BENCH_MODEL = ModelConfig(
    n_layers=6,
    d_model=512,
    n_heads=8,
    rotary_dim=64,
    vocab_size=8192,
    max_len=512,
    dtype="float32",
    param_dtype="float32",
)


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def xla_flags_with_devices(flags: str, devices: int | None) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with its virtual CPU device count set to ``devices``, or
    removed for None; the user's other flags are kept."""
    kept = re.sub(rf"{DEVICE_COUNT_FLAG}=\S+", "", flags).split()
    return " ".join(kept + ([f"{DEVICE_COUNT_FLAG}={devices}"] if devices is not None else []))


def hf_gptj_config(config: ModelConfig, **overrides):
    """transformers' ``GPTJConfig`` of ``config``'s shape: GPT-J's gelu_new, no dropout, an untied LM head.

    Token ids 0 for bos and eos unless ``overrides`` (any ``GPTJConfig`` field) say otherwise.
    """
    from transformers import GPTJConfig

    fields = dict(
        vocab_size=config.vocab_size,
        n_positions=config.max_len,
        n_embd=config.d_model,
        n_layer=config.n_layers,
        n_head=config.n_heads,
        rotary_dim=config.rotary_dim,
        n_inner=config.d_ff,
        activation_function="gelu_new",
        layer_norm_epsilon=config.layer_norm_eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPTJConfig(**{**fields, **overrides})


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` or ``/proc/cpuinfo`` gives it; the architecture if neither does."""
    try:
        listing = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10, env={**os.environ, "LC_ALL": "C"}
        ).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            listing += "\n" + f.read()
    except OSError:
        pass
    for line in listing.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "model name" and value.strip():
            return value.strip()
    return platform.machine() or "unknown CPU"


def load_average() -> float:
    """The 1-minute load average: how many other processes competed for the cores while measuring."""
    return os.getloadavg()[0]


def machine_summary() -> str:
    return f"machine: {cpu_model()}, {os.cpu_count()} CPUs, load average {load_average():.2f}"


def write_random_hf(
    out: str | os.PathLike,
    config: ModelConfig,
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """A random GPT-J of ``config``'s shape as a HF directory, generated and written tensor by tensor.

    For benchmarks and memory measurements of the converters at sizes no test can hold in memory.
    """
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(jnp_dtype(dtype))
    plan = [(name, hf_shape(name, config), np_dtype) for name in hf_names(config)]
    with atomic_directory(out) as tmp:
        with (
            safetensors_io.ShardedWriter(
                tmp, plan, safetensors_io.parse_size(max_shard_size), metadata={"format": "pt"}
            ) as writer,
            progress(writer.total_bytes, "writing random weights") as bar,
        ):
            for name, shape, _ in plan:
                tensor = rng.standard_normal(shape, dtype=np.float32)
                tensor *= 0.02
                if name.endswith(("ln_1.weight", "ln_f.weight")):
                    tensor += 1.0
                writer.write(name, tensor)
                bar.update(tensor.size * np_dtype.itemsize)
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(config, dtype), indent=2) + "\n")
    return Path(out)
