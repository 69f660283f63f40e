"""``scripts/bench.py train``: our train step against HuggingFace PyTorch's on the same config.

Both sides run one optimiser step per batch (forward, backward, clip to norm 1, AdamW) in float32
on the same weights and tokens; the figures are tokens/s measured side by side in one process,
plus achieved FLOP/s against a large matmul timed in the same run (the machine's practical ceiling).

With ``--profile`` it also traces one step (operation time by part of the model) and times the
step's parts as programs of their own, forward and backward, each against the ceiling: one block,
the LM head with the loss, and the optimiser update. What the step takes beyond the sum of its
parts is the cost of running them as one program (and the embedding and gradient clipping).
"""

from __future__ import annotations

import dataclasses
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import profile
from benchmarks.common import BENCH_MODEL, hf_gptj_config, machine_summary
from gptj_flax import partitioning
from gptj_flax.config import Config, ModelConfig, TrainConfig
from gptj_flax.data import Batch
from gptj_flax.losses import chunked_loss_sums
from gptj_flax.model import GPTJ, Block, attention_mask, rotary_tables
from gptj_flax.training import TrainSetup, optimizer


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def matmul_flops(n: int = 2048, repeats: int = 5) -> tuple[float, float]:
    """FLOP/s of an n×n float32 matmul in JAX and in torch (the machine's practical peak)."""
    import torch

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    jax_s = _timed(lambda: mm(a).block_until_ready(), repeats)
    t = torch.randn(n, n)
    torch_s = _timed(lambda: t @ t, repeats)
    return 2 * n**3 / jax_s, 2 * n**3 / torch_s


def ours(
    config: ModelConfig, tokens: np.ndarray, repeats: int, mesh_shape=(1, 1, 1), traced: bool = False
) -> tuple[float, list[profile.Row] | None]:
    """(seconds per step, and with ``traced`` where one step's operation time goes)."""
    train = TrainConfig(batch_size=tokens.shape[0], warmup_steps=0, lr=1e-4, end_lr=1e-4)
    setup = TrainSetup.build(Config(model=config, train=train), partitioning.make_mesh(mesh_shape))
    step, _ = setup.compile()
    rows = tokens[None]  # one micro-batch: [1, B, T+1]
    batch = Batch(rows, np.ones_like(rows), np.ones(rows[..., 1:].shape, np.float32))
    holder = {"state": setup.init_state()}

    def run():
        holder["state"], metrics = step(holder["state"], batch)
        jax.block_until_ready(metrics)

    with partitioning.sharding_scope(setup.mesh):
        seconds = _timed(run, repeats)
        if not traced:
            return seconds, None
        hlo = step.lower(holder["state"], batch).compile().as_text()
        return seconds, profile.profile(run, hlo, calls=1)


@dataclasses.dataclass(frozen=True)
class Part:
    """A part of the train step, timed as a program of its own (forward and backward)."""

    name: str
    seconds: float  # median of the repeats, as the whole step is timed
    flops: float  # 0 where the part does no matmul work
    count: int = 1  # how many times the step runs it


def parts(config: ModelConfig, batch: int, seq_len: int, repeats: int) -> list[Part]:
    """The train step's parts, each compiled and run on its own, forward and backward: one block
    (run by every layer), the LM head with the loss, the optimiser update."""
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(batch, seq_len, config.d_model)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=hidden.shape), jnp.float32)
    sin, cos = rotary_tables(jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len)), config.rotary_dim)
    mask = attention_mask(jnp.ones((batch, seq_len), jnp.int32))
    block = Block(config)
    block_params = nn.meta.unbox(block.init(jax.random.key(0), hidden, sin, cos, mask))

    def block_loss(p, h):
        return jnp.sum(block.apply(p, h, sin, cos, mask)[0] * cotangent)

    block_grad = jax.jit(jax.grad(block_loss, argnums=(0, 1)))
    head = {
        "kernel": jnp.asarray(rng.normal(size=(config.d_model, config.vocab_size)) * 0.02, jnp.float32),
        "bias": jnp.zeros((config.vocab_size,), jnp.float32),
    }
    targets = jnp.asarray(rng.integers(0, config.vocab_size, (batch, seq_len)), jnp.int32)
    weights = jnp.ones((batch, seq_len), jnp.float32)

    def head_loss(h, p):
        return chunked_loss_sums(h, p, targets, weights)[0]

    head_grad = jax.jit(jax.value_and_grad(head_loss, argnums=(0, 1)))
    train = TrainConfig(batch_size=batch, warmup_steps=0, lr=1e-4, end_lr=1e-4)
    tx = optimizer.make_optimizer(train)
    params = nn.meta.unbox(GPTJ(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    opt_state = tx.init(params)

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # the step's own FLOP count (the figure its ceiling share is of), split into the head and the layers
    tokens = batch * seq_len
    head_flops = 6.0 * tokens * config.d_model * config.vocab_size
    block_flops = (tokens * config.flops_per_token(seq_len) - head_flops) / config.n_layers
    return [
        Part(
            "one block",
            _timed(lambda: jax.block_until_ready(block_grad(block_params, hidden)), repeats),
            block_flops,
            config.n_layers,
        ),
        Part("LM head + loss", _timed(lambda: jax.block_until_ready(head_grad(hidden, head)), repeats), head_flops),
        Part("optimiser update", _timed(lambda: jax.block_until_ready(update(params, opt_state, params)), repeats), 0),
    ]


def huggingface(config: ModelConfig, tokens: np.ndarray, repeats: int) -> float:
    import torch
    from transformers import GPTJForCausalLM

    hf = GPTJForCausalLM(hf_gptj_config(config)).float().train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    ids = torch.from_numpy(tokens.astype(np.int64))

    def run():
        opt.zero_grad(set_to_none=True)
        loss = hf(ids[:, :-1], labels=ids[:, :-1]).loss  # HF shifts internally: T predictions of T tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()

    return _timed(run, repeats)


def measure(
    batch_size: int = 8,
    seq_len: int = 256,
    repeats: int = 5,
    threads: int | None = None,
    config: ModelConfig = BENCH_MODEL,
    matmul_size: int = 2048,
    traced: bool = False,
) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    config = dataclasses.replace(config, max_len=seq_len)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch_size, seq_len + 1)).astype(np.int32)
    n_tokens = batch_size * seq_len
    flops = config.flops_per_token(seq_len) * n_tokens
    jax_mm, torch_mm = matmul_flops(matmul_size)
    ours_s, rows = ours(config, tokens, repeats, traced=traced)
    step_parts = parts(config, batch_size, seq_len, repeats) if traced else None
    hf_s = huggingface(config, tokens, repeats)
    return {
        "params": config.param_count(),
        "batch": batch_size,
        "seq_len": seq_len,
        "matmul_size": matmul_size,
        "ours_tokens_per_s": n_tokens / ours_s,
        "hf_tokens_per_s": n_tokens / hf_s,
        "speedup": hf_s / ours_s,
        "ours_flops": flops / ours_s,
        "hf_flops": flops / hf_s,
        "jax_matmul_flops": jax_mm,
        "flops_per_token": config.flops_per_token(seq_len),
        "torch_matmul_flops": torch_mm,
        "profile": rows,
        "parts": step_parts,
    }


