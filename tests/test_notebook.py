"""``examples/sampling.ipynb`` is committed with its outputs, so that a reader (and the documentation site,
which renders it) sees what each call returns without running it. They were printed on a small stand-in
for the demo checkpoint that this test trains; re-executed on it, the notebook must print the same,
timings, sizes and addresses aside. When it does not, the outputs are stale: the test names the freshly
executed copy to review and commit.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import nbclient
import nbformat
import pytest

import gptj_flax
from gptj_flax import partitioning
from gptj_flax.config import Config, MeshConfig, TrainConfig
from gptj_flax.data import save_tokenizer, train_bpe_tokenizer
from gptj_flax.training import train
from tests.helpers import CORPUS, tiny_config

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "sampling.ipynb"
STEPS = 300
# What may differ between two runs of the same notebook: how long a call took, a size in bytes, where
# an object lives in memory.
VOLATILE = (
    (re.compile(r"\b\d+(?:\.\d+)?\s?(?:ns|µs|us|ms|s|min)\b"), "<duration>"),
    (re.compile(r"\b\d+(?:\.\d+)?\s?(?:[KMGT]i?B|bytes)\b"), "<size>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<address>"),
)


def train_stand_in(root: Path) -> str:
    """A tiny GPT-J trained on a few Python snippets, left as `make demo` leaves its run; the run's path.

    Trained rather than random, so that the stored outputs read as text and stop on EOS or a stop string
    as the demo model's do.
    """
    documents = list(dict.fromkeys(CORPUS))
    (root / "corpus").mkdir()
    for i, text in enumerate(documents):
        (root / "corpus" / f"doc{i}.txt").write_text(text)
    tokenizer = train_bpe_tokenizer(documents * 4, vocab_size=300, from_files=False, min_frequency=1)
    save_tokenizer(tokenizer, str(root / "tokenizer"))
    model = tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=320, max_len=128)
    config = Config(
        model=model,
        mesh=MeshConfig(),
        train=TrainConfig(
            batch_size=8, seq_len=64, total_steps=STEPS, warmup_steps=10, anneal_steps=STEPS - 10,
            lr=1e-2, end_lr=1e-3, run_dir=str(root / "run"), train_set=str(root / "corpus"),
            tokenizer=str(root / "tokenizer"), ckpt_every=STEPS, val_every=STEPS, val_batches=1,
        ),
    )  # fmt: skip
    train(config, mesh=partitioning.make_mesh(config.mesh), progress=False)
    return str(root / "run")


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> str:
    return train_stand_in(tmp_path_factory.mktemp("stand_in"))


def normalised(text: str) -> str:
    for pattern, replacement in VOLATILE:
        text = pattern.sub(replacement, text)
    return text


def printed(notebook) -> list[list[tuple[str, str]]]:
    """Each code cell's outputs as (kind, text), normalised: what a reader sees.

    Consecutive writes to one stream are joined: how the kernel splits them into messages is timing.
    """
    cells = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        outputs: list[tuple[str, str]] = []
        for output in cell.outputs:
            if output.output_type == "stream" and outputs and outputs[-1][0] == output.name:
                outputs[-1] = (output.name, outputs[-1][1] + output.text)
            elif output.output_type == "stream":
                outputs.append((output.name, output.text))
            elif output.output_type in ("execute_result", "display_data"):
                outputs.append((output.output_type, output.data.get("text/plain", "")))
            else:
                outputs.append((output.output_type, f"{output.get('ename')}: {output.get('evalue')}"))
        cells.append([(kind, normalised(text)) for kind, text in outputs])
    return cells


def execute(notebook, checkpoint: str, monkeypatch):
    """Run ``notebook`` as Jupyter would from examples/, on ``checkpoint``; return the executed copy."""
    executed = copy.deepcopy(notebook)
    monkeypatch.setenv("GPTJ_CHECKPOINT", checkpoint)  # the kernel inherits this process's environment
    client = nbclient.NotebookClient(
        executed,
        timeout=600,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()
    return executed


@pytest.mark.slow  # trains the stand-in and runs the notebook in a kernel of its own: about two minutes
def test_the_committed_outputs_are_what_the_notebook_prints(stand_in, tmp_path, monkeypatch):
    committed = nbformat.read(NOTEBOOK, as_version=4)
    executed = execute(committed, stand_in, monkeypatch)
    fresh = tmp_path / NOTEBOOK.name
    nbformat.write(executed, fresh)

    assert not [kind for cell in printed(executed) for kind, _ in cell if kind == "error"], fresh
    assert printed(committed) == printed(executed), (
        f"examples/sampling.ipynb's stored outputs are stale: review {fresh} (executed now) and copy it over"
    )
    # The text the notebook shows is the library's own: the same greedy completion, loaded afresh here.
    summary = json.loads(executed.cells[-1].outputs[-1].text)
    assert summary["greedy"] == gptj_flax.load(stand_in).generate("def ", 48, temperature=0).text
    assert summary["stream_matches_generate"] is True
