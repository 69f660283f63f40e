"""``bench.py device``: train-step tokens/s and MFU with each attention backend the platform has,
and cached-decoding tokens/s at batch 1 and 16, on whatever JAX's default device is.

On a GPU or TPU it runs a ~1B-parameter GPT-J (head_dim 256 as GPT-J's) in bfloat16 at 2048
tokens, its train step sharded FSDP over every local device; on a CPU a small config, so the
command also runs in the test suite. It prints a line before each compile, so a slow compile shows
where the time goes. MFU is model FLOPs (6N + attention) per second over the devices' peak from
``gptj_flax.training.metrics.CHIP_PEAKS``.

Decoding always runs the XLA attention (the cached paths do on every backend), so it is measured
once, on one device.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import machine_summary
from gptj_flax import partitioning
from gptj_flax.config import Config, ModelConfig, TrainConfig
from gptj_flax.data import Batch
from gptj_flax.model import GPTJ, KVCache
from gptj_flax.training import TrainSetup
from gptj_flax.training.metrics import chip_peak

# ~1.0B parameters: 16 layers of d_model 2048 with 8 heads of 256, GPT-J's vocabulary.
ACCELERATOR_MODEL = ModelConfig(
    n_layers=16, d_model=2048, n_heads=8, rotary_dim=64, vocab_size=50400, max_len=2048, dtype="bfloat16"
)
CPU_MODEL = ModelConfig(n_layers=2, d_model=256, n_heads=2, rotary_dim=32, vocab_size=512, max_len=128, dtype="float32")

# The fused backends worth measuring per platform (XLA is always measured).
FUSED = {"tpu": ("splash",), "gpu": ("cudnn",), "cpu": ()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", help="comma-separated attention backends (default: xla + the platform's kernel)")
    parser.add_argument(
        "--batch-per-device", type=int, default=None, help="train sequences per device (TPU/GPU 4, CPU 2)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="train sequence length (default: the model's max_len)"
    )
    parser.add_argument(
        "--remat", default=None, help="remat policy of the train step (TPU/GPU dots_no_batch, CPU none)"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed train steps per backend (median reported)")
    parser.add_argument("--decode-batches", default="1,16", help="decode batch sizes (default 1,16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="decode steps timed (TPU/GPU 128, CPU 8)")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _progress(message: str) -> None:
    print(f"  .. {message}", flush=True)


def _median_seconds(fn, repeats: int) -> float:
    fn()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def train_tokens_per_s(config: ModelConfig, batch: int, seq_len: int, repeats: int) -> float:
    train = TrainConfig(batch_size=batch, seq_len=seq_len, warmup_steps=0, lr=1e-5, end_lr=1e-5)
    setup = TrainSetup.build(Config(model=config, train=train), partitioning.make_mesh((1, -1, 1)))
    step, _ = setup.compile()
    # one micro-batch: [1, B, T+1]
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, batch, seq_len + 1)).astype(np.int32)
    data = jax.device_put(
        Batch(tokens, np.ones_like(tokens), np.ones((1, batch, seq_len), np.float32)), setup.train_sharding
    )
    holder = {"state": setup.init_state()}

    def run():
        holder["state"], metrics = step(holder["state"], data)
        jax.block_until_ready(metrics)

    with partitioning.sharding_scope(setup.mesh):
        return batch * seq_len / _median_seconds(run, repeats)


def decode_tokens_per_s(config: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Greedy cached decoding on one device: ``new_tokens`` steps after a prefill, tokens/s of the steps."""
    config = dataclasses.replace(config, scan_layers=False, remat_policy="none")
    model = GPTJ(config)
    params = jax.jit(lambda key: nn.meta.unbox(model.init(key, jnp.zeros((1, 1), jnp.int32)))["params"])(
        jax.random.key(0)
    )

    def apply(params, tokens, positions, cache):
        logits, cache = model.apply(
            {"params": params}, tokens, positions, None, cache, last_logits_only=True, method=GPTJ.decode
        )
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

    @jax.jit
    def prefill(params, prompt):
        return apply(params, prompt, None, KVCache.empty(config, batch, prompt_len + new_tokens + 1))

    @jax.jit
    def generate(params, token, cache):
        def body(i, carry):
            token, cache = carry
            return apply(params, token, jnp.full((batch, 1), prompt_len + i, jnp.int32), cache)

        return jax.lax.fori_loop(0, new_tokens, body, (token, cache))[0]

    prompt = np.random.default_rng(1).integers(0, config.vocab_size, (batch, prompt_len)).astype(np.int32)
    token, cache = prefill(params, prompt)
    seconds = _median_seconds(lambda: generate(params, token, cache).block_until_ready(), 2)
    return batch * new_tokens / seconds


def run(args) -> None:
    device = jax.devices()[0]
    platform, n_devices = device.platform, jax.device_count()
    accelerator = platform in ("tpu", "gpu")
    base = ACCELERATOR_MODEL if accelerator else CPU_MODEL
    seq_len = args.seq_len or base.max_len
    remat = args.remat or ("dots_no_batch" if accelerator else "none")
    per_device = args.batch_per_device or (4 if accelerator else 2)
    new_tokens = args.new_tokens or (128 if accelerator else 8)
    backends = args.backends.split(",") if args.backends else ["xla", *FUSED.get(platform, ())]
    decode_batches = [int(b) for b in args.decode_batches.split(",")]
    if min(seq_len, per_device, new_tokens, args.steps, *decode_batches) < 1:
        raise SystemExit("--seq-len, --batch-per-device, --new-tokens, --steps and --decode-batches must be >= 1")
    base = dataclasses.replace(base, max_len=max(seq_len, base.max_len), remat_policy=remat)
    peak = chip_peak(device.device_kind)

    print(machine_summary())
    print(
        f"device: {n_devices} x {device.device_kind} ({platform}); peak "
        + (f"{peak.flops / 1e12:.0f} TFLOP/s, {peak.hbm_bandwidth / 1e9:.0f} GB/s each" if peak else "unknown: no MFU")
    )
    print(
        f"model: {_count(base.param_count())} parameters, {base.n_layers} layers, d_model {base.d_model}, "
        f"{base.n_heads} heads of {base.head_dim}, {base.dtype}; train batch {per_device * n_devices} x {seq_len} "
        f"tokens (FSDP over {n_devices}), remat {remat}"
    )
    print("train step (forward, backward, AdamW):", flush=True)
    for name in backends:
        config = dataclasses.replace(base, attention=name)
        _progress(f"compiling and timing the train step with attention={name}")
        tokens_per_s = train_tokens_per_s(config, per_device * n_devices, seq_len, args.steps)
        flops = config.flops_per_token(seq_len) * tokens_per_s
        mfu = f"MFU {100 * flops / (peak.flops * n_devices):5.1f}%" if peak else "MFU n/a"
        print(
            f"  attention {name:<7} {tokens_per_s:12,.0f} tokens/s   {flops / 1e9:10,.1f} GFLOP/s   {mfu}", flush=True
        )
    prompt_len = min(128, seq_len)
    print(
        f"cached decoding (XLA attention on every backend), prompt {prompt_len}, {new_tokens} new tokens, one device:"
    )
    for batch in decode_batches:
        _progress(f"compiling and timing decoding at batch {batch}")
        print(
            f"  batch {batch:>3}  {decode_tokens_per_s(base, batch, prompt_len, new_tokens):12,.1f} tokens/s",
            flush=True,
        )
