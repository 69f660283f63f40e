"""The lm-eval adapter against HuggingFace PyTorch on the same weights, on 1 and 8 devices, and lm-eval
end to end on local tasks through the ``gptj-lm-eval`` command (lm-eval's command line with the model
registered), ``scripts/eval.py harness`` and the training hook."""

import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from gptj_flax import convert, partitioning
from gptj_flax.config import ModelConfig
from gptj_flax.data import load_tokenizer
from gptj_flax.evaluation.during_training import HarnessDuringTraining
from gptj_flax.evaluation.harness import GenerationSettings, GPTJFlaxLM, flat_metrics, task_manager
from tests import commands
from tests.evaluation_helpers import (
    CFG,
    CHOICE_DOCS,
    TEXT_DOCS,
    TOKENIZER_VOCAB,
    make_tokenizer,
    write_tasks,
)
from tests.helpers import hf_model

# A model of odd shapes (11 layers, rotary_dim < head_dim, widths no power of two) for the default path.
ODD = ModelConfig(n_layers=11, d_model=48, n_heads=6, rotary_dim=4, vocab_size=331, max_len=64, d_ff=72)

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}

PAIRS = [
    ("The cat sat on the", " mat"),
    ("", "One two three four"),  # empty context: the EOS alone comes before
    ("Paris is the capital of", " France. Rome is the capital of Italy."),
    ("The quick brown fox jumps over the lazy dog." * 6, " Pack my box"),  # cut from the left to 64 tokens
]
TEXTS = ["Rome is the capital of Italy.", "The quick brown fox jumps over the lazy dog. " * 7]


def requests(kind, arguments):
    return [Instance(request_type=kind, doc={}, arguments=args, idx=0) for args in arguments]


@pytest.fixture(scope="module")
def run(eval_checkpoint):
    return eval_checkpoint


@pytest.fixture(scope="module")
def lm(run):
    return GPTJFlaxLM.from_checkpoint(run[0], batch_size=3)


@pytest.fixture(scope="module")
def lm_8_devices(run):
    return GPTJFlaxLM.from_checkpoint(run[0], mesh="2x1x4", batch_size=3)


@pytest.fixture(scope="module")
def hf(run):
    return run[1]


@pytest.fixture(scope="module")
def odd_run(tmp_path_factory):
    """A float32 HuggingFace GPT-J of odd shapes with a tokenizer, converted with no dtype given."""
    root = tmp_path_factory.mktemp("odd")
    model = hf_model(ODD, seed=3)
    model.save_pretrained(root / "hf")
    make_tokenizer().save_pretrained(root / "hf")
    return str(convert.from_hf(root / "hf", root / "run")), model


@pytest.fixture
def offline(monkeypatch, tmp_path):
    for key, value in {**OFFLINE, "HF_HOME": str(tmp_path / "hf")}.items():
        monkeypatch.setenv(key, value)


