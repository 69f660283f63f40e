"""``scripts/bench.py launch``: what gptj-launch adds to a multi-host start.

Times a two-process training run of a tiny model (4 CPU devices per process, as two hosts of a
slice) from the moment it is started to its first training step (the step's row in metrics.jsonl),
started two ways: by hand (two processes with the jax.distributed coordinates in their environment,
as tests/multihost_helpers.py does) and by ``gptj-launch --hosts 2`` on a Ray cluster already
running on this machine (127.0.0.1 only). Starting that cluster is timed too: a pod's cluster is
started once, not once per job. The runs alternate, ``--repeats`` of each; medians are printed.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import REPO, machine_summary, xla_flags_with_devices
from gptj_flax import data
from gptj_flax.config import load_config, save_config
from gptj_flax.data.corpus import write_stdlib_corpus

LOCAL_DEVICES = 4
# What a local cluster and its clients need: Ray's loopback-only mode, no usage reports, and a token
# of their own (not one in ~/.ray, which other clusters on the machine may share).
CLUSTER_CODE = """
import sys, ray
context = ray.init(num_cpus=int(sys.argv[1]), include_dashboard=False, log_to_driver=False)
print(context.address_info["gcs_address"], flush=True)
sys.stdin.read()  # until the owner closes it
ray.shutdown()
"""


class LocalCluster:
    """A Ray cluster of one node on 127.0.0.1, owned by this process; ``env`` is what a client needs."""

    def __init__(self, num_cpus: int, env: dict[str, str] | None = None, timeout: float = 300):
        self.env = {
            **(env if env is not None else os.environ),
            "PYTHONPATH": str(REPO),  # this checkout, in the cluster's workers and the programs they start
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's local-only mode: every address is 127.0.0.1
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
        }
        self._proc = subprocess.Popen(
            [sys.executable, "-c", CLUSTER_CODE, str(num_cpus)],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()  # ray.init's own timeout bounds the wait
        if not line.startswith("127.0.0.1:"):
            self.close()
            raise RuntimeError(f"the local Ray cluster did not start (it said {line!r})")
        self.address = line
        self.env["RAY_ADDRESS"] = line

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tiny_run_config(root: pathlib.Path, run_dir: pathlib.Path, total_steps: int) -> str:
    """configs/tiny.json on the standard library's text (a tokenizer trained on it), into ``run_dir``."""
    corpus = root / "corpus"
    if not (corpus / "tokenizer").exists():
        train_txt, _ = write_stdlib_corpus(str(corpus), max_bytes=400_000)
        data.save_tokenizer(data.train_bpe_tokenizer([train_txt], vocab_size=512), str(corpus / "tokenizer"))
    settings = [
        f"train.train_set={corpus / 'train.txt'}",
        f"train.tokenizer={corpus / 'tokenizer'}",
        f"train.run_dir={run_dir}",
        f"train.total_steps={total_steps}",
        f"train.ckpt_every={total_steps}",
    ]
    path = root / f"{run_dir.name}.json"
    save_config(load_config(str(REPO / "configs" / "tiny.json"), settings), path)
    return str(path)


def _first_step(run_dir: pathlib.Path, procs: list[subprocess.Popen], started: float, timeout: float) -> float:
    """Seconds from ``started`` until step 1's row is in ``run_dir/metrics.jsonl``."""
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() - started < timeout:
        if metrics.exists() and any(json.loads(line).get("step") == 1 for line in metrics.read_text().splitlines()):
            return time.monotonic() - started
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"a run exited with status {[p.poll() for p in procs]} before its first step")
        time.sleep(0.05)
    raise RuntimeError(f"no first step within {timeout:.0f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags() -> str:
    """The user's XLA flags for each process, less a device count: JAX_NUM_CPU_DEVICES sets it."""
    return xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), None)


def by_hand(config: str, run_dir: pathlib.Path, log_dir: pathlib.Path, timeout: float) -> float:
    """Two processes started here with the coordinates in their environment, as a user does by hand."""
    port, procs = _free_port(), []
    started = time.monotonic()
    for process in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "XLA_FLAGS": _flags(),
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(LOCAL_DEVICES),
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(process),
        }
        with open(log_dir / f"{run_dir.name}_{process}.log", "w") as log:
            command = [sys.executable, "scripts/train.py", "--config", config, "--no-progress"]
            procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        return _first_step(run_dir, procs, started, timeout)
    finally:
        for proc in procs:
            proc.wait(timeout=timeout)


def launched(cluster: LocalCluster, config: str, run_dir: pathlib.Path, log_dir: pathlib.Path, timeout: float) -> float:
    """``gptj-launch --hosts 2`` (scripts/launch.py) on the running cluster."""
    started = time.monotonic()
    command = [sys.executable, "scripts/launch.py", "--hosts", "2", "--env", f"XLA_FLAGS={_flags()}"]
    command += ["--env", "JAX_PLATFORMS=cpu"]
    command += ["--env", f"JAX_NUM_CPU_DEVICES={LOCAL_DEVICES}", "train", "--config", config, "--no-progress"]
    with open(log_dir / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=cluster.env, stdout=log, stderr=subprocess.STDOUT)
    try:
        return _first_step(run_dir, [proc], started, timeout)
    finally:
        proc.wait(timeout=timeout)


def add_arguments(parser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way (default 3); medians are printed")
    parser.add_argument("--steps", type=int, default=2, help="steps of each run (default 2; the first is timed)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take to its first step")


def run(args) -> None:
    if args.repeats < 1 or args.steps < 2:  # step 1's row is written when step 2 starts
        raise SystemExit(f"error: --repeats must be >= 1 and --steps >= 2; got {args.repeats} and {args.steps}")
    print(machine_summary())
    hand, ray_launch = [], []
    with tempfile.TemporaryDirectory(prefix="bench_launch_") as tmp:
        root = pathlib.Path(tmp)
        start = time.monotonic()
        with LocalCluster(num_cpus=2 * 2) as cluster:
            cluster_s = time.monotonic() - start
            for repeat in range(args.repeats):
                for way, times in (("hand", hand), ("launch", ray_launch)):
                    run_dir = root / f"{way}_{repeat}"
                    config = tiny_run_config(root, run_dir, args.steps)
                    measure = by_hand if way == "hand" else lambda *a: launched(cluster, *a)
                    times.append(measure(config, run_dir, root, args.timeout))
    hand_s, launch_s = statistics.median(hand), statistics.median(ray_launch)
    print(
        f"start to first training step, 2 processes x {LOCAL_DEVICES} CPU devices, configs/tiny.json, median of {args.repeats}:"
    )
    print(f"  by hand (two processes)     {hand_s:8.2f} s")
    print(f"  gptj-launch --hosts 2       {launch_s:8.2f} s   ({launch_s / hand_s:.2f}x, +{launch_s - hand_s:.2f} s)")
    print(f"  starting the Ray cluster    {cluster_s:8.2f} s   (once per cluster, not per job)")
