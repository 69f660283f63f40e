"""``bench.py sample``: KV-cache generation speed against HuggingFace PyTorch on the same weights.

Both sides run the same float32 GPT-J with the same random weights (HuggingFace's initialisation,
copied into ours), greedy decoding with the KV cache, no EOS, on the CPU; with ``--top-k`` /
``--top-p``, sampling at temperature 1 with those filters instead. Measured, warm (after
compilation), best of ``--repeats`` runs, PyTorch in a process of its own:

* prefill latency: prompt in → first new token out (HF: ``generate(max_new_tokens=1)``);
* decode tokens/s: the remaining ``new_tokens - 1`` tokens of every row, per second;

at each batch size, plus the time from ``gptj_flax.load()`` of an Orbax checkpoint to the first
generated token (cold: restore, compile, prefill). With ``--quantize int8`` the same weights
quantised to int8 (block projections, a scale per output channel) decode too, in the same run,
beside float32 and against their own bound (one byte per block-projection weight read); with
``--kv-cache int8`` the float32 weights decode with an int8 KV cache too (one byte per cached
entry and a float32 scale per head read).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import multiprocessing
import os
import tempfile
import time

import jax
import numpy as np

from benchmarks import bounds, profile
from benchmarks.common import BENCH_MODEL, hf_gptj_config, load_average, machine_summary
from gptj_flax.checkpoint import Checkpointer
from gptj_flax.config import KV_CACHE_DTYPES, QUANTIZATIONS, Config
from gptj_flax.convert.hf_names import params_from_hf
from gptj_flax.convert.quantize import quantize_params
from gptj_flax.sampling import load
from gptj_flax.sampling.api import LanguageModel
from gptj_flax.sampling.samplers import Sampling, SamplingError, SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes (default 1,16)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens (default 64)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (default 128)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the best is reported")
    parser.add_argument("--torch-threads", type=int, default=2, help="PyTorch intra-op threads (default 2)")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=None,
        help="also decode with the weights quantised to int8 and print its tokens/s beside float32's",
    )
    parser.add_argument(
        "--kv-cache",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="also decode with the KV cache in int8 (float32 weights) and print its tokens/s beside float32's",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="sample at temperature 1 keeping the k most likely tokens, on both sides (default: greedy)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample at temperature 1 from the nucleus of mass p, on both sides (default: greedy); with "
        "--top-k 50 --top-p 0.9, the docker API's defaults",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also trace one decode run per batch size with jax.profiler and print where a step's time goes",
    )


def _hf_model(config):
    """A random HuggingFace GPT-J of ``config``'s shape (HF's own initialisation), greedy without EOS."""
    import torch
    from transformers import GPTJForCausalLM

    torch.manual_seed(0)
    hf_config = hf_gptj_config(config, eos_token_id=None, pad_token_id=0)
    return _without_eos(GPTJForCausalLM(hf_config).float().eval())


def _without_eos(model):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _filters(args) -> dict:
    """The sampling settings of ``--top-k`` / ``--top-p`` (empty: greedy), as both sides name them."""
    chosen = {"top_k": args.top_k, "top_p": args.top_p}
    return {name: value for name, value in chosen.items() if value is not None}


def _describe(filters: dict) -> str:
    if not filters:
        return "greedy"
    return "sampled at temperature 1 with " + " and ".join(
        f"{name.replace('_', '-')} {v}" for name, v in filters.items()
    )


def _ours(lm, prompts: np.ndarray, new_tokens: int, filters: dict | None = None):
    """(first token only, all tokens) as callables on our side: greedy, or sampled with ``filters``."""
    batch = len(prompts)
    settings = {"temperature": 1.0, **filters} if filters else {"temperature": 0.0}
    kwargs = dict(
        sampling=SamplingParams.build(batch, **settings),
        seeds=np.zeros(batch, np.uint32),
        eos_id=np.full(batch, -1, np.int32),
    )

    def prefill():
        return lm.decoder.start(list(prompts), max_new_tokens=np.full(batch, new_tokens), **kwargs)

    def full():
        run = prefill()
        run.advance(new_tokens)
        assert int(run.progress.num_generated.min()) == new_tokens

    return prefill, full


def _huggingface(model, prompts: np.ndarray, new_tokens: int, filters: dict | None = None):
    """(first token only, all tokens) as callables on HuggingFace's side: greedy, or sampled with ``filters``."""
    import torch

    ids = torch.from_numpy(prompts.astype(np.int64))
    mask = torch.ones_like(ids)
    # generate's own defaults would add top-k 50 to any sampling: every filter is named
    sampling = (
        {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, **filters}
        if filters
        else {"do_sample": False}
    )

    def generate(n):
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                use_cache=True,
                **sampling,
            )
        assert out.shape[1] == ids.shape[1] + n

    return lambda: generate(1), lambda: generate(new_tokens)


