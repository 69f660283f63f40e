"""``scripts/bench.py``: every benchmark runs from any directory, at its smallest sizes, and prints its
table; and the input pipeline benchmark's figures."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from benchmarks import sample
from benchmarks.data import benchmark_pipeline
from tests import commands

NUMBER = r"[\d,]+(?:\.\d+)?"
SHARE = r"(?:\d+%|failed)"  # of a bound: a figure over its bound is a failed measurement, never a share
LIMIT = r"(?:cache|memory|compute)"


def bench(repo_root, cwd, *args: str, quick_compile: bool = True) -> str:
    """``python scripts/bench.py ARGS`` as a user runs it: from ``cwd``, no PYTHONPATH, no test device
    count. The tests' one XLA flag stays unless ``quick_compile`` is False (every process the benchmark
    starts inherits it): these runs check what the benchmark prints, not how fast the programs are,
    and most of their time is compiling."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "XLA_FLAGS")}
    flags = {"XLA_FLAGS": commands.QUICK_COMPILE} if quick_compile else {}
    done = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "bench.py"), *args],
        cwd=cwd,
        env={**env, **flags, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.startswith("machine: "), done.stdout
    return done.stdout


def figure(pattern: str, out: str) -> float:
    match = re.search(pattern, out, re.MULTILINE)
    if not match:
        print(out)  # whole, under "Captured stdout": the assertion's message cuts a long output short
    assert match, (pattern, out)
    return float(match.group(1).replace(",", ""))


@pytest.mark.slow  # scripts/bench.py in a process of its own, as a user runs it
def test_train_benchmark(repo_root, tmp_path):
    out = bench(
        repo_root,
        tmp_path,
        "train",
        "--batch",
        "1",
        "--seq-len",
        "8",
        "--repeats",
        "1",
        "--threads",
        "1",
        "--matmul-size",
        "64",
        "--profile",
        # Its profile sorts the optimised program's operations into the model's parts: under the quick
        # flag one CI run's table had no row for the MLP's matmuls, which no run without it missed.
        quick_compile=False,
    )
    assert "train step, 27.3M-parameter GPT-J, batch 1 x 8 tokens, float32, AdamW" in out
    assert figure(rf"matmul ceiling \(64\^3 f32\):\s+jax\s+({NUMBER}) GFLOP/s", out) > 0
    assert figure(rf"gptj_flax\s+({NUMBER}) tokens/s", out) > 0
    assert figure(rf"HF PyTorch\s+({NUMBER}) tokens/s", out) > 0
    assert figure(rf"speed-up gptj_flax / PyTorch: ({NUMBER})x", out) > 0
    assert figure(rf"bound \(every FLOP at jax's matmul ceiling\): ({NUMBER}) tokens/s; gptj_flax reaches", out) > 0
    assert "where gptj_flax's step goes" in out
    assert figure(rf"^\s+optimiser\s+other\s+{NUMBER}\s+({NUMBER})\s+{NUMBER}%$", out) > 0
    assert figure(rf"^\s+MLP\s+matmul\s+{NUMBER}\s+({NUMBER})\s+{NUMBER}%$", out) > 0
    assert "the step's parts compiled on their own" in out
    for part in ("one block", "LM head \\+ loss", "optimiser update"):
        assert figure(rf"^\s+{part}: ({NUMBER}) ms", out) > 0
    assert figure(rf"their sum ({NUMBER}) ms against the step's {NUMBER} ms", out) > 0


@pytest.mark.slow  # scripts/bench.py in a process of its own, writing and reading a corpus
def test_data_benchmark_compares_with_the_demo_config_by_default(repo_root, tmp_path):
    out = bench(repo_root, tmp_path, "data", "--batches", "2", "--text-bytes", "20000")
    assert (
        f"input pipeline vs the train step of {repo_root / 'configs' / 'demo_cpu.json'} (batch 16 x 129 tokens)" in out
    )
    assert figure(rf"train step consumes\s+({NUMBER}) tokens/s", out) > 0
    for label in ("pre-tokenised TFRecords", "text, tokenised on the fly"):
        assert figure(rf"{re.escape(label)}\s+{NUMBER} tokens/s\s+=\s+({NUMBER})x the step", out) > 0


@pytest.fixture(scope="module")
def sample_benchmark(repo_root, tmp_path_factory) -> str:
    """One run of the sample benchmark with every option, shared by the tests of its sections."""
    return bench(
        repo_root,
        tmp_path_factory.mktemp("sample"),
        "sample",
        "--batch-sizes",
        "1,2",
        "--prompt-tokens",
        "4",
        "--new-tokens",
        "3",
        "--repeats",
        "1",
        "--torch-threads",
        "1",
        "--profile",
        "--quantize",
        "int8",
        "--kv-cache",
        "int8",
        "--top-k",
        "50",
        "--top-p",
        "0.9",
    )


@pytest.mark.slow  # shares one scripts/bench.py sample process (a 27M-parameter model) with the next test
def test_sample_benchmark(sample_benchmark):
    out = sample_benchmark
    assert "27.3M parameters, float32" in out
    assert "3 new tokens per row, sampled at temperature 1 with top-k 50 and top-p 0.9, KV cache on both sides" in out
    rows = re.findall(
        rf"^\s+(\d+)\s+(-?{NUMBER})\s+(-?{NUMBER})\s+-?{NUMBER}x\s+({NUMBER}) \({LIMIT}\)\s+-?{SHARE}"
        rf"\s+-?{SHARE}\s+({NUMBER})\s+({NUMBER})\s+{NUMBER}x$",
        out,
        re.MULTILINE,
    )
    assert [row[0] for row in rows] == ["1", "2"], out
    # One new token's decode time is a difference of two timings, which a busy machine can make negative;
    # the bound and the prefill times are measured directly.
    assert all(float(value.replace(",", "")) > 0 for row in rows for value in row[3:])
    assert figure(rf"to first token \(restore \+ compile \+ prefill\): ({NUMBER}) s", out) > 0
    read = re.search(
        rf"weights read at ({NUMBER}) GB/s from (cache|memory): float32 matvecs over the decode step's 92 MB of "
        r"weight matrices, again and again, warmed \(they (fit|do not fit) the (\d+) MiB last-level cache\): "
        r"a (cache|memory) bound",
        out,
    )
    assert read and float(read.group(1)) > 0, out
    fits = 92e6 <= int(read.group(4)) * 2**20
    assert (read.group(2), read.group(3), read.group(5)) == (
        ("cache", "fit", "cache") if fits else ("memory", "do not fit", "memory")
    )
    table_rows = re.findall(rf"^\s+\d+\s+-?{NUMBER}\s.*$", out, re.MULTILINE)
    assert any("failed" in row.split() for row in table_rows) == ("failed: a figure over its bound" in out), out
    assert figure(rf"matmul ceiling, float32: ({NUMBER}) GFLOP/s", out) > 0
    profiled = out.split("where a decode step's time goes")[1]
    assert "batch 1:" in profiled and "batch 2:" in profiled
    assert len(re.findall(rf"^\s+\S+\s+matmul\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}%$", profiled, re.MULTILINE)) >= 2


@pytest.mark.slow  # the same sample benchmark process as the test above
def test_sample_benchmark_prints_int8_weights_and_cache_beside_float32(sample_benchmark):
    out = sample_benchmark
    int8, kv_cache = out.split("int8 weights (block projections int8, a float32 scale per output channel")[1].split(
        "int8 KV cache (a float32 scale per cached key and value vector"
    )
    float_rows = re.findall(rf"^\s+([12])\s+(-?{NUMBER})\s+-?{NUMBER}\s+-?{NUMBER}x\s+{NUMBER} \(", out, re.MULTILINE)
    float_bound = figure(rf"^\s+1\s+-?{NUMBER}\s+-?{NUMBER}\s+-?{NUMBER}x\s+({NUMBER}) \(", out)
    # int8 weights read a quarter of the block projections' bytes: a higher memory bound than
    # float32's. An int8 cache reads a quarter of the cache's bytes, which at these few tokens are
    # a rounding error beside the weights: a bound no lower than float32's.
    for section, above in ((int8, float.__gt__), (kv_cache, float.__ge__)):
        rows = re.findall(
            rf"^\s+(\d+)\s+(-?{NUMBER})\s+(-?{NUMBER})\s+-?{NUMBER}x\s+({NUMBER}) \({LIMIT}\)\s+-?{SHARE}$",
            section,
            re.MULTILINE,
        )
        assert [row[0] for row in rows] == ["1", "2"], out
        assert [row[1] for row in rows] == [row[1] for row in float_rows[:2]]  # float32's figures, repeated beside
        assert above(float(rows[0][3].replace(",", "")), float_bound), out
    assert "(ratio: how many times faster int8 is than float32; its bound" in out
    assert "(ratio: how many times faster int8 cache is than float32; its bound" in out


@pytest.fixture(scope="module")
def server_programs(tmp_path_factory) -> str:
    """One ``--compile-cache`` for the servers of this module's serve runs: a server of a shape an
    earlier run compiled loads its programs (these runs check what is printed, not the cold start)."""
    return str(tmp_path_factory.mktemp("bench-serve-programs"))


@pytest.mark.slow  # bench.py starts a server process and times requests against it
def test_serve_benchmark_starts_its_own_server(repo_root, tmp_path, server_programs):
    out = bench(
        repo_root,
        tmp_path,
        "serve",
        *("--compile-cache", server_programs),
        "--concurrency",
        "1,2",
        "--warmup",
        "0.5",
        "--seconds",
        "2",
        "--new-tokens",
        "2,4",
        "--max-batch",
        "2",
        "--decode-steps",
        "2",
        "--max-len",
        "32",  # few prompt buckets and pool blocks: a warm-up of few programs
    )
    assert "random GPT-J, 27.3M parameters" in out
    assert "server --max-batch 2 --prefill between --decode-steps 2 --max-len 32" in out
    assert f"(compilation cache under {server_programs})" in out and os.listdir(os.path.join(server_programs, "jax"))
    rows = re.findall(rf"^\s+(\d+)\s+(\d+)\s+({NUMBER})\s+({NUMBER})\s+({SHARE})\s+({NUMBER})\s", out, re.MULTILINE)
    assert [row[0] for row in rows] == ["1", "2"], out
    assert all(int(row[1]) >= 1 and float(row[2].replace(",", "")) > 0 for row in rows), out
    assert all(float(row[3].replace(",", "")) > 0 for row in rows), out  # a bound for each occupancy
    assert all(float(row[5]) > 0 for row in rows), out  # a real first-token time
    steps = re.search(rf"best of 2\): 1 busy ({NUMBER}) ms", out)  # the step alone, of one busy slot at least
    assert steps and float(steps.group(1)) > 0, out
    assert "2 clients: " in out


@pytest.mark.slow  # bench.py starts two server processes and times requests against each
def test_serve_benchmark_compares_a_shared_prefix_with_and_without_the_prefix_cache(
    repo_root, tmp_path, server_programs
):
    out = bench(
        repo_root,
        tmp_path,
        "serve",
        *("--compile-cache", server_programs),
        *("--shared-prefix", "48", "--concurrency", "1", "--max-batch", "2"),
        *("--warmup", "0.5", "--seconds", "2", "--new-tokens", "2"),
        *("--max-len", "64"),  # three cached pages and few prompt buckets: a warm-up of few programs
    )
    assert "prompts of the same 48 token ids" in out and "--no-prefix-cache, ready in" in out
    rows = re.findall(rf"^\s+1\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s", out, re.MULTILINE)
    assert len(rows) == 1, out
    assert all(float(x.replace(",", "")) > 0 for x in rows[0]), out
    assert "1 clients: TTFT p50 " in out


@pytest.mark.slow  # bench.py starts two server processes, the second with adapters, and times requests
def test_serve_benchmark_compares_servers_holding_adapters_with_the_base_alone(repo_root, tmp_path, server_programs):
    out = bench(
        repo_root,
        tmp_path,
        "serve",
        *("--compile-cache", server_programs, "--decode-steps", "2"),  # the base: the first serve run's programs
        *("--adapters", "0,2", "--concurrency", "2", "--max-batch", "2", "--max-len", "32"),
        *("--warmup", "0.5", "--seconds", "2", "--new-tokens", "2,4"),
    )
    assert "each request naming one adapter at random" in out and "2 adapters: ready in" in out
    rows = re.findall(rf"^\s+(\d+)\s+2\s+({NUMBER})\s+(\S+)\s+({NUMBER})\s", out, re.MULTILINE)
    assert [row[0] for row in rows] == ["0", "2"], out
    assert rows[0][2] == "100%" and all(float(row[1].replace(",", "")) > 0 < float(row[3]) for row in rows), out
    assert re.search(r"takes ([\d,]+) bytes on the device", out), out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--top-p", "nan"], "top_p must be in (0, 1]"),
        (["--top-k", "-1"], "top_k must be an integer >= 0"),
    ],
)
def test_sample_benchmark_refuses_bad_filters_in_one_line(tmp_path, args, message, run_command):
    done = run_command(commands.script("bench.py"), "sample", *args, cwd=tmp_path)
    assert done.status != 0 and "Traceback" not in done.err, done.err
    assert done.err.startswith("error: ") and message in done.err, done.err


