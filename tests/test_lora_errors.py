"""LoRA adapters given where they do not fit: a LoRA run where a full model is expected, PEFT
directories that are damaged or say more than a rank and an alpha, non-finite adapters, a file
for a directory, ranks beyond a full update; and Ctrl-C while merge-lora writes. Each gives one
error naming the file and what to do, and leaves nothing behind.

Per-module ranks and alphas (PEFT's ``rank_pattern`` / ``alpha_pattern``) are checked against
HuggingFace PEFT itself."""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import gptj_flax
from benchmarks.common import write_random_hf
from gptj_flax import checkpoint, convert, partitioning
from gptj_flax.cli import convert as convert_cli
from gptj_flax.cli import eval as eval_cli
from gptj_flax.cli import sample as sample_cli
from gptj_flax.cli import serve as serve_cli
from gptj_flax.cli import train as train_cli
from gptj_flax.config import ConfigError, from_dict
from gptj_flax.convert import ConversionError
from gptj_flax.convert import lora as lora_lib
from gptj_flax.convert.orbax_io import OrbaxParams
from gptj_flax.model import GPTJ
from gptj_flax.training import train
from tests import adapter_helpers
from tests.test_lora import _hf_logits
from tests.training_helpers import MODEL, make_config, make_corpus, write_config

LORA = {"rank": 4, "alpha": 8, "targets": ["*"]}
SHORT = dict(total_steps=2, warmup_steps=1, anneal_steps=1, ckpt_every=2, val_set={})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"), max_bytes=60_000)


@pytest.fixture(scope="module")
def base(corpus, tmp_path_factory):
    """``(HF directory, its Orbax conversion)``: a random model of the training helpers' shape."""
    root = tmp_path_factory.mktemp("base")
    model = make_config(corpus, root / "unused").model
    write_random_hf(root / "hf", model)
    return root / "hf", convert.from_hf(root / "hf", root / "orbax", tokenizer=False)


@pytest.fixture(scope="module")
def lora_run(corpus, base, tmp_path_factory):
    run = tmp_path_factory.mktemp("lora") / "run"
    train(make_config(corpus, run, lora=LORA, **SHORT), init_from=str(base[1]), progress=False)
    return run


@pytest.fixture(scope="module")
def peft(lora_run, tmp_path_factory):
    return lora_lib.to_peft(lora_run, tmp_path_factory.mktemp("peft") / "adapter")


def _model_config(base):
    return OrbaxParams.open(base[1]).config.model


def _run(main, monkeypatch, capsys, *argv) -> tuple[int, list[str]]:
    """A command's ``main`` in this process: its exit status and its stderr's non-empty lines."""
    monkeypatch.setattr(sys, "argv", ["gptj", *map(str, argv)])
    status = main()
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# 4. A LoRA run where a full model is expected


def test_a_lora_run_given_as_a_full_model_names_its_base_in_every_command(
    lora_run, base, corpus, tmp_path, monkeypatch, capsys
):
    step = lora_run / "2"
    expected = (
        f"error: {step} is a LoRA checkpoint: adapters for the base {base[1]}/0, not a full model. Load that "
        f"base with --adapter {step} (adapter= in Python), or merge them into it with "
        f"`gptj-convert merge-lora {step} OUT`"
    )
    train_config = write_config(make_config(corpus, tmp_path / "fresh", **SHORT), tmp_path / "fresh.json")
    commands = [
        (convert_cli.main, "quantize", lora_run, tmp_path / "q"),
        (convert_cli.main, "slim", lora_run, tmp_path / "s"),
        (convert_cli.main, "to-hf", lora_run, tmp_path / "h"),
        (sample_cli.main, lora_run, "--prompt", "a"),
        (eval_cli.main, "perplexity", "--checkpoint", lora_run, "--data", corpus["val"]),
        (serve_cli.main, "--checkpoint", lora_run, "--port", _free_port()),
        (train_cli.main, "--config", train_config, "--init-from", lora_run, "--no-progress"),
    ]
    for main, *argv in commands:
        status, lines = _run(main, monkeypatch, capsys, *argv)
        assert (status, lines[-1:]) == (1, [expected]), (argv, lines)
        assert not any("unexpected error" in line for line in lines), argv
    assert not [p for p in os.listdir(tmp_path) if p[0] in "qsh"]  # no output, not even a temporary one
    with pytest.raises(checkpoint.CheckpointError, match="is a LoRA checkpoint: adapters for the base"):
        gptj_flax.load(step)
    # Where a LoRA run is asked for, it still loads.
    assert gptj_flax.load(base[1], adapter=lora_run).step == 0


# --------------------------------------------------------------------------------------------
# 5. PEFT directories are checked, naming the file


