"""GPT-4chan's comparison table: z = (a − b) / mean(stderr_a, stderr_b) and its marks, on hand-computed
cases, as markdown and as a chart, through ``scripts/eval.py compare``."""

import json

import pytest

from gptj_flax.evaluation.compare import compare, load_results, mark, plot, significance, to_markdown
from tests import commands


def results(tasks: dict, higher_is_better: dict | None = None) -> dict:
    """An lm-eval results file: {task: {metric: (value, stderr)}}."""
    out = {"results": {}, "higher_is_better": higher_is_better or {}}
    for task, metrics in tasks.items():
        entry = {"alias": task, "sample_len": 100}
        for metric, (value, stderr) in metrics.items():
            name, _, filter_name = metric.partition(",")
            entry[f"{name},{filter_name or 'none'}"] = value
            entry[f"{name}_stderr,{filter_name or 'none'}"] = stderr
        out["results"][task] = entry
    return out


A = results(
    {
        "piqa": {"acc": (0.80, 0.01), "acc_norm": (0.77, 0.01)},
        "winogrande": {"acc": (0.60, 0.02)},
        "lambada_openai": {"acc": (0.70, 0.006), "perplexity": (3.50, 0.08)},
        "hellaswag": {"acc": (0.50, "N/A")},
        "gsm8k": {"exact_match,strict-match": (0.10, 0.01)},
        "only_in_a": {"acc": (0.5, 0.1)},
    },
    {"lambada_openai": {"acc": True, "perplexity": False}},
)
B = results(
    {
        "piqa": {"acc": (0.765, 0.01), "acc_norm": (0.76, 0.01)},
        "winogrande": {"acc": (0.653, 0.0134)},
        "lambada_openai": {"acc": (0.697, 0.0064), "perplexity": (3.99, 0.08)},
        "hellaswag": {"acc": (0.661, 0.0047)},
        "gsm8k": {"exact_match,strict-match": (0.05, 0.01), "exact_match,flexible-extract": (0.06, 0.01)},
        "only_in_b": {"acc": (0.5, 0.1)},
    },
    {"lambada_openai": {"acc": True, "perplexity": False}},
)


@pytest.mark.parametrize(
    "a, sa, b, sb, z, expected_mark",
    [
        (0.80, 0.01, 0.765, 0.01, 3.5, "++"),  # clearly better
        (0.77, 0.01, 0.76, 0.01, 1.0, ""),  # within the noise
        (0.60, 0.02, 0.653, 0.0134, -3.1737, "--"),  # -0.053 / mean(0.02, 0.0134) = -0.053 / 0.0167
        (0.70, 0.006, 0.697, 0.0064, 0.4839, ""),  # 0.003 / 0.0062
        (0.75, 0.125, 0.5, 0.125, 2.0, "+"),  # |z| = 2 exactly (binary-exact numbers): marked
        (0.74, 0.125, 0.5, 0.125, 1.92, ""),  # just under 2
        (0.125, 0.125, 0.5, 0.125, -3.0, "--"),  # |z| = 3 exactly: two marks
        (0.25, 0.125, 0.5, 0.125, -2.0, "-"),
        (0.5, 0.0625, 0.25, 0.1875, 2.0, "+"),  # unequal stderrs: their mean, 0.125
    ],
)
def test_significance_and_marks_for_hand_computed_cases(a, sa, b, sb, z, expected_mark):
    assert significance(a, sa, b, sb) == pytest.approx(z, abs=1e-4)
    assert mark(significance(a, sa, b, sb)) == expected_mark


def test_lower_is_better_metrics_flip_the_mark_and_missing_stderrs_give_none():
    assert significance(3.50, 0.08, 3.99, 0.08) == pytest.approx(-6.125)
    assert mark(-6.125, higher_is_better=False) == "++"  # A's perplexity is lower: A is better
    assert mark(2.5, higher_is_better=False) == "-"
    assert significance(0.5, None, 0.6, 0.01) is None and mark(None) == ""
    assert significance(0.5, 0.0, 0.6, 0.0) is None


def test_compare_rows_table_and_chart(tmp_path):
    comparison = compare(A, B)
    rows = {(r.task, r.metric): r for r in comparison.rows}
    assert [(r.task, r.metric) for r in comparison.rows] == [
        ("piqa", "acc"),
        ("piqa", "acc_norm"),
        ("winogrande", "acc"),
        ("lambada_openai", "acc"),
        ("lambada_openai", "perplexity"),
        ("hellaswag", "acc"),
        ("gsm8k", "exact_match[strict-match]"),
    ]
    assert {key: row.mark for key, row in rows.items()} == {
        ("piqa", "acc"): "++",
        ("piqa", "acc_norm"): "",
        ("winogrande", "acc"): "--",
        ("lambada_openai", "acc"): "",
        ("lambada_openai", "perplexity"): "++",
        ("hellaswag", "acc"): "",
        ("gsm8k", "exact_match[strict-match]"): "++",
    }
    assert rows[("hellaswag", "acc")].z is None and rows[("hellaswag", "acc")].a_stderr is None
    assert comparison.only_a == ["only_in_a"]
    assert comparison.only_b == ["only_in_b", "gsm8k exact_match[flexible-extract]"]

    table = to_markdown(comparison, "GPT-4chan", "GPT-J")
    lines = table.splitlines()
    assert lines[0] == "| Task | Metric | GPT-4chan | ± | GPT-J | ± | z | Sig. |"
    assert "| piqa | acc ↑ | 0.8000 | 0.0100 | 0.7650 | 0.0100 | +3.50 | ++ |" in lines
    assert "| lambada_openai | perplexity ↓ | 3.5000 | 0.0800 | 3.9900 | 0.0800 | -6.13 | ++ |" in lines
    assert "| hellaswag | acc ↑ | 0.5000 |  | 0.6610 | 0.0047 | n/a |  |" in lines
    assert "Only in GPT-4chan: only_in_a." in lines

    chart = tmp_path / "chart.png"
    plot(comparison, "GPT-4chan", "GPT-J", chart)
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_script_compare(tmp_path, run_command):
    (tmp_path / "gpt4chan.json").write_text(json.dumps(A))
    (tmp_path / "gptj.json").write_text(json.dumps(B))
    (tmp_path / "broken.json").write_text(json.dumps({"no": "results"}))
    eval_script = commands.script("eval.py")
    done = run_command(
        eval_script,
        "compare",
        tmp_path / "gpt4chan.json",
        tmp_path / "gptj.json",
        "--markdown",
        tmp_path / "table.md",
        "--plot",
        tmp_path / "chart.png",
    )
    assert done.status == 0, done.err
    assert done.out.startswith("| Task | Metric | gpt4chan | ± | gptj | ± | z | Sig. |")
    assert (tmp_path / "table.md").read_text() in done.out and (tmp_path / "chart.png").stat().st_size > 0
    assert load_results(tmp_path / "gptj.json") == B
    bad = run_command(eval_script, "compare", tmp_path / "broken.json", tmp_path / "gptj.json")
    assert bad.status == 1 and "not an lm-eval results file" in bad.err