def test_sample_benchmark_decodes_greedily_on_both_sides_by_default():
    parser = argparse.ArgumentParser()
    sample.add_arguments(parser)
    assert sample._describe(sample._filters(parser.parse_args([]))) == "greedy"
    chosen = sample._filters(parser.parse_args(["--top-p", "0.5"]))
    assert chosen == {"top_p": 0.5} and sample._describe(chosen) == "sampled at temperature 1 with top-p 0.5"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shared-prefix", "9999"], "--shared-prefix must be in [0, "),
        (["--url", "http://127.0.0.1:9", "--shared-prefix", "8"], "with --url the server is yours"),
        (["--concurrency", "1,x"], "--concurrency must be client counts >= 1"),
        (["--concurrency", "0"], "--concurrency must be client counts >= 1"),
        (["--new-tokens", "8,two"], "--new-tokens must be N or MIN,MAX"),
        (["--seconds", "inf"], "--seconds must be a finite number > 0"),
        (["--seconds", "nan"], "--seconds must be a finite number > 0"),
        (["--warmup", "-1"], "--warmup a finite number >= 0"),
        (["--url", "http://127.0.0.1:9", "--prefill", "beside"], "with --url the server is yours"),
        (["--url", "http://127.0.0.1:9", "--decode-steps", "2"], "with --url the server is yours"),
        (["--decode-steps", "0"], "--decode-steps must be in 1..64"),
        (["--max-len", "8"], "--max-len must be in 16..512"),
        (["--max-len", "64", "--new-tokens", "60"], "--max-len must hold a prompt"),
        (["--adapters", "0,x"], "--adapters must be adapter counts >= 0"),
        (["--adapters", "1", "--shared-prefix", "8"], "--adapters must be adapter counts >= 0"),
        (["--url", "http://127.0.0.1:9", "--adapters", "1"], "with --url the server is yours"),
        (["--url", "http://127.0.0.1:9", "--compile-cache", "cc"], "with --url the server is yours"),
        (["--compile-cache", "/dev/null/cc"], "--compile-cache '/dev/null/cc': cannot hold the compilation cache"),
        (["--compile-cache", ""], "--compile-cache '': cannot hold the compilation cache (an empty path)"),
    ],
)
def test_serve_benchmark_refuses_bad_arguments_in_one_line(tmp_path, args, message, run_command):
    done = run_command(commands.script("bench.py"), "serve", *args, cwd=tmp_path)
    assert done.status != 0 and "Traceback" not in done.err, done.err
    assert done.err.startswith("error: ") and message in done.err, done.err