def _variant(peft, tmp_path, name, *, config=None, tensors=None, config_bytes=None, weights_bytes=None):
    """A copy of ``peft`` with its adapter_config.json or adapter_model.safetensors changed."""
    out = tmp_path / name
    shutil.copytree(peft, out)
    if config is not None:
        settings = json.loads((peft / lora_lib.PEFT_CONFIG).read_text())
        config(settings)
        (out / lora_lib.PEFT_CONFIG).write_text(json.dumps(settings))
    if config_bytes is not None:
        (out / lora_lib.PEFT_CONFIG).write_bytes(config_bytes)
    if tensors is not None:
        changed = tensors(load_file(str(peft / lora_lib.PEFT_WEIGHTS)))
        save_file(changed, str(out / lora_lib.PEFT_WEIGHTS), metadata={"format": "pt"})
    if weights_bytes is not None:
        (out / lora_lib.PEFT_WEIGHTS).write_bytes(weights_bytes)
    return out


Q0_A = "base_model.model.transformer.h.0.attn.q_proj.lora_A.weight"


def test_a_damaged_peft_directory_is_refused_naming_the_file_and_the_fault(peft, base, tmp_path):
    mc = _model_config(base)
    config, weights = lora_lib.PEFT_CONFIG, lora_lib.PEFT_WEIGHTS
    cases = [
        ("not_json", dict(config_bytes=b"{not json"), config, r"is not JSON \(Expecting property name"),
        ("not_utf8", dict(config_bytes=b"\xff\xfe{}"), config, r"is not JSON \('utf-8' codec can't decode"),
        ("a_list", dict(config_bytes=b"[1, 2]"), config, "holds list, not a JSON object"),
        ("no_r", dict(config=lambda c: c.pop("r")), config, "has no 'r': it is not a complete PEFT LoRA config"),
        ("r_text", dict(config=lambda c: c.update(r="4")), config, "r must be a positive integer, got '4'"),
        ("alpha_zero", dict(config=lambda c: c.update(lora_alpha=0)), config, "lora_alpha must be a finite positive"),
        ("targets", dict(config=lambda c: c.update(target_modules=7)), config, "target_modules must be a list"),
        ("all_linear", dict(config=lambda c: c.update(target_modules="all-linear")), config, "target_modules: 'all"),
        (
            "r_2",
            dict(config=lambda c: c.update(r=2)),
            weights,
            rf"tensor {Q0_A} has shape \(4, 32\), not \(2, 32\): its rank is 4 but adapter_config.json gives 2",
        ),
        ("zeros", dict(weights_bytes=bytes(100)), weights, "unreadable safetensors header"),
        ("cut", dict(weights_bytes=(peft / weights).read_bytes()[:500]), weights, "truncated or not a safetensors"),
        ("a_header_list", dict(weights_bytes=(6).to_bytes(8, "little") + b"[1, 2]"), weights, "header is a JSON list"),
        (
            "missing",
            dict(tensors=lambda t: {k: v for k, v in t.items() if k != Q0_A}),
            weights,
            rf"lacks 1 adapter tensor\(s\), e.g. \['{Q0_A}'\]",
        ),
        (
            "int8",
            dict(tensors=lambda t: {**t, Q0_A: t[Q0_A].astype(np.int8)}),
            weights,
            f"tensor {Q0_A} is int8, not floating point",
        ),
    ]
    for name, change, file, message in cases:
        directory = _variant(peft, tmp_path, name, **change)
        with pytest.raises(ConversionError, match=rf"^{directory / file}:? .*{message}"):
            lora_lib.read_adapter(directory, None, mc)

    wider = dataclasses.replace(mc, d_model=64, n_heads=8)  # the same adapter onto a base of other shapes
    with pytest.raises(
        lora_lib.LoRAError,
        match=rf"^{peft / weights}: tensor {Q0_A} has shape \(4, 32\), not \(4, 64\): it was made for a model "
        r"of other dimensions than this base \(d_model=64, d_ff=256\)",
    ):
        lora_lib.read_adapter(peft, None, wider)


def test_a_damaged_peft_adapter_is_one_error_line_in_a_command(peft, base, tmp_path, monkeypatch, capsys):
    directory = _variant(peft, tmp_path, "garbage", config_bytes=b"{not json")
    status, lines = _run(sample_cli.main, monkeypatch, capsys, base[1], "--adapter", directory, "--prompt", "a")
    assert status == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {directory / lora_lib.PEFT_CONFIG} is not JSON (")


# --------------------------------------------------------------------------------------------
# 6. Per-module ranks and alphas, as PEFT applies them


def _peft_adapter(hf_dir, out, seed, **settings):
    """A PEFT LoRA adapter made by PEFT itself on the HF model at ``hf_dir``, its weights random."""
    import torch
    from transformers import GPTJForCausalLM

    return adapter_helpers.save_peft_adapter(
        GPTJForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), out, seed, **settings
    )


