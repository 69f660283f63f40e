"""Hostile input to the commands and their config (issue 33, items 9, 10 and 12): every bad input gives
one ``error:`` line naming it, checked before the model loads where it can be; ``--set`` of a shape
resizes what follows from it; Ctrl-C from a command's first instant to its last prints no traceback.

Commands run in this process through their ``main`` (``sys.argv`` set), except where the process
itself is under test (Ctrl-C during the imports and during the shutdown: one process each)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import tomllib

import numpy as np
import pytest
import zstandard

import gptj_flax
import gptj_flax.sampling.api as sampling_api
from gptj_flax import config as config_module
from gptj_flax import errors
from gptj_flax.cli import create_tfrecords as create_tfrecords_cli
from gptj_flax.cli import eval as eval_cli
from gptj_flax.cli import sample as sample_cli
from gptj_flax.cli import train as train_cli
from gptj_flax.config import ConfigError, LoraConfig, ModelConfig, from_dict, load_config
from gptj_flax.data import DataError, load_tokenizer, make_train_iterator
from gptj_flax.data.compression import open_decompressed
from gptj_flax.evaluation.harness import task_manager
from gptj_flax.model import abstract_params
from gptj_flax.sampling import SamplingError
from tests.evaluation_helpers import write_tasks
from tests.test_sampling_api import make_checkpoint
from tests.training_helpers import make_config, write_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> str:
    """A tiny model's run directory with its tokenizer (tests/test_sampling_api.py's)."""
    directory = str(tmp_path_factory.mktemp("run"))
    make_checkpoint(directory)
    return directory


@pytest.fixture(scope="module")
def lm(run):
    return gptj_flax.load(run)


def command(monkeypatch, capsys, main, *argv) -> tuple[int, str, str]:
    """``main()`` of a command run in this process with ``argv``: (status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["gptj", *map(str, argv)])
    capsys.readouterr()
    status = main()
    out, err = capsys.readouterr()
    return status, out, err


def one_error_line(status, stderr) -> str:
    lines = stderr.strip().splitlines()
    assert status == errors.EXIT_ERROR and len(lines) == 1 and lines[0].startswith("error: "), (status, stderr)
    return lines[0].removeprefix("error: ")


LOADED = "LanguageModel("  # gptj-sample's first line on stderr once the model has loaded


# --------------------------------------------------------------------------------------------
# 9. Bad input to the commands


def test_a_prompt_file_that_is_not_utf8_is_named_with_its_byte_before_the_model_loads(
    run, tmp_path, monkeypatch, capsys
):
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(b"def f(\x92\xff\x00 binary")
    status, out, err = command(monkeypatch, capsys, sample_cli.main, run, "--prompt-file", binary)
    assert (
        one_error_line(status, err)
        == f"{binary}: not UTF-8 text at byte 6 (invalid start byte); give a UTF-8 text file"
    )
    assert LOADED not in err and out == ""


def test_bytes_that_are_not_utf8_in_a_prompt_are_refused_and_the_interactive_loop_goes_on(run, lm, monkeypatch, capsys):
    # Python gives a command's argument bytes that are not UTF-8 as lone surrogates (0xff -> U+DCFF).
    status, _, err = command(monkeypatch, capsys, sample_cli.main, run, "--prompt", "abc\udcff")
    line = one_error_line(status, err)
    assert line == "--prompt is not UTF-8 text: the byte 0xff (character 3) is not UTF-8; give UTF-8 text"
    assert LOADED not in err

    # A terminal's line of such bytes is refused like a too-long prompt; the session continues.
    typed = b"abc\xff\n" + b"x" * 200 + b"\ndef add(\n\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(typed), encoding="utf-8"))
    argv = (run, "--interactive", "--temperature", "0", "--max-new-tokens", "8", "--ignore-eos")
    status, out, err = command(monkeypatch, capsys, sample_cli.main, *argv)
    assert status == 0, err
    expected = lm.generate("def add(", 8, temperature=0, ignore_eos=True).text
    assert out == "prompt> " * 2 + f"prompt> {expected}\nprompt> "
    assert "error: the prompt is not UTF-8 text: the byte 0xff (character 3) is not UTF-8" in err
    assert "exceeds the model's context" in err and err.count("completion done in") == 1


def test_generate_stream_and_score_refuse_a_lone_surrogate_by_name(lm):
    with pytest.raises(SamplingError, match=r"^the prompt holds the lone surrogate U\+D800 at character 1"):
        lm.generate("a\ud800b", 4)
    with pytest.raises(SamplingError, match=r"^prompt 1 is not UTF-8 text: the byte 0x92 \(character 2\)"):
        lm.generate(["fine", "no\udc92"], 4)
    with pytest.raises(SamplingError, match=r"^the prompt is not UTF-8 text"):
        lm.stream("x\udcff", 4)  # at the call, before the first piece is asked for
    with pytest.raises(SamplingError, match=r"^the prompt holds the lone surrogate U\+DFFF"):
        lm.score("\udfff")