def _best_times(functions, repeats: int) -> list[float]:
    """Best of ``repeats`` wall times of each function, run in turns after one warm-up call each.

    The best time is the one least disturbed by other processes on the machine (PyTorch's thread
    pool in particular slows down many-fold whenever the cores are shared).
    """
    for fn in functions:
        fn()
    best = [float("inf")] * len(functions)
    for _ in range(repeats):
        for i, fn in enumerate(functions):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _huggingface_times(
    model_dir: str,
    prompt_ids: np.ndarray,
    batch_sizes: list[int],
    new_tokens: int,
    repeats: int,
    threads: int,
    filters: dict,
) -> list[list[float]]:
    """(prefill, full generation) best times per batch size, in a process of its own.

    A fresh process keeps the two runtimes' thread pools apart: threads of one still spinning
    after its last operation would otherwise take cores from the other.
    """
    import torch
    from transformers import GPTJForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    model = _without_eos(GPTJForCausalLM.from_pretrained(model_dir).float().eval())
    return [
        _best_times(list(_huggingface(model, prompt_ids[:batch], new_tokens, filters)), repeats)
        for batch in batch_sizes
    ]


def _load_to_first_token(config, params, prompt: list[int]) -> float:
    with tempfile.TemporaryDirectory() as directory:
        ckpt = Checkpointer(directory)
        ckpt.save(0, params=params, config=Config(model=config))
        ckpt.close()
        start = time.perf_counter()
        lm = load(directory)
        lm.generate(prompt, max_new_tokens=1, temperature=0.0)
        return time.perf_counter() - start


def _print_profiles(lm, prompt_ids, batch_sizes, ours, new_tokens: int, filters: dict) -> None:
    """One traced decode run per batch size: operation time per part of a step (see benchmarks/profile.py)."""
    threads = len(os.sched_getaffinity(0))
    print("\nwhere a decode step's time goes (one jax.profiler trace per batch; operation ms per step):")
    for batch, (prefill_s, full_s) in zip(batch_sizes, ours):
        start, _ = _ours(lm, prompt_ids[:batch], new_tokens, filters)
        decode = start()
        rows = profile.profile(functools.partial(decode.advance, new_tokens), decode.decode_hlo(), new_tokens - 1)
        print(f"  batch {batch}:")
        print(profile.format_rows(rows, (full_s - prefill_s) / (new_tokens - 1) * 1e3, threads))


def _print_variant(args, title, name, variant_config, batch_sizes, rows, variant_times, context, read, ceiling) -> bool:
    """A variant's (int8 weights, int8 KV cache) decode tokens/s beside float32's, each against its own bound."""
    print(f"\n{title}, same prompts and decoding:")
    header = ("batch", "decode tok/s float32", f"decode tok/s {name}", "ratio", "bound tok/s", "% of bound")
    body = []
    for batch, row, (prefill, full) in zip(batch_sizes, rows, variant_times):
        tps = batch * (args.new_tokens - 1) / (full - prefill)
        bound = bounds.decode_bound(variant_config, batch, context, read.bytes_per_s, ceiling, reads=read.where)
        body.append(
            (
                str(batch),
                f"{row[1]:,.0f}",
                f"{tps:,.0f}",
                f"{tps / row[1]:.2f}x",
                f"{bound.tokens_per_s:,.0f} ({bound.limit})",
                bounds.share(tps, bound),
            )
        )
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    for line in (header, ["-" * w for w in widths], *body):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    print(f"(ratio: how many times faster {name} is than float32; its bound reads at float32's measured speed)")
    return any(r[-1] == bounds.FAILED for r in body)


