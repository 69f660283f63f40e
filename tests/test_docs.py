"""Every shell command that the README and the documentation pages show runs, on small stand-ins for its
placeholders; every relative link of the README leads to a file.

A command runs here unless NOT_RUN lists it with the reason (hardware, the network, or another test that
runs it as written): a new command is tested from the day it is written. The pages are read in the
order a reader meets them, the README and then the site's navigation (mkdocs.yml), and a command shown on
several pages runs once, where it first appears. The commands run in that order in one working directory,
as a reader would type them: `gptj-eval perplexity` reads the TFRecords that `gptj-create-tfrecords`
wrote, and `curl` talks to the server that `gptj-serve` started.
"""

from __future__ import annotations

import dataclasses
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
import yaml
import zstandard

from gptj_flax.config import Config, MeshConfig, TrainConfig
from gptj_flax.data import save_tokenizer
from tests.commands import QUICK_COMPILE
from tests.evaluation_helpers import CFG, CORPUS, make_checkpoint, make_tokenizer
from tests.gpt4chan.synthetic_dump import write_synthetic_dump
from tests.helpers import hf_model
from tests.legacy_writer import dense_model, legacy_config_dict, write_legacy_checkpoint

REPO = Path(__file__).resolve().parent.parent
# The installed commands and the functions they call.
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
API_KEY = "docs-test-key-0123456789abcdef"

LAUNCHED_IN_TESTS = (
    "tests/test_launch.py starts a Ray cluster of its own on 127.0.0.1 (not on Ray's default port, where a "
    "user's cluster may run) and runs gptj-launch --hosts 2 train on it, a worker killed midway"
)
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
    "curl -fsS http://127.0.0.1:8080/complete": "tests/test_serving_legacy_clients.py sends docs/serve.md's ```sh "
    "examples to the server and checks the documented answers",
    "gptj-launch --tpu": "needs a TPU pod slice with a Ray cluster on it",
    "ray start --head": LAUNCHED_IN_TESTS,
    "gptj-launch --hosts 2": LAUNCHED_IN_TESTS,
    "ray stop": LAUNCHED_IN_TESTS,
    "curl -fsS http://127.0.0.1:8080/model/": "tests/test_serving_legacy_clients.py sends docs/serve.md's ```sh "
    "examples to the server and checks the documented answers",
    "gptj-serve --checkpoint CKPT --chat-template": "needs the template file the page shows; "
    "tests/test_serving_openai.py serves with --chat-template and tests/test_serving_cli.py checks the flag",
    "curl -fsS http://127.0.0.1:8080/v1/chat/completions": "needs a server with a chat template; "
    "tests/test_serving_openai.py sends docs/serve.md's chat example to one and checks the answer",
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
# Start-up noise the commands prevent: libtpu's TPU discovery on a machine without TPUs, and Orbax's
# warning about a checkpoint opened read-only.
NOISE = ("TPU_WORKER_HOSTNAMES", "Failed to find host bounds", "Given directory is read only")
# The fences of shell commands, and the other languages a page may show; a block of another language
# (or none) fails, so that no command hides from this test.
SHELL = ("bash", "sh")
LANGUAGES = (*SHELL, "python", "text", "json")


def pages() -> list[Path]:
    """The README, then every Markdown page of the site in its navigation's order."""

    def walk(nav):
        for entry in nav:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from walk(value) if isinstance(value, list) else [value]

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    docs = [REPO / "docs" / page for page in walk(nav) if page.endswith(".md")]
    return [REPO / "README.md", *docs]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block."""
    return re.findall(r"^```(\S*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def shell_commands(text: str) -> list[str]:
    """The commands of the shell blocks, continuation lines joined, comments kept (shlex drops them)."""
    commands = []
    for language, body in code_blocks(text):
        if language in SHELL:
            commands += [line.strip() for line in body.replace("\\\n", " ").splitlines() if line.strip()]
    return commands


def all_commands() -> list[str]:
    """Every page's commands in reading order, each once (the same words, whatever their comment)."""
    first = {}
    for page in pages():
        for command in shell_commands(page.read_text()):
            first.setdefault(shlex.join(shlex.split(command, comments=True)), command)
    return list(first.values())