def hf_log_probs(model, tokens) -> np.ndarray:
    """log p(tokens[j+1] | tokens[:j+1]) under the HuggingFace model."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0].double()
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()


def hf_loglikelihood(model, tokenizer, context, continuation, max_len=CFG.max_len) -> float:
    """HuggingFace's summed log-probability of ``continuation`` after ``[EOS] + context``, cut from the
    left to the context size (GPT-J's convention)."""
    context_ids = tokenizer.encode(context) if context else []
    continuation_ids = tokenizer.encode(context + continuation)[len(context_ids) :]
    tokens = ([tokenizer.eos_token_id] + context_ids + continuation_ids)[-(max_len + 1) :]
    return float(hf_log_probs(model, tokens)[-len(continuation_ids) :].sum())


def rolling_windows(tokens, eos, max_len=CFG.max_len):
    """lm-eval's disjoint windows over ``tokens``: every token predicted once, after its window's context."""
    return list(
        map(
            make_disjoint_window,
            get_rolling_token_windows(tokens, prefix_token=eos, max_seq_len=max_len, context_len=1),
        )
    )


def hf_loglikelihood_rolling(model, tokenizer, text, max_len=CFG.max_len) -> float:
    return float(
        sum(
            hf_log_probs(model, context + prediction)[-len(prediction) :].sum()
            for context, prediction in rolling_windows(tokenizer.encode(text), tokenizer.eos_token_id, max_len)
        )
    )


def test_loglikelihood_is_huggingfaces_sum_of_continuation_log_probs(lm, hf):
    tokenizer = lm.tokenizer
    assert tokenizer.eos_token_id == lm.eot_token_id
    out = lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    for (context, continuation), (log_prob, greedy) in zip(PAIRS, out):
        assert log_prob == pytest.approx(hf_loglikelihood(hf, tokenizer, context, continuation), abs=1e-4)
        assert greedy is False  # a random model does not predict the text
    assert len(tokenizer.encode(PAIRS[3][0])) > CFG.max_len  # the truncation case really truncates


def test_is_greedy_exactly_when_every_continuation_token_is_the_argmax(lm, hf):
    context = [lm.eot_token_id, *lm.tokenizer.encode("The cat sat on the")]
    greedy = []
    for _ in range(3):  # HF's greedy choice among the tokenizer's ids (the padded ones are never chosen)
        with torch.no_grad():
            logits = hf(torch.tensor([context + greedy])).logits[0, -1, :TOKENIZER_VOCAB]
        greedy.append(int(logits.argmax()))
    other = (greedy[1] + 1) % TOKENIZER_VOCAB
    out = lm._loglikelihood_tokens([(None, context, greedy), (None, context, [greedy[0], other, greedy[2]])])
    assert [g for _, g in out] == [True, False]
    assert out[0][0] == pytest.approx(hf_log_probs(hf, context + greedy)[-3:].sum(), abs=1e-4)


def test_loglikelihood_rolling_is_huggingfaces_perplexity_over_the_same_windows(lm, hf):
    out = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in TEXTS]), disable_tqdm=True)
    for text, total in zip(TEXTS, out):
        tokens = lm.tokenizer.encode(text)
        windows = rolling_windows(tokens, lm.eot_token_id)
        expected = hf_loglikelihood_rolling(hf, lm.tokenizer, text)
        assert total == pytest.approx(expected, abs=1e-4)
        assert np.exp(-total / len(tokens)) == pytest.approx(np.exp(-expected / len(tokens)), rel=1e-5)
        if len(tokens) < CFG.max_len:  # one window: the whole text after the EOS
            assert len(windows) == 1
            assert total == pytest.approx(hf_log_probs(hf, [lm.eot_token_id, *tokens]).sum(), abs=1e-4)
        else:
            assert len(windows) >= 2
    assert lm.loglikelihood_rolling(requests("loglikelihood_rolling", [("",)]), disable_tqdm=True) == [0.0]


def test_generate_until_stops_at_the_tasks_stop_strings(lm):
    contexts = ["The cat sat on the", "def add(a, b):", "One two"]
    free = lm.generate_until(
        requests("generate_until", [(c, {"until": [], "max_gen_toks": 12}) for c in contexts]), disable_tqdm=True
    )

    def stop_in(text):  # two characters a few in, away from half-decoded characters
        i = next(i for i in range(3, len(text) - 1) if "\ufffd" not in text[i : i + 2])
        return text[i : i + 2]

    stops = [stop_in(free[0]), stop_in(free[1])]
    gen_kwargs = [
        {"until": [stops[0]], "max_gen_toks": 12},
        {"until": ["never generated", stops[1]], "max_gen_toks": 12, "do_sample": False},
        {"until": [], "max_gen_toks": 3, "temperature": 0.0},
    ]
    out = lm.generate_until(requests("generate_until", list(zip(contexts, gen_kwargs))), disable_tqdm=True)
    assert out[0] == free[0][: free[0].index(stops[0])]
    assert out[1] == free[1][: free[1].index(stops[1])]
    assert free[2].startswith(out[2]) and len(lm.tokenizer.encode(out[2])) <= 3
    with pytest.raises(ValueError, match="num_beams"):
        GenerationSettings.parse({"until": ["\n"], "num_beams": 4}, 16)


def test_results_are_the_same_on_1_and_8_devices(lm, lm_8_devices):
    assert lm_8_devices.mesh.devices.size == 8 and lm_8_devices.scorer.rows == 4  # rows: a multiple of data=2
    scored, rolled, generated = [], [], []
    for model in (lm, lm_8_devices):
        scored.append(model.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True))
        rolled.append(
            model.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in TEXTS]), disable_tqdm=True)
        )
        generated.append(
            model.generate_until(  # one batch of short prompts: one compiled sampler
                requests("generate_until", [(c, {"until": ["\n"], "max_gen_toks": 10}) for c, _ in PAIRS[:3]]),
                disable_tqdm=True,
            )
        )
    np.testing.assert_allclose([s for s, _ in scored[0]], [s for s, _ in scored[1]], rtol=0, atol=1e-5)
    assert [g for _, g in scored[0]] == [g for _, g in scored[1]]
    # sums of ~100 float32 log-probabilities around -10: equal to float32's resolution of the total
    np.testing.assert_allclose(rolled[0], rolled[1], rtol=1e-7, atol=1e-5)
    assert generated[0] == generated[1] and all(generated[0])