def report(r: dict) -> str:
    g = 1e9
    traced = []
    if r.get("profile"):
        threads = len(os.sched_getaffinity(0))
        step_ms = r["batch"] * r["seq_len"] / r["ours_tokens_per_s"] * 1e3
        traced = [
            "where gptj_flax's step goes (one jax.profiler trace; operation ms per step):",
            profile.format_rows(r["profile"], step_ms, threads),
        ]
    if r.get("parts"):
        ceiling, step_ms = r["jax_matmul_flops"], r["batch"] * r["seq_len"] / r["ours_tokens_per_s"] * 1e3
        traced.append("the step's parts compiled on their own, forward and backward (median of the repeats):")
        for part in r["parts"]:
            rate = part.flops / part.seconds
            share = f", {rate / 1e9:.1f} GFLOP/s = {100 * rate / ceiling:.0f}% of the ceiling" if part.flops else ""
            count = f" (x{part.count}: {part.count * part.seconds * 1e3:.0f} ms)" if part.count > 1 else ""
            traced.append(f"    {part.name}: {part.seconds * 1e3:.1f} ms{count}{share}")
        total = sum(part.count * part.seconds for part in r["parts"]) * 1e3
        traced.append(
            f"    their sum {total:.0f} ms against the step's {step_ms:.0f} ms: {step_ms - total:.0f} ms for the"
            " embedding, gradient clipping and running the parts as one program"
        )
    return "\n".join(
        [
            f"train step, {r['params'] / 1e6:.1f}M-parameter GPT-J, batch {r['batch']} x {r['seq_len']} tokens, float32, AdamW",
            f"  matmul ceiling ({r['matmul_size']}^3 f32):  jax {r['jax_matmul_flops'] / g:7.1f} GFLOP/s   torch {r['torch_matmul_flops'] / g:7.1f} GFLOP/s",
            f"  gptj_flax       {r['ours_tokens_per_s']:9.0f} tokens/s   {r['ours_flops'] / g:7.1f} GFLOP/s "
            f"({100 * r['ours_flops'] / r['jax_matmul_flops']:.0f}% of jax matmul)",
            f"  HF PyTorch      {r['hf_tokens_per_s']:9.0f} tokens/s   {r['hf_flops'] / g:7.1f} GFLOP/s "
            f"({100 * r['hf_flops'] / r['torch_matmul_flops']:.0f}% of torch matmul)",
            f"  bound (every FLOP at jax's matmul ceiling): {r['jax_matmul_flops'] / r['flops_per_token']:,.0f} tokens/s;"
            f" gptj_flax reaches {100 * r['ours_flops'] / r['jax_matmul_flops']:.0f}%",
            f"  speed-up gptj_flax / PyTorch: {r['speedup']:.2f}x",
            *traced,
        ]
    )


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per side (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--matmul-size", type=int, default=2048, help="n of the n x n matmul timed as the ceiling")
    parser.add_argument(
        "--profile", action="store_true", help="also trace one of our steps and print where its time goes"
    )


def run(args) -> None:
    if min(args.batch, args.seq_len, args.repeats, args.matmul_size) < 1:
        raise SystemExit("--batch, --seq-len, --repeats and --matmul-size must be >= 1")
    print(machine_summary())
    print(
        report(
            measure(
                args.batch, args.seq_len, args.repeats, args.threads, matmul_size=args.matmul_size, traced=args.profile
            )
        )
    )