COMMANDS = all_commands()


def not_run_reason(command: str) -> str | None:
    return next((reason for prefix, reason in NOT_RUN.items() if command.startswith(prefix)), None)


def test_every_listed_exception_is_still_a_command_of_the_docs():
    assert COMMANDS
    stale = [prefix for prefix in NOT_RUN if not any(command.startswith(prefix) for command in COMMANDS)]
    assert stale == []


def test_every_page_is_read_and_every_code_block_names_a_known_language():
    on_disk = {path.relative_to(REPO) for path in (REPO / "docs").rglob("*.md")}
    assert on_disk <= {path.relative_to(REPO) for path in pages()}
    unknown = [
        (page.name, language or "(none)")
        for page in pages()
        for language, _ in code_blocks(page.read_text())
        if language not in LANGUAGES
    ]
    assert unknown == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The stand-ins, a directory of console-command shims, the environment; stops the server at the end."""
    root = tmp_path_factory.mktemp("docs")
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
    for command, target in SCRIPTS.items():  # what pip writes for a console script
        module, function = target.split(":")
        shim = shims / command
        shim.write_text(
            f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\n"
            f"if __name__ == '__main__':\n    sys.exit({function}())\n"
        )
        shim.chmod(0o755)
    shutil.copytree(REPO / "configs", root / "configs")  # the commands run in a checkout
    # The commands' own defaults, not the test suite's (conftest quiets TensorFlow itself).
    env = {key: value for key, value in os.environ.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    env = {
        **env,
        "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {QUICK_COMPILE}",
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


@dataclasses.dataclass
class Done:
    """How one command ended, and the new directory its OUT stood for."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    out: Path | None = None


def argv_for(command: str, workspace) -> tuple[list[str], Path | None]:
    """The command's words with the placeholders replaced, a new OUT each time, the shortening arguments."""
    workspace["n"] += 1
    out = workspace["root"] / f"out{workspace['n']}" if "OUT" in command.split() else None
    words = []
    split = shlex.split(command, comments=True)
    if split[-1] == "&":  # the shell's "run in the background": start_server does that
        split.pop()
    for word in split:
        for placeholder, value in workspace["placeholders"].items():
            word = re.sub(rf"\b{placeholder}\b", value, word)
        word = re.sub(r"\bOUT\b", str(out), word)
        word = re.sub(r"\b8080\b", str(workspace["port"]), word).replace("$API_KEY", API_KEY)
        words.append(word)
    return words + next((extra for prefix, extra in SHORTER.items() if command.startswith(prefix)), []), out


def run_alone(argv: list[str], workspace, timeout: int = 900) -> Done:
    done = subprocess.run(
        argv, cwd=workspace["root"], env=workspace["env"], capture_output=True, text=True, timeout=timeout
    )
    return Done(argv, done.returncode, done.stdout, done.stderr)


def run_together(argvs: list[list[str]], workspace, timeout: int = 1800) -> list[Done]:
    """This project's commands, one after another in one process (tests/workers/run_commands.py)."""
    jobs = []
    for i, argv in enumerate(argvs):
        files = {
            kind: str(workspace["root"] / "logs" / f"{workspace['n']}-{i}.{kind}")
            for kind in ("stdout", "stderr", "status")
        }
        jobs.append({"argv": argv, **files})
    (workspace["root"] / "logs").mkdir(exist_ok=True)
    (workspace["root"] / "logs" / "jobs.json").write_text(json.dumps(jobs))
    worker = [
        sys.executable,
        str(REPO / "tests" / "workers" / "run_commands.py"),
        str(workspace["root"] / "logs" / "jobs.json"),
    ]
    ran = run_alone(worker, workspace, timeout)
    results = []
    for job in jobs:
        status = Path(job["status"])
        if not status.exists():  # the worker died before this command ended
            results.append(Done(job["argv"], ran.returncode or 1, ran.stdout, ran.stderr))
            continue
        outputs = [Path(job[kind]).read_text() for kind in ("stdout", "stderr")]
        results.append(Done(job["argv"], int(status.read_text()), *outputs))
    return results