def test_pipeline_benchmark_returns_throughputs(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 3000)
    results = benchmark_pipeline(
        seq_len=64, batch_size=4, n_batches=6, n_files=2, text_files=[str(text)], workdir=str(tmp_path)
    )
    for key in ("tfrecord_tokens_per_s", "text_tokens_per_s", "text_tokenize_tokens_per_s"):
        assert results[key] > 0
    assert results["text_corpus_tokens"] > 0


@pytest.mark.slow  # a throughput target: 256 batches of 16 x 2048 tokens
def test_pretokenised_pipeline_is_fast(tmp_path):
    """The target: well over 1M tokens/s from pre-tokenised records, at GPT-J's sequence length."""
    results = benchmark_pipeline(seq_len=2048, batch_size=16, n_batches=256, text_bytes=1 << 20, workdir=str(tmp_path))
    assert results["tfrecord_tokens_per_s"] > 1e6, results


@pytest.mark.slow  # scripts/bench.py in a process of its own, compiling train and decode steps
def test_device_benchmark_on_cpu(repo_root, tmp_path):
    out = bench(
        repo_root,
        tmp_path,
        "device",
        "--steps",
        "1",
        "--backends",
        "xla",
        "--decode-batches",
        "1,2",
        "--new-tokens",
        "2",
    )
    assert "device: 1 x cpu (cpu); peak unknown: no MFU" in out
    assert "train batch 2 x 128 tokens" in out and "2 heads of 128" in out
    assert figure(rf"attention xla\s+({NUMBER}) tokens/s\s+{NUMBER} GFLOP/s\s+MFU n/a", out) > 0
    assert [int(b) for b in re.findall(rf"^\s+batch\s+(\d+)\s+{NUMBER} tokens/s$", out, re.MULTILINE)] == [1, 2], out
    assert all(figure(rf"batch\s+{b}\s+({NUMBER}) tokens/s", out) > 0 for b in (1, 2))
    assert out.index(".. compiling and timing the train step") < out.index("attention xla")  # progress first


