"""Every command in the README's ```bash blocks runs, on small stand-ins for its placeholders.

A command runs here unless NOT_RUN lists it with the reason (hardware, the network, or a test that
runs it elsewhere): a new README command is tested from the day it is written. Commands run in
README order in one working directory, as a reader would type them: `gptj-eval perplexity` reads
the TFRecords that `gptj-create-tfrecords` wrote, and `curl` talks to the server `gptj-serve` started.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import zstandard

from gptj_flax.config import Config, MeshConfig, TrainConfig
from gptj_flax.data import save_tokenizer
from tests.evaluation_helpers import CFG, CORPUS, make_checkpoint, make_tokenizer
from tests.gpt4chan.synthetic_dump import write_synthetic_dump
from tests.helpers import hf_model
from tests.legacy_writer import dense_model, legacy_config_dict, write_legacy_checkpoint

REPO = Path(__file__).resolve().parent.parent
API_KEY = "readme-test-key-0123456789abcdef"

# Command prefix → why this test does not run it.
NOT_RUN = {
    "make demo": "tests/test_demo.py runs the demo; CI runs make itself",
    "make test": "is this test suite",
    "pip install": "downloads packages from a package index",
    "gptj-train --config configs/gptj_6b.json": "trains the 6-billion-parameter model",
    "gcloud ": "runs on a TPU VM slice",
    "gptj-eval harness --checkpoint CKPT --tasks lambada_openai": "downloads the tasks' datasets from the HuggingFace hub",
    "gptj-lm-eval --model gptj_flax --model_args checkpoint=CKPT --tasks piqa": "downloads piqa from the HuggingFace hub",
    "lm_eval --model local-completions": "downloads piqa from the HuggingFace hub (tests/test_serving_openai.py runs "
    "local-completions against the server on a local task)",
}
# Arguments added after a command so that it runs in seconds on the stand-ins (argparse: the last wins).
SHORTER = {
    "gptj-create-tfrecords": ["--seq-len", "64"],  # the stand-in model's context, as 2048 is GPT-J's
    "gptj-train --config my.json": ["--mesh", "1,-1,2"],  # the stand-in has 4 heads, not a multiple of 8
    "gptj-serve": ["--max-len", "32", "--max-batch", "2"],
    # the 6B shapes shrunk to seconds of compiling; the topology, mesh and memory settings as written
    "gptj-aot-check": [
        *("--set", "model.n_layers=2", "--set", "model.d_model=256", "--set", "model.n_heads=8"),
        *("--set", "model.rotary_dim=16", "--set", "model.vocab_size=1024", "--set", "train.seq_len=256"),
    ],
}
SLOW = ("gptj-train", "gptj-serve", "curl", "gptj-aot-check")
# Start-up noise the commands prevent: libtpu's TPU discovery on a machine without TPUs, and Orbax's
# warning about a checkpoint opened read-only.
NOISE = ("TPU_WORKER_HOSTNAMES", "Failed to find host bounds", "Given directory is read only")


def readme_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks, continuation lines joined, comments kept (shlex drops them)."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        commands += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return commands


COMMANDS = readme_commands((REPO / "README.md").read_text())


def not_run_reason(command: str) -> str | None:
    return next((reason for prefix, reason in NOT_RUN.items() if command.startswith(prefix)), None)


def test_every_listed_exception_is_still_a_readme_command():
    assert COMMANDS
    stale = [prefix for prefix in NOT_RUN if not any(command.startswith(prefix) for command in COMMANDS)]
    assert stale == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The stand-ins, a directory of console-command shims, the environment; stops the server at the end."""
    root = tmp_path_factory.mktemp("readme")
    ckpt, hf, legacy = root / "ckpt", root / "hf", root / "legacy" / "step_1000"
    make_checkpoint(ckpt)
    hf_model(CFG).save_pretrained(hf)
    save_tokenizer(make_tokenizer(), str(hf))
    write_legacy_checkpoint(legacy, dense_model(CFG, seed=0), CFG, shards=2)
    (root / "LEGACY.json").write_text(json.dumps(legacy_config_dict(CFG, 2)))
    (root / "corpus").mkdir()
    for i, text in enumerate(CORPUS):
        (root / "corpus" / f"doc{i}.txt").write_text(text * 4)
    train = TrainConfig(
        batch_size=4, seq_len=32, total_steps=2, warmup_steps=1, anneal_steps=1, ckpt_every=2, val_every=2,
        run_dir=str(root / "runs" / "my"), train_set="corpus", tokenizer=str(ckpt / "tokenizer"),
    )  # fmt: skip
    (root / "my.json").write_text(json.dumps(Config(model=CFG, mesh=MeshConfig(), train=train).to_dict()))
    (root / "keys.txt").write_text(f"# one key per line\n{API_KEY}\n")
    plain = root / "pol.ndjson"
    write_synthetic_dump(plain, 20_000)
    (root / "pol.ndjson.zst").write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    for name, acc in (("ours.json", 0.61), ("gptj.json", 0.55)):
        results = {"results": {"piqa": {"alias": "piqa", "acc,none": acc, "acc_stderr,none": 0.011}}}
        (root / name).write_text(json.dumps(results))

    shims = root / "bin"
    shims.mkdir()
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for command, target in scripts.items():  # what pip writes for a console script
        module, function = target.split(":")
        shim = shims / command
        shim.write_text(
            f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\n"
            f"if __name__ == '__main__':\n    sys.exit({function}())\n"
        )
        shim.chmod(0o755)
    shutil.copytree(REPO / "configs", root / "configs")  # the README's commands run in a checkout
    # The commands' own defaults, not the test suite's (conftest quiets TensorFlow itself).
    env = {key: value for key, value in os.environ.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    env = {
        **env,
        "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "API_KEY": API_KEY,
    }
    state = {"root": root, "env": env, "port": free_port(), "server": None, "n": 0}
    placeholders = {
        "CKPT": str(ckpt),
        "HF_DIR": str(hf),
        "STEP_DIR": str(legacy),
        "DIR_OR_HUB_NAME": str(ckpt / "tokenizer"),
    }
    state["placeholders"] = placeholders
    yield state
    server = state["server"]
    if server is not None and server.poll() is None:
        server.terminate()
        server.communicate(timeout=60)


def argv_for(command: str, workspace) -> list[str]:
    """The command's words with the placeholders replaced, a new OUT each time, the shortening arguments."""
    workspace["n"] += 1
    words = []
    split = shlex.split(command, comments=True)
    if split[-1] == "&":  # the shell's "run in the background": start_server does that
        split.pop()
    for word in split:
        for placeholder, value in workspace["placeholders"].items():
            word = re.sub(rf"\b{placeholder}\b", value, word)
        word = re.sub(r"\bOUT\b", str(workspace["root"] / f"out{workspace['n']}"), word)
        word = re.sub(r"\b8080\b", str(workspace["port"]), word).replace("$API_KEY", API_KEY)
        words.append(word)
    return words + next((extra for prefix, extra in SHORTER.items() if command.startswith(prefix)), [])


def run(argv: list[str], workspace, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=workspace["root"], env=workspace["env"], capture_output=True, text=True, timeout=timeout
    )


def start_server(argv: list[str], workspace) -> None:
    if workspace["server"] is not None:  # the README's servers take one port in turn
        workspace["server"].terminate()
        workspace["server"].wait(120)
    process = subprocess.Popen(
        argv, cwd=workspace["root"], env=workspace["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    workspace["server"] = process
    url = f"http://127.0.0.1:{workspace['port']}/health"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0][-3000:]
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise AssertionError("gptj-serve did not become healthy")


def _param(command: str):
    marks = [pytest.mark.slow] if command.startswith(SLOW) else []
    return pytest.param(command, marks=marks, id=command[:60])


@pytest.mark.parametrize("command", [_param(c) for c in COMMANDS if not_run_reason(c) is None])
def test_readme_command_runs(command, workspace):
    argv = argv_for(command, workspace)
    if argv[0] == "gptj-aot-check" and importlib.util.find_spec("libtpu") is None:
        pytest.skip("needs libtpu, the tpu extra (pip install -c constraints.txt -e '.[tpu]')")
    if argv[0] == "gptj-serve":
        start_server(argv, workspace)
        return
    if argv[0] == "curl":
        assert workspace["server"] is not None, "the README starts gptj-serve before its curl example"
    done = run(argv, workspace)
    assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr and not re.search(r"^error:", done.stderr, re.MULTILINE)
    assert [noise for noise in NOISE if noise in done.stdout + done.stderr] == []
    if argv[0] == "curl":
        answer = json.loads(done.stdout)
        assert answer["object"] == "text_completion" and isinstance(answer["choices"][0]["text"], str)
    if "OUT" in command.split():
        out = workspace["root"] / f"out{workspace['n']}"
        assert out.is_dir() and any(out.iterdir())


def test_the_readme_perplexity_reads_what_its_create_tfrecords_wrote():
    create = next(c for c in COMMANDS if c.startswith("gptj-create-tfrecords"))
    perplexity = next(c for c in COMMANDS if c.startswith("gptj-eval perplexity"))
    words = shlex.split(create, comments=True)
    output, name = words[words.index("--output-dir") + 1], words[words.index("--name") + 1]
    assert f"--data {output}/{name}.index" in perplexity
    assert COMMANDS.index(create) < COMMANDS.index(perplexity)