def start_server(argv: list[str], workspace) -> Done:
    """``argv`` started in the background, once it answers /health (the docs' servers take one port in turn)."""
    if workspace["server"] is not None:
        workspace["server"].terminate()
        workspace["server"].wait(120)
    process = subprocess.Popen(
        argv, cwd=workspace["root"], env=workspace["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    workspace["server"] = process
    url = f"http://127.0.0.1:{workspace['port']}/health"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return Done(argv, process.returncode or 1, process.communicate()[0][-3000:], "")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return Done(argv, 0, "", "")
        except httpx.TransportError:
            pass
        time.sleep(1)
    return Done(argv, 1, "", "gptj-serve did not become healthy")


RUNNABLE = [command for command in COMMANDS if not_run_reason(command) is None]


@pytest.fixture(scope="module")
def done(workspace) -> dict[str, Done | None]:
    """Every runnable command, run in reading order; None for one that needs what this machine lacks.

    Consecutive commands of this project share one process; a server and curl run on their own.
    """
    results: dict[str, Done | None] = {}
    batch: list[tuple[str, list[str], Path | None]] = []

    def run_batch():
        for (command, _, out), result in zip(batch, run_together([argv for _, argv, _ in batch], workspace)):
            results[command] = dataclasses.replace(result, out=out)
        batch.clear()

    for command in RUNNABLE:
        argv, out = argv_for(command, workspace)
        if argv[0] == "gptj-aot-check" and importlib.util.find_spec("libtpu") is None:
            results[command] = None
        elif argv[0] in SCRIPTS and argv[0] != "gptj-serve":
            batch.append((command, argv, out))
        else:
            run_batch()
            if argv[0] == "gptj-serve":
                results[command] = start_server(argv, workspace)
            elif argv[0] == "curl" and workspace["server"] is None:
                results[command] = Done(argv, 1, "", "the docs start gptj-serve before a curl example")
            else:
                results[command] = dataclasses.replace(run_alone(argv, workspace), out=out)
    run_batch()
    return results


@pytest.mark.slow  # the first one runs every command of the docs, several minutes
@pytest.mark.parametrize("command", [pytest.param(c, id=c[:60]) for c in RUNNABLE])
def test_command_runs(command, done):
    result = done[command]
    if result is None:
        pytest.skip("needs libtpu, the tpu extra (pip install -c constraints.txt -e '.[tpu]')")
    argv = shlex.join(result.argv)
    assert result.returncode == 0, f"{argv}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr and not re.search(r"^error:", result.stderr, re.MULTILINE), argv
    assert [noise for noise in NOISE if noise in result.stdout + result.stderr] == [], argv
    if result.argv[0] == "curl":
        answer = json.loads(result.stdout)
        assert answer["object"] == "text_completion" and isinstance(answer["choices"][0]["text"], str)
    if result.out is not None:
        assert result.out.is_dir() and any(result.out.iterdir()), argv


def test_the_perplexity_example_reads_what_the_create_tfrecords_example_wrote():
    create = next(c for c in COMMANDS if c.startswith("gptj-create-tfrecords"))
    perplexity = next(c for c in COMMANDS if c.startswith("gptj-eval perplexity"))
    words = shlex.split(create, comments=True)
    output, name = words[words.index("--output-dir") + 1], words[words.index("--name") + 1]
    assert f"--data {output}/{name}.index" in perplexity
    assert COMMANDS.index(create) < COMMANDS.index(perplexity)


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (outside code blocks)."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#{1,6} +(.+?) *#*$", prose, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_of_the_readme_leads_to_a_file():
    readme = (REPO / "README.md").read_text()
    prose = re.sub(r"^```.*?^```", "", readme, flags=re.MULTILINE | re.DOTALL)
    targets = re.findall(r"\]\(([^)\s]+)\)", prose)
    relative = [t for t in targets if not re.match(r"[a-z]+:", t)]
    assert relative, "the README links to its documentation"
    broken = []
    for target in relative:
        path, _, anchor = target.partition("#")
        file = (REPO / path) if path else REPO / "README.md"
        if not file.exists():
            broken.append(target)
        elif anchor and (file.suffix != ".md" or anchor not in github_anchors(file.read_text())):
            broken.append(target)
    assert broken == []