@pytest.mark.slow  # starts a Ray cluster and two 2-process trainings
def test_launch_benchmark_times_gptj_launch_and_the_start_by_hand_on_a_cluster_of_its_own(repo_root, tmp_path):
    out = bench(repo_root, tmp_path, "launch", "--repeats", "1")
    hand = figure(rf"by hand \(two processes\)\s+({NUMBER}) s", out)
    launched = figure(rf"gptj-launch --hosts 2\s+({NUMBER}) s\s+\(({NUMBER})x", out)
    assert hand > 0 and launched > 0 and figure(rf"starting the Ray cluster\s+({NUMBER}) s", out) > 0
    assert "start to first training step, 2 processes x 4 CPU devices, configs/tiny.json, median of 1:" in out


@pytest.mark.slow  # gptj-serve and gptj-sample started twice each, in processes of their own as a user runs them
def test_startup_benchmark_times_serve_and_sample_cold_then_warm(repo_root, tmp_path):
    out = bench(repo_root, tmp_path, "startup", "--size", "tiny", "--max-batch", "1", "--new-tokens", "2")
    for command in ("gptj-serve", "gptj-sample"):
        cold, warm = (float(x) for x in re.search(rf"^{command}\s+({NUMBER})\s+({NUMBER})\s+\d+%$", out, re.M).groups())
        assert 0 < warm and 0 < cold, out
    lines = re.findall(r"^server warm-up, (cold|warm): 1 decode slots of 64 tokens, (\d+) programs", out, re.M)
    assert [kind for kind, _ in lines] == ["cold", "warm"] and lines[0][1] == lines[1][1], out
    # the warm server found every program in the cache: it wrote none
    cached = re.search(r"compilation cache: (\d+) programs after the cold start, (\d+) after the warm one", out)
    assert cached and 0 < int(cached[1]) == int(cached[2]), out
    assert re.search(r"^warm start <= 25% of the cold one: (yes|no)$", out, re.M), out