def test_lm_eval_builds_the_registered_model_from_model_args(run, offline, tmp_path):
    from lm_eval import simple_evaluate

    index = task_manager(write_tasks(tmp_path / "tasks"), include_defaults=False)
    results = simple_evaluate(
        model="gptj_flax",
        model_args=f"checkpoint={run[0]},mesh=2x1x1,batch_size=2",
        tasks=["tiny_choice"],
        task_manager=index,
        device="cuda:0",
        limit=2,
    )
    assert results["config"]["mesh"] == {"data": 2, "fsdp": 1, "model": 1}
    assert results["n-samples"]["tiny_choice"]["effective"] == 2
    with pytest.raises(ValueError, match="automatically"):
        GPTJFlaxLM.create_from_arg_string(f"checkpoint={run[0]}", {"batch_size": 1, "max_batch_size": 64})
    with pytest.raises(ValueError, match="checkpoint=DIR"):
        GPTJFlaxLM.create_from_arg_string("batch_size=4")
    with pytest.raises(ValueError, match="positive integer"):
        GPTJFlaxLM.create_from_arg_string(f"checkpoint={run[0]}", {"batch_size": "auto"})


@pytest.mark.slow  # a fresh process must register the model with lm-eval on its own
def test_local_tasks_run_through_lm_evals_own_entry_point(run, offline, tmp_path):
    """``python -m gptj_flax.cli.lm_eval`` is lm-eval's ``cli_evaluate`` with the model registered."""
    tasks = write_tasks(tmp_path / "tasks")
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {commands.QUICK_COMPILE}",
        "JAX_PLATFORMS": "cpu",
    }
    command = [
        sys.executable,
        "-m",
        "gptj_flax.cli.lm_eval",
        "--model",
        "gptj_flax",
        "--model_args",
        f"checkpoint={run[0]},mesh=1x1x2",
        "--tasks",
        "tiny_choice,tiny_text,tiny_generation",
        "--include_path",
        tasks,
        "--batch_size",
        "4",
        "--output_path",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [results_file] = [
        os.path.join(d, f) for d, _, files in os.walk(tmp_path / "out") for f in files if f.startswith("results")
    ]
    with open(results_file) as f:
        results = json.load(f)
    assert set(results["results"]) == {"tiny_choice", "tiny_text", "tiny_generation"}
    assert 0 <= results["results"]["tiny_choice"]["acc,none"] <= 1
    assert results["results"]["tiny_text"]["word_perplexity,none"] > 1
    assert results["results"]["tiny_generation"]["exact_match,none"] in (0.0, 0.5, 1.0)
    assert results["config"]["mesh"] == {"data": 1, "fsdp": 1, "model": 2}
    assert "gptj_flax" in done.stdout and "tiny_choice" in done.stdout  # lm-eval's table


def console_command(name: str) -> str:
    """The installed console script ``name``: beside this interpreter, else on PATH."""
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert found, f"no {name} command: install the project (make install, or pip install -e '.[eval]')"
    return found


@pytest.mark.slow  # the installed console command in a process of its own, compared with PyTorch
def test_the_gptj_lm_eval_command_runs_the_model_as_huggingface_scores(odd_run, offline, tmp_path):
    """The installed ``gptj-lm-eval --model gptj_flax …`` command, on an odd-shaped model
    converted from HuggingFace with no dtype given anywhere: per-request log-likelihoods, accuracy,
    word perplexity and bits per byte as HuggingFace PyTorch float32's on the same weights."""
    run, hf = odd_run
    tasks, out = write_tasks(tmp_path / "tasks"), tmp_path / "out"
    command = [
        console_command("gptj-lm-eval"),
        "--model",
        "gptj_flax",
        "--model_args",
        f"checkpoint={run}",
        "--tasks",
        "tiny_choice,tiny_text",
        "--include_path",
        tasks,
        "--batch_size",
        "4",
        "--output_path",
        str(out),
        "--log_samples",
    ]
    done = subprocess.run(
        command, cwd=tmp_path, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [results_file] = glob.glob(str(out / "*" / "results_*.json"))
    results = json.loads(Path(results_file).read_text())

    def samples(task):
        [path] = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
        return sorted(map(json.loads, Path(path).read_text().splitlines()), key=lambda s: s["doc_id"])

    tokenizer = load_tokenizer(os.path.join(run, "tokenizer"))
    correct = []
    for doc, sample in zip(CHOICE_DOCS, samples("tiny_choice"), strict=True):
        expected = [
            hf_loglikelihood(hf, tokenizer, doc["question"], " " + choice, ODD.max_len) for choice in doc["choices"]
        ]
        assert [float(ll) for ll, _ in sample["filtered_resps"]] == pytest.approx(expected, abs=1e-4)
        correct.append(int(np.argmax(expected)) == doc["label"])
    assert results["results"]["tiny_choice"]["acc,none"] == pytest.approx(np.mean(correct))

    total = 0.0
    for doc, sample in zip(TEXT_DOCS, samples("tiny_text"), strict=True):
        expected = hf_loglikelihood_rolling(hf, tokenizer, doc["text"], ODD.max_len)
        assert float(sample["filtered_resps"][0]) == pytest.approx(expected, abs=1e-4)
        total += expected
    words = sum(len(re.split(r"\s+", doc["text"])) for doc in TEXT_DOCS)
    text_bytes = sum(len(doc["text"].encode()) for doc in TEXT_DOCS)
    text_results = results["results"]["tiny_text"]
    assert text_results["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-4)
    assert text_results["bits_per_byte,none"] == pytest.approx(-total / text_bytes / math.log(2), rel=1e-5)
    assert results["config"]["model"] == "gptj_flax" and results["config"]["checkpoint"] == run
    assert (results["config"]["dtype"], results["config"]["param_dtype"]) == ("float32", "float32")
    assert "gptj_flax" in done.stdout and "tiny_choice" in done.stdout  # lm-eval's table


def test_eval_script_harness_writes_the_results_json(run, offline, tmp_path, repo_root, run_command):
    tasks = write_tasks(tmp_path / "tasks")
    output = tmp_path / "results.json"
    arguments = ["harness", "--checkpoint", run[0], "--tasks", "tiny_choice", "--include-path", tasks]
    options = ["--no-builtin-tasks", "--output", output, "--batch-size", "2", "--limit", "3"]
    done = run_command(commands.script("eval.py"), *arguments, *options, cwd=repo_root)
    assert done.status == 0, done.err[-3000:]
    results = json.loads(output.read_text())
    assert results["n-samples"]["tiny_choice"]["effective"] == 3
    assert results["config"]["model"] == "gptj_flax" and results["config"]["checkpoint"] == run[0]
    assert "acc" in done.out and str(output) in done.out
    assert f"{run[0]} step 0: parameters float32, compute float32" in done.err  # the dtypes in effect
    arguments[2] = os.path.join(run[0], "missing")
    bad = run_command(commands.script("eval.py"), *arguments, *options, cwd=repo_root)
    assert bad.status == 1 and "error:" in bad.err and "Traceback" not in bad.err


def test_training_hook_scores_new_parameters_without_recompiling(run, lm, offline, tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    hook = HarnessDuringTraining(
        ["tiny_choice", "tiny_text"],
        include_path=tasks,
        builtin_tasks=False,
        batch_size=3,
        results_dir=tmp_path / "harness",
    )
    params = lm.params  # live parameters of the model lm.config describes, already on the mesh
    first = hook(10, params, model_config=lm.config, mesh=lm.mesh, tokenizer=lm.tokenizer)
    compiled = hook._adapter.scorer.compilations()
    shardings = jax.tree.map(lambda x: x.sharding, params)  # a train step keeps them
    halved = jax.jit(lambda p: jax.tree.map(lambda x: 0.5 * x, p), out_shardings=shardings)(params)
    second = hook(20, halved, model_config=lm.config, mesh=lm.mesh, tokenizer=lm.tokenizer)
    assert hook._adapter.scorer.compilations() == compiled
    assert (
        set(first)
        == set(second)
        >= {
            "harness/tiny_choice/acc",
            "harness/tiny_choice/acc_stderr",
            "harness/tiny_text/word_perplexity",
            "harness/tiny_text/bits_per_byte",
        }
    )
    assert first["harness/tiny_text/bits_per_byte"] != second["harness/tiny_text/bits_per_byte"]
    saved = json.loads((tmp_path / "harness" / "harness_20.json").read_text())
    assert flat_metrics(saved) == second and saved["config"]["step"] == 20
    assert hook._adapter.params is None  # no reference to the run's weights between evaluations


def test_generation_sampler_builds_inside_a_training_runs_sharding_scope(run, lm):
    # The training loop calls the harness hook inside partitioning.sharding_scope(mesh); building
    # the sampler there used to fail with a TypeError from the logical sharding constraints.
    model = GPTJFlaxLM.from_checkpoint(run[0], mesh="2x1x4", batch_size=3)
    model.set_params(model.params, 0)  # drops the sampler that loading built, as a training run has none
    with partitioning.sharding_scope(model.mesh):
        got = model.generate_until(
            requests("generate_until", [("The cat sat on the", {"until": ["."], "max_gen_toks": 8})])
        )
    assert got == lm.generate_until(
        requests("generate_until", [("The cat sat on the", {"until": ["."], "max_gen_toks": 8})])
    )
