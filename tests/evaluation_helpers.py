"""Helpers of the evaluation tests: a tiny checkpoint holding a HuggingFace model's weights and a
locally trained tokenizer, and lm-eval task files written on the spot (nothing is downloaded)."""

from __future__ import annotations

import json
import os
import textwrap

from gptj_flax.checkpoint import Checkpointer
from gptj_flax.config import Config, TrainConfig
from gptj_flax.data import save_tokenizer, train_bpe_tokenizer
from tests.helpers import hf_model, params_matching, tiny_config

TOKENIZER_VOCAB = 300
# The embedding is padded past the tokenizer (as GPT-J's 50400 > 50257); a short context makes
# rolling windows and left truncation happen on short texts.
CFG = tiny_config(vocab_size=320, max_len=64)
CORPUS = [
    "The cat sat on the mat. The dog sat on the log. ",
    "One two three four five six seven eight nine ten. ",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Paris is the capital of France. Rome is the capital of Italy. ",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. ",
] * 10


def make_tokenizer():
    return train_bpe_tokenizer(CORPUS, vocab_size=TOKENIZER_VOCAB, from_files=False, min_frequency=1)


def make_checkpoint(directory) -> object:
    """Save a random HF GPT-J's weights and a tokenizer as a run in ``directory``; return the HF model."""
    model = hf_model(CFG)
    ckpt = Checkpointer(directory)
    config = Config(model=CFG, train=TrainConfig(batch_size=2))
    ckpt.save(0, params=params_matching(model, CFG)["params"], config=config)
    ckpt.close()
    save_tokenizer(make_tokenizer(), os.path.join(directory, "tokenizer"))
    return model


CHOICE_DOCS = [
    {"question": "The cat sat on the", "choices": ["mat", "moon", "capital"], "label": 0},
    {"question": "One two three", "choices": ["four", "dog", "Paris"], "label": 0},
    {"question": "Paris is the capital of", "choices": ["France", "fox"], "label": 0},
    {"question": "The quick brown", "choices": ["fox", "box", "cat", "log"], "label": 0},
]
# Four choices after a context of several prefix-cache pages, as lm-eval's multiple-choice tasks ask.
LONG_CHOICE_DOCS = [
    {
        "question": "The quick brown fox jumps over the lazy dog. The cat sat on the mat. Paris is the capital of",
        "choices": ["France", "Italy", "fox", "mat"],
        "label": 0,
    },
    {
        "question": "The quick brown fox jumps over the lazy dog. The dog sat on the log. Rome is the capital of",
        "choices": ["Italy", "France", "dog", "log"],
        "label": 0,
    },
]
TEXT_DOCS = [
    {"text": "The quick brown fox jumps over the lazy dog. " * 4},  # longer than the 64-token context
    {"text": "Rome is the capital of Italy."},
]
GENERATION_DOCS = [
    {"prompt": "The cat sat on the", "answer": "mat"},
    {"prompt": "def add(a, b):", "answer": "return a + b"},
]


def write_tasks(directory) -> str:
    """Four lm-eval tasks (multiple choice, the same after long contexts, rolling perplexity, generation)
    over jsonl files; returns the directory to pass as ``include_path``."""
    os.makedirs(directory, exist_ok=True)
    files = (
        ("choice", CHOICE_DOCS),
        ("long_choice", LONG_CHOICE_DOCS),
        ("text", TEXT_DOCS),
        ("generation", GENERATION_DOCS),
    )
    for name, docs in files:
        with open(os.path.join(directory, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in docs)
    common = "dataset_path: json\ntest_split: test\n"

    def data_files(name):
        return f"dataset_kwargs:\n  data_files:\n    test: {os.path.join(directory, name + '.jsonl')}\n"

    choice = textwrap.dedent("""\
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{label}}"
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
        """)
    tasks = {
        "tiny_choice": choice + data_files("choice"),
        "tiny_long_choice": choice + data_files("long_choice"),
        "tiny_text": textwrap.dedent("""\
            output_type: loglikelihood_rolling
            doc_to_text: ""
            doc_to_target: "{{text}}"
            metric_list:
              - metric: word_perplexity
              - metric: bits_per_byte
            """)
        + data_files("text"),
        "tiny_generation": textwrap.dedent("""\
            output_type: generate_until
            doc_to_text: "{{prompt}}"
            doc_to_target: "{{answer}}"
            generation_kwargs:
              until: ["\\n", "."]
              max_gen_toks: 8
              do_sample: false
            metric_list:
              - metric: exact_match
                aggregation: mean
                higher_is_better: true
            """)
        + data_files("generation"),
    }
    for task, body in tasks.items():
        with open(os.path.join(directory, f"{task}.yaml"), "w") as f:
            f.write(f"task: {task}\n{common}{body}")
    return directory