def run(args: argparse.Namespace) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if min(batch_sizes) < 1 or args.new_tokens < 2 or args.repeats < 1:
        raise SystemExit("error: batch sizes and --repeats must be >= 1, --new-tokens >= 2")
    if args.prompt_tokens < 1 or args.prompt_tokens + args.new_tokens > BENCH_MODEL.max_len:
        raise SystemExit(f"error: need 1 <= --prompt-tokens and prompt + new tokens <= {BENCH_MODEL.max_len}")
    filters = _filters(args)
    try:
        Sampling(temperature=1.0, **filters)
    except SamplingError as e:
        raise SystemExit(f"error: {e}") from None
    torch.set_num_threads(args.torch_threads)
    hf_logging.disable_progress_bar()  # keep the report readable
    config = BENCH_MODEL
    hf = _hf_model(config)
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    params = params_from_hf(state, config)
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(0, config.vocab_size, size=(max(batch_sizes), args.prompt_tokens))

    print(machine_summary())
    print(
        f"model: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads, rotary "
        f"{config.rotary_dim}, vocab {config.vocab_size}: {config.param_count() / 1e6:.1f}M parameters, float32"
    )
    print(
        f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens per row, {_describe(filters)}, KV cache on both sides; "
        f"jax {jax.__version__} on one {jax.devices()[0].platform} device, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads; best of {args.repeats}\n"
    )

    load_before = load_average()
    cold = _load_to_first_token(config, params, list(prompt_ids[0]))
    lm = LanguageModel(config, params)
    ours = [
        _best_times(list(_ours(lm, prompt_ids[:batch], args.new_tokens, filters)), args.repeats)
        for batch in batch_sizes
    ]
    if args.quantize:
        int8_config, int8_params = quantize_params(params, config)
        int8_lm = LanguageModel(int8_config, int8_params)
        int8_times = [
            _best_times(list(_ours(int8_lm, prompt_ids[:batch], args.new_tokens, filters)), args.repeats)
            for batch in batch_sizes
        ]
    if args.kv_cache:
        kv_config = dataclasses.replace(config, kv_cache=args.kv_cache)
        kv_lm = LanguageModel(kv_config, params)
        kv_times = [
            _best_times(list(_ours(kv_lm, prompt_ids[:batch], args.new_tokens, filters)), args.repeats)
            for batch in batch_sizes
        ]
    with tempfile.TemporaryDirectory() as model_dir:
        hf.save_pretrained(model_dir)
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            theirs = pool.apply(
                _huggingface_times,
                (model_dir, prompt_ids, batch_sizes, args.new_tokens, args.repeats, args.torch_threads, filters),
            )
    read = bounds.decode_read_speed(config)
    ceilings = {config.dtype: bounds.matmul_ceiling(config.dtype)}
    context = args.prompt_tokens + args.new_tokens / 2  # the mean number of cached tokens a decode step reads
    rows = []
    for batch, (ours_prefill, ours_full), (hf_prefill, hf_full) in zip(batch_sizes, ours, theirs):
        decoded = batch * (args.new_tokens - 1)
        ours_tps, hf_tps = decoded / (ours_full - ours_prefill), decoded / (hf_full - hf_prefill)
        bound = bounds.decode_bound(config, batch, context, read.bytes_per_s, ceilings[config.dtype], reads=read.where)
        rows.append((batch, ours_tps, hf_tps, ours_prefill, hf_prefill, bound))

    header = (
        "batch",
        "decode tok/s gptj_flax",
        "decode tok/s torch",
        "ratio",
        "bound tok/s",
        "gptj_flax % of bound",
        "torch % of bound",
        "prefill ms gptj_flax",
        "prefill ms torch",
        "ratio",
    )
    body = [
        (
            str(b),
            f"{o:,.0f}",
            f"{h:,.0f}",
            f"{o / h:.2f}x",
            f"{bound.tokens_per_s:,.0f} ({bound.limit})",
            bounds.share(o, bound),
            bounds.share(h, bound),
            f"{op * 1e3:.1f}",
            f"{hp * 1e3:.1f}",
            f"{hp / op:.2f}x",
        )
        for b, o, h, op, hp, bound in rows
    ]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    for line in (header, ["-" * w for w in widths], *body):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    print("\n(ratio: how many times faster gptj_flax is)")
    failed = any(bounds.FAILED in (r[5], r[6]) for r in body)
    if args.quantize:
        title = (
            f"{args.quantize} weights (block projections {args.quantize}, a float32 scale per output channel; "
            "embedding, head and compute float32)"
        )
        failed |= _print_variant(
            args,
            title,
            args.quantize,
            int8_config,
            batch_sizes,
            rows,
            int8_times,
            context,
            read,
            ceilings[config.dtype],
        )
    if args.kv_cache:
        title = f"{args.kv_cache} KV cache (a float32 scale per cached key and value vector; weights float32)"
        name = f"{args.kv_cache} cache"
        failed |= _print_variant(
            args, title, name, kv_config, batch_sizes, rows, kv_times, context, read, ceilings[config.dtype]
        )
    if failed:
        print(bounds.FAILED_WHY)
    print(f"bounds, measured in this process (decode steps read {context:.0f} cached tokens on average):")
    print(bounds.describe_limits(read, ceilings))
    print(
        "  a decode step at batch B reads every matmul weight, B embeddings and B K/V caches, and does"
        " 2 FLOPs per weight per row plus attention; its bound is the longer of the two at the limits above"
    )
    if args.profile:
        _print_profiles(lm, prompt_ids, batch_sizes, ours, args.new_tokens, filters)
    print(f"gptj_flax load() of an Orbax checkpoint to first token (restore + compile + prefill): {cold:.2f} s")
    # Both sides share the machine's cores: other processes running at the same time skew the ratios.
    print(f"load average before / after: {load_before:.2f} / {load_average():.2f}")