@pytest.mark.parametrize(
    "patterns",
    [
        dict(alpha_pattern={"v_proj": 32}),
        dict(rank_pattern={"q_proj": 2, "h.1.mlp.fc_in": 6}, alpha_pattern={r"transformer\.h\.0\.attn\.out_proj": 3}),
    ],
    ids=["alpha_pattern", "rank_and_alpha_pattern"],
)
def test_peft_rank_and_alpha_patterns_merge_as_peft_computes_them(base, tmp_path, patterns):
    hf_dir, orbax = base
    adapter = _peft_adapter(
        hf_dir,
        tmp_path / "adapter",
        seed=0,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "out_proj", "fc_in"],
        **patterns,
    )
    tokens = np.random.default_rng(0).integers(0, MODEL["vocab_size"], (2, 16))
    theirs = _hf_logits(hf_dir, tokens, adapter)
    lm = gptj_flax.load(orbax, dtype="float32", adapter=adapter)
    ours = np.asarray(GPTJ(lm.decoder.config).apply({"params": lm.decoder.params}, tokens))
    print("PEFT with", patterns, "vs ours: max |diff|", np.abs(ours - theirs).max())
    assert np.abs(ours - theirs).max() <= 1e-4
    assert np.abs(theirs - _hf_logits(hf_dir, tokens)).max() > 0.5  # the adapter (and its pattern) matters


def test_other_peft_options_that_change_the_numbers_are_refused_by_name(peft, base, tmp_path):
    mc = _model_config(base)
    for key, value in (("layers_to_transform", [0]), ("use_dora", True), ("modules_to_save", ["lm_head"])):
        directory = _variant(peft, tmp_path, key, config=lambda c, k=key, v=value: c.update({k: v}))
        with pytest.raises(lora_lib.LoRAError, match=rf"{directory / lora_lib.PEFT_CONFIG}: {key}=.* is not supported"):
            lora_lib.read_adapter(directory, None, mc)
    directory = _variant(peft, tmp_path, "regex", config=lambda c: c.update(rank_pattern={"(q": 2}))
    with pytest.raises(lora_lib.LoRAError, match=r"rank_pattern pattern '\(q' is not a regular expression"):
        lora_lib.read_adapter(directory, None, mc)


# --------------------------------------------------------------------------------------------
# 7. Non-finite adapters


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_peft_adapter_with_non_finite_values_is_refused_naming_the_tensor(peft, base, tmp_path, bad):
    key = "base_model.model.transformer.h.1.mlp.fc_out.lora_B.weight"
    directory = _variant(peft, tmp_path, "bad", tensors=lambda t: {**t, key: np.full_like(t[key], bad)})
    with pytest.raises(
        lora_lib.LoRAError,
        match=rf"^{directory / lora_lib.PEFT_WEIGHTS}: tensor {key} holds NaN or infinite values",
    ):
        gptj_flax.load(base[1], adapter=directory)


# --------------------------------------------------------------------------------------------
# 12. Ranks beyond a full update; a file where an adapter directory goes


def test_a_lora_rank_beyond_a_full_update_is_a_config_error():
    def config(rank, targets=("*",), d_ff=None):
        model = {**MODEL, "d_ff": d_ff} if d_ff else MODEL
        return from_dict({"model": model, "train": {"batch_size": 8, "lora": {"rank": rank, "targets": list(targets)}}})

    assert config(32).train.lora.rank == 32  # d_model: a full update of every projection
    with pytest.raises(
        ConfigError, match=r"train.lora.rank=33 exceeds 32, the rank of a full update of q_proj \(32×32\)"
    ):
        config(33)
    with pytest.raises(ConfigError, match=r"train.lora.rank=4096 exceeds 32, .* set train.lora.rank to at most 32"):
        config(4096, targets=("fc_in",))
    with pytest.raises(
        ConfigError, match=r"train.lora.rank=20 exceeds 16, the rank of a full update of fc_in \(32×16\)"
    ):
        config(20, targets=("fc_in", "fc_out"), d_ff=16)


