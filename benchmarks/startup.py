"""``bench.py startup``: how long ``gptj-serve`` takes to a healthy ``/health``, and ``gptj-sample`` to its
first token, cold (an empty compilation cache) and then warm (the cache the cold run filled).

A random GPT-J of ``--size`` and a byte-level BPE are written to a temporary directory. Each command
runs as a user runs it (``scripts/serve.py``, ``scripts/sample.py`` in a process of their own), with
``GPTJ_FLAX_CACHE`` naming a directory of the benchmark's that starts empty: one for the server, one
for the sampler, so neither starts with the other's programs. The server's line on its warm-up (how
many programs, how long) is printed with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import BENCH_MODEL, REPO, machine_summary, xla_flags_with_devices
from benchmarks.serve import _free_port, _write_model
from gptj_flax.config import ModelConfig, load_config

SIZES = {
    "tiny": dataclasses.replace(BENCH_MODEL, n_layers=1, d_model=64, n_heads=2, rotary_dim=16, max_len=64),
    "demo": load_config(REPO / "configs" / "demo_cpu.json").model,
    "bench": BENCH_MODEL,
}
# The warm start's goal: at most this share of the cold one.
WARM_SHARE_GOAL = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size",
        choices=SIZES,
        default="demo",
        help="the model: tiny (smoke test), demo (configs/demo_cpu.json's), bench (bench.py serve's 27.3M); "
        "default demo",
    )
    parser.add_argument("--max-batch", type=int, default=32, help="the server's decode slots (default 32)")
    parser.add_argument("--new-tokens", type=int, default=24, help="gptj-sample's --max-new-tokens (default 24)")


def _env(cache: Path) -> dict[str, str]:
    """A user's environment (their XLA flags kept, but one device, as the commands run by default) with
    the benchmark's cache: no suite cache, this checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XLA_FLAGS"] = xla_flags_with_devices(env.get("XLA_FLAGS", ""), None)
    env = {k: v for k, v in env.items() if not k.startswith("JAX_PERSISTENT_CACHE_")}
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": python_path, "GPTJ_FLAX_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def _cached(cache: Path) -> int:
    """Programs in the compilation cache ``cache`` (JAX's directory under it)."""
    directory = cache / "jax"
    return sum(1 for _ in directory.iterdir()) if directory.is_dir() else 0


def _serve(checkpoint: str, cache: Path, max_batch: int, log: Path) -> tuple[float, str]:
    """Seconds from starting gptj-serve to a healthy /health, and its warm-up line (its log, uvicorn's
    access log on stdout included, goes to ``log``)."""
    port = _free_port()
    argv = [sys.executable, str(REPO / "scripts" / "serve.py"), "--checkpoint", checkpoint, "--port", str(port)]
    start = time.perf_counter()
    with open(log, "w") as err:
        process = subprocess.Popen([*argv, "--max-batch", str(max_batch)], env=_env(cache), stdout=err, stderr=err)
        try:
            while process.poll() is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            seconds = time.perf_counter() - start
            if process.poll() is not None:
                raise RuntimeError(f"gptj-serve exited with status {process.returncode}: {log.read_text()[-2000:]}")
        finally:
            process.send_signal(signal.SIGTERM)  # drains (nothing in flight) and exits
            process.wait(120)
    warm_up = [line for line in log.read_text().splitlines() if "warm-up:" in line]
    return seconds, warm_up[-1].split("warm-up:", 1)[1].strip() if warm_up else "(no warm-up line)"


def _sample(checkpoint: str, cache: Path, new_tokens: int) -> float:
    """Seconds from starting gptj-sample to the first byte of its completion on stdout."""
    argv = [sys.executable, str(REPO / "scripts" / "sample.py"), checkpoint, "--prompt", "def main():"]
    argv += ["--max-new-tokens", str(new_tokens), "--temperature", "0", "--ignore-eos"]
    start = time.perf_counter()
    process = subprocess.Popen(argv, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None
    first = process.stdout.read(1)
    seconds = time.perf_counter() - start
    _, err = process.communicate(timeout=600)
    if process.returncode != 0 or not first:
        raise RuntimeError(f"gptj-sample exited with status {process.returncode}: {err.decode()[-2000:]}")
    return seconds


def run(args: argparse.Namespace) -> None:
    if args.max_batch < 1 or args.new_tokens < 1:
        raise SystemExit("error: --max-batch and --new-tokens must be >= 1")
    config: ModelConfig = SIZES[args.size]
    machine = machine_summary()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as directory:
        root = Path(directory)
        model = _write_model(str(root / "model"), config)
        serve, cached = [], []
        for i in (0, 1):
            serve.append(_serve(str(root / "model"), root / "serve-cache", args.max_batch, root / f"serve-{i}.log"))
            cached.append(_cached(root / "serve-cache"))
        sample = [_sample(str(root / "model"), root / "sample-cache", args.new_tokens) for _ in (0, 1)]
    print(machine)
    print(
        f"{model}\ngptj-serve --max-batch {args.max_batch}: start to a healthy /health; gptj-sample --max-new-tokens "
        f"{args.new_tokens}: start to its first token. Cold: an empty compilation cache ($GPTJ_FLAX_CACHE); "
        "warm: the same cache, filled by the cold run\n"
    )
    rows = [("gptj-serve", serve[0][0], serve[1][0]), ("gptj-sample", sample[0], sample[1])]
    print(f"{'command':<12}  {'cold s':>7}  {'warm s':>7}  {'warm/cold':>9}")
    for name, cold, warm in rows:
        print(f"{name:<12}  {cold:7.1f}  {warm:7.1f}  {warm / cold:9.0%}")
    print(f"\nserver warm-up, cold: {serve[0][1]}\nserver warm-up, warm: {serve[1][1]}")
    print(f"server's compilation cache: {cached[0]} programs after the cold start, {cached[1]} after the warm one")
    met = all(warm <= WARM_SHARE_GOAL * cold for _, cold, warm in rows)
    print(f"warm start <= {WARM_SHARE_GOAL:.0%} of the cold one: {'yes' if met else 'no'}")