@pytest.mark.parametrize(
    "flags, settings",
    [
        (["--temperature", "-1"], dict(temperature=-1.0)),
        (["--top-p", "2"], dict(top_p=2.0)),
        (["--max-new-tokens", "0"], dict(max_new_tokens=0)),
        (["--seed", "-1"], dict(seed=-1)),
        (["--stop", ""], dict(stop=[""])),
        (["--repetition-penalty", "nan"], dict(repetition_penalty=float("nan"))),
    ],
)
def test_sampling_arguments_are_checked_before_the_model_loads_by_the_librarys_own_check(
    run, monkeypatch, capsys, flags, settings
):
    status, _, err = command(monkeypatch, capsys, sample_cli.main, run, "--prompt", "x", *flags)
    line = one_error_line(status, err)
    assert LOADED not in err
    with pytest.raises(SamplingError) as library:  # what generate and stream would raise
        sampling_api.check_settings(1, **settings)
    assert line == str(library.value)


def test_harness_names_an_unknown_task_before_the_model_loads_and_says_how_to_list_tasks(
    run, tmp_path, monkeypatch, capsys
):
    tasks = write_tasks(tmp_path / "tasks")
    argv = ["harness", "--checkpoint", run, "--tasks", "no_such_task,tiny_choise", "--include-path", tasks]
    argv += ["--no-builtin-tasks", "--output", tmp_path / "out.json"]
    status, _, err = command(monkeypatch, capsys, eval_cli.main, *argv)
    assert one_error_line(status, err) == (
        "lm-eval knows no task 'no_such_task', 'tiny_choise' (did you mean 'tiny_choice'?); "
        f"`gptj-lm-eval ls tasks --include_path {tasks}` lists the tasks"
    )
    assert "step 0: parameters" not in err and not (tmp_path / "out.json").exists()
    index = task_manager(tasks, include_defaults=False)
    assert "tiny_choice" in index.all_tasks  # the name suggested is one lm-eval runs


def test_compare_names_a_results_file_that_is_not_json(tmp_path, monkeypatch, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"results": {"piqa": {"acc,none": 0.5, "acc_stderr,none": 0.01}}}))
    for name, content, problem in [
        ("text.json", b"acc 0.5\n", "not JSON (line 1, column 1: Expecting value)"),
        ("cut.json", b'{"results": {"piqa": ', "not JSON (line 1, column 22: Expecting value)"),
        ("binary.json", b"\x89PNG\r\n\x1a\n", "not UTF-8 text at byte 0"),
    ]:
        bad = tmp_path / name
        bad.write_bytes(content)
        status, _, err = command(monkeypatch, capsys, eval_cli.main, "compare", bad, good, "--plot", tmp_path / "p.png")
        assert one_error_line(status, err) == f"{bad}: not an lm-eval results file: {problem}"


# --------------------------------------------------------------------------------------------
# 10. --set of a shape resizes what the config derives from it


@pytest.mark.parametrize("name", ["tiny.json", "demo_cpu.json", "6B_roto_256.json", "gptj_6b.json"])
def test_set_d_model_resizes_d_ff_unless_the_file_sets_it(name):
    path = os.path.join(REPO, "configs", name)
    with open(path) as f:
        spelled_out = '"d_ff"' in f.read()
    config = load_config(path, ["model.d_model=768", "model.n_heads=12"])
    expected = load_config(path).model.ff_dim if spelled_out else 4 * 768  # GPT-J's MLP: 4 x d_model
    assert config.model.ff_dim == expected
    kernel = abstract_params(config.model)["layers"]["mlp"]["fc_in"]["kernel"]
    assert kernel.value.shape[-2:] == (768, expected)  # the model built, not only the config
    assert from_dict(config.to_dict()) == config  # and the round trip through a saved config keeps it
    unset = ModelConfig(n_layers=1, d_model=64, n_heads=4, rotary_dim=8, vocab_size=128)
    assert dataclasses.replace(unset, d_model=128).ff_dim == 512


def test_set_of_one_batch_size_replaces_the_files_other(repo_root):
    per_replica = load_config(repo_root / "configs/tiny.json", ["train.per_replica_batch=2"]).train
    assert (per_replica.batch_size, per_replica.global_batch_size(data_parallel=4)) == (None, 8)
    both = ["train.per_replica_batch=2", "train.batch_size=8"]
    with pytest.raises(ConfigError, match="set exactly one of train.batch_size"):
        load_config(repo_root / "configs/tiny.json", both)