def test_a_peft_adapter_of_a_rank_beyond_a_full_update_is_refused(base, tmp_path):
    hf_dir, orbax = base
    adapter = _peft_adapter(hf_dir, tmp_path / "wide", seed=1, r=40, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(lora_lib.LoRAError, match=r"rank 40 \(r, or rank_pattern\) exceeds 32, the rank of a full"):
        lora_lib.read_adapter(adapter, None, _model_config(base))


def test_a_file_given_as_an_adapter_says_which_directory_to_give(peft, base, tmp_path):
    mc = _model_config(base)
    with pytest.raises(lora_lib.LoRAError, match=rf"is a file: give the PEFT directory that holds it, {peft}$"):
        lora_lib.read_adapter(peft / lora_lib.PEFT_CONFIG, None, mc)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(lora_lib.LoRAError, match="is a file: give a LoRA run directory, one of its step directories"):
        lora_lib.read_adapter(tmp_path / "notes.txt", None, mc)
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(peft / lora_lib.PEFT_WEIGHTS, half)
    with pytest.raises(lora_lib.LoRAError, match="has adapter_model.safetensors but no adapter_config.json"):
        lora_lib.read_adapter(half, None, mc)


# --------------------------------------------------------------------------------------------
# 8. Ctrl-C while merge-lora writes

# SIGINT is first handled as Python does by default: a suite run in the background of a
# non-interactive shell hands its processes SIGINT ignored, and the signal below would be lost.
# gptj-convert in a process that sends itself Ctrl-C's signal as the fifth array of its output is
# opened for writing (TensorStore opens each as Orbax writes it): mid-write every time.
CTRL_C_MID_WRITE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's shell starts it
import tensorstore
from gptj_flax.cli.convert import main
open_store, opened = tensorstore.open, []
def opening(spec, *args, **kwargs):
    if ".tmp-" in str(spec):
        opened.append(spec)
        if len(opened) == 5:
            os.kill(os.getpid(), signal.SIGINT)
    return open_store(spec, *args, **kwargs)
tensorstore.open = opening
sys.argv = ["gptj-convert", *sys.argv[1:]]
sys.exit(main())
"""


@pytest.mark.parametrize("command", [["merge-lora"], ["to-hf", "--merge-lora"]], ids=["merge-lora", "to-hf"])
def test_ctrl_c_during_merge_lora_leaves_nothing_behind(lora_run, tmp_path, repo_root, command):
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_MID_WRITE, *command, str(lora_run), "out"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip() and "params:" not in line]  # progress aside
    assert (done.returncode, lines) == (130, ["error: interrupted"]), done.stderr[-3000:]
    assert not os.listdir(tmp_path), os.listdir(tmp_path)  # no out, out.tmp-*, .merge-lora-*


def test_merge_lora_still_writes_the_merged_model(lora_run, base, tmp_path):
    """The streamed merge writes what merge_adapters computes in memory."""
    merged = lora_lib.merge_lora(lora_run, tmp_path / "merged")
    adapter = lora_lib.read_adapter(lora_run)
    mesh = partitioning.make_mesh(partitioning.ONE_DEVICE)
    params = convert.load_init_params(str(base[1]), adapter.config.replace(model=_model_config(base)), mesh)
    expected = lora_lib.merge_adapters(params, adapter.adapters, adapter.lora)
    _, written, _ = convert.load_params(merged, mesh)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, written), jax.tree.map(np.asarray, expected))


@pytest.mark.parametrize(
    "lora, now",
    [
        (None, "null (the whole model trains)"),
        ({**LORA, "rank": 2}, '{"rank": 2, "alpha": 8, "targets": ["*"]}'),
        ({**LORA, "targets": ["q_proj", "v_proj"]}, '{"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}'),
    ],
    ids=["no-lora", "rank", "targets"],
)
def test_resuming_a_lora_run_with_other_adapters_says_what_differs(lora_run, corpus, tmp_path, lora, now):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    config = make_config(corpus, run, **{**SHORT, "total_steps": 4}, **({} if lora is None else {"lora": lora}))
    saved = '{"rank": 4, "alpha": 8, "targets": ["*"]}'
    message = (
        f"cannot resume {run}: its saved config (step 2) has train.lora={saved}, but this config has "
        f"train.lora={now}, so the checkpoint's trained parameters do not fit. Resume it with its own train.lora, "
        "or start a new run directory (--set train.run_dir=NEW)"
    )
    with pytest.raises(ConfigError) as error:
        train(config, progress=False)
    assert str(error.value).startswith(message), str(error.value)
    if lora is None:
        assert f"merge it (gptj-convert merge-lora {run} OUT) and --init-from OUT" in str(error.value)


def test_resuming_a_full_run_as_a_lora_run_says_what_differs(corpus, tmp_path):
    run = tmp_path / "run"
    train(make_config(corpus, run, **SHORT), progress=False)
    with pytest.raises(ConfigError) as error:
        train(make_config(corpus, run, lora=LORA, **{**SHORT, "total_steps": 4}), progress=False)
    assert str(error.value) == (
        f"cannot resume {run}: its saved config (step 2) has train.lora=null (the whole model trains), but this "
        'config has train.lora={"rank": 4, "alpha": 8, "targets": ["*"]}, so the checkpoint\'s trained '
        "parameters do not fit. Resume it with its own train.lora, or start a new run directory "
        f"(--set train.run_dir=NEW); to train adapters on this run's model, --init-from {run}"
    )