# --------------------------------------------------------------------------------------------
# 12. Ctrl-C during the imports and at the end; a garbage .zst; command-line advice; LoRA alpha


def console_script(name: str) -> str:
    """The program pip writes for the console command ``name`` of pyproject.toml's [project.scripts]."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        module, function = tomllib.load(f)["project"]["scripts"][name].split(":")
    return f"import sys\nfrom {module} import {function}\nsys.exit({function}())\n"


# Sends this process SIGINT (a terminal's Ctrl-C) the moment flax begins to import, well inside the
# package's seconds of imports.
CTRL_C_DURING_IMPORTS = """\
import os, signal, sys
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "flax":
            sys.meta_path.remove(self)
            print("Ctrl-C while importing flax", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlC())
"""

# Sends SIGINT at the end of the interpreter's shutdown, after every other exit handler (registered
# first, this one runs last), where the work of the command is over.
CTRL_C_AT_EXIT = """\
import atexit, os, signal, sys, time
def ctrl_c():
    print("Ctrl-C during the shutdown", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(2)
atexit.register(ctrl_c)
"""


# What a terminal's shell gives the commands it starts: SIGINT handled as Python does by default (a
# test run in the background of a non-interactive shell would hand on SIGINT ignored).
SHELL = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"


def python(code: str, *args, cwd=REPO) -> subprocess.CompletedProcess:
    """``python -c SHELL + code args`` with the checkout importable; the command's exit status and output."""
    return subprocess.run(
        [sys.executable, "-c", SHELL + code, *map(str, args)],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ctrl_c_while_a_command_imports_prints_one_line_and_exits_130():
    done = python(CTRL_C_DURING_IMPORTS + console_script("gptj-sample"), "missing_run", "--prompt", "x")
    assert (done.returncode, done.stdout) == (130, ""), done.stderr
    assert done.stderr.endswith("Ctrl-C while importing flax\nerror: interrupted\n"), done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr
    # the line and status are run_cli's own, which this process could not import yet
    entry = __import__("gptj_flax_entry")
    assert (entry.EXIT_INTERRUPTED, entry.INTERRUPTED_LINE) == (errors.EXIT_INTERRUPTED, "error: interrupted\n")


def test_ctrl_c_while_a_checkout_script_imports_prints_one_line_and_exits_130():
    run_script = "import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    done = python(CTRL_C_DURING_IMPORTS + run_script, "scripts/eval.py", "compare", "a.json", "b.json")
    assert (done.returncode, done.stdout) == (130, ""), done.stderr
    assert done.stderr.endswith("Ctrl-C while importing flax\nerror: interrupted\n"), done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr


def test_ctrl_c_after_a_command_finished_keeps_its_result_and_status_and_prints_no_traceback(tmp_path):
    results = {"results": {"piqa": {"acc,none": 0.5, "acc_stderr,none": 0.01}}}
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(results))
    plot = tmp_path / "chart.png"
    done = python(
        CTRL_C_AT_EXIT + console_script("gptj-eval"), "compare", "a.json", "b.json", "--plot", plot, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.endswith("Ctrl-C during the shutdown\n"), done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr
    assert done.stdout.endswith(f"chart written to {plot}\n") and "piqa" in done.stdout and plot.stat().st_size > 0


def test_garbage_after_a_zstd_magic_number_is_not_called_truncated(run, tmp_path, monkeypatch, capsys):
    garbage = {
        "zeros.txt.zst": ZSTD_MAGIC + bytes(100),  # zstd reads these as empty blocks, never the last
        "short.txt.zst": ZSTD_MAGIC + b"\x00\x00\x01",  # ends inside a block header
        "magic.txt.zst": ZSTD_MAGIC,  # nothing after the magic number
    }
    for name, content in garbage.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError) as refused:
            open_decompressed(tmp_path / name).read()
        message = str(refused.value)
        assert message.startswith(f"{tmp_path / name}: corrupt zstd data after 0 bytes of content (")
        assert "not zstd data" in message and "truncated" not in message
    # A file cut short still says so, even when its cut falls in the first block (nothing decoded yet).
    whole = zstandard.ZstdCompressor().compress(b"def add(a, b):\n    return a + b\n" * 40)
    (tmp_path / "cut.txt.zst").write_bytes(whole[:-10])
    with pytest.raises(DataError, match=r": truncated: the zstd data stops before its end marker, after 0 bytes"):
        open_decompressed(tmp_path / "cut.txt.zst").read()

    monkeypatch.setenv("GPTJ_FLAX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = [tmp_path / "zeros.txt.zst", "--output-dir", out, "--tokenizer", os.path.join(run, "tokenizer"), "--quiet"]
    capsys.readouterr()
    status = create_tfrecords_cli.main([str(a) for a in argv])
    line = one_error_line(status, capsys.readouterr().err)
    assert line.startswith(f"{tmp_path / 'zeros.txt.zst'}: corrupt zstd data") and not out.exists()


def test_sample_and_eval_on_a_run_without_a_tokenizer_give_command_line_advice_that_works(
    run, lm, tmp_path, monkeypatch, capsys
):
    bare = tmp_path / "bare"
    shutil.copytree(run, bare)
    shutil.rmtree(bare / "tokenizer")
    for flags in ([], ["--num-samples", "2"], ["--num-samples", "2", "--stop", "\n"]):
        status, _, err = command(monkeypatch, capsys, sample_cli.main, bare, "--prompt", "x", *flags)
        loaded, _, rest = err.partition("\n")
        assert loaded.startswith(LOADED)  # found out at the first use of the tokenizer
        assert one_error_line(status, rest) == (
            f"{bare} has no tokenizer saved with it (a tokenizer/ directory): pass --tokenizer DIR, "
            "the tokenizer the model was trained with"
        )
    argv = (bare, "--prompt", "def add(", "--tokenizer", os.path.join(run, "tokenizer"), "--temperature", "0")
    status, out, err = command(monkeypatch, capsys, sample_cli.main, *argv, "--max-new-tokens", "8", "--ignore-eos")
    assert status == 0, err
    assert out == lm.generate("def add(", 8, temperature=0, ignore_eos=True).text + "\n"
    tasks = write_tasks(tmp_path / "tasks")
    argv = ["harness", "--checkpoint", bare, "--tasks", "tiny_choice", "--include-path", tasks, "--no-builtin-tasks"]
    status, _, err = command(monkeypatch, capsys, eval_cli.main, *argv, "--output", tmp_path / "out.json")
    assert one_error_line(status, err).startswith(f"{bare} has no tokenizer saved with it (a tokenizer/ directory): ")
    # the library keeps its own advice
    no_tokenizer = gptj_flax.load(bare)
    with pytest.raises(SamplingError, match="use generate with token ids"):
        no_tokenizer.stream("x")


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_corpus(max_bytes=100_000)


def test_resuming_with_another_seed_gives_command_line_advice_that_works(corpus, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    path = write_config(make_config(corpus, run_dir, val_set={}), tmp_path / "c.json")
    base = ["--config", path, "--no-progress", "--stop-after", "1"]
    assert command(monkeypatch, capsys, train_cli.main, *base)[0] == 0
    status, _, err = command(monkeypatch, capsys, train_cli.main, *base, "--set", "train.seed=1")
    line = one_error_line(status, err.strip().splitlines()[-1] + "\n")
    assert line == (
        f"cannot resume {run_dir} where its data stopped: train.seed was 0, is 1 now. To resume, run with the "
        f"saved settings (--set train.seed=0); to train anew from its weights, use another run directory: "
        f"--set train.run_dir=NEW --init-from {run_dir}"
    )
    assert "state=None" not in err
    status, out, err = command(monkeypatch, capsys, train_cli.main, *base, "--set", "train.seed=0")
    assert status == 0 and out.splitlines()[-1] == f"step 2: saved in {run_dir}", err
    # the library keeps its own advice
    opened = dict(seq_len=8, batch_size=4, tokenizer=load_tokenizer(corpus["tokenizer"]), progress=False)
    saved = make_train_iterator(corpus["train"], seed=0, process_index=0, process_count=1, **opened).state()
    with pytest.raises(DataError, match=r"seed: saved 0, now 1\. .*start the data afresh \(state=None\)"):
        make_train_iterator(corpus["train"], seed=1, process_index=0, process_count=1, state=saved, **opened)


def test_lora_alpha_beyond_what_float16_holds_is_a_config_error_naming_the_field(repo_root):
    with pytest.raises(
        ConfigError, match=r"^train.lora.alpha must be a finite positive number at most 65504, got 1e\+308"
    ):
        LoraConfig(rank=4, alpha=1e308)
    lora = '{"rank": 4, "alpha": 1e308}'
    with pytest.raises(ConfigError, match=r"tiny.json: train.lora.alpha must be a finite positive number at most"):
        load_config(repo_root / "configs/tiny.json", [f"train.lora={lora}"])
    top = LoraConfig(rank=1, alpha=config_module.LORA_ALPHA_MAX)  # alpha / rank: the adapters' scale
    with np.errstate(over="ignore"):  # float16 ends there
        assert np.isfinite(np.float16(top.scale)) and np.isinf(np.float16(top.scale + 16))
