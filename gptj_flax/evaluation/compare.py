"""Compare two lm-eval results files task by task: GPT-4chan's table against GPT-J, with significance.

Every task and metric found in both files gets both values, their standard errors, GPT-4chan's
significance score (:func:`significance`) and a mark saying which model is better and how clearly
(:func:`mark`), kept as GPT-4chan computed them so the published table can be compared.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from gptj_flax.evaluation.errors import EvaluationError

SIGNIFICANT = 2.0
HIGHLY_SIGNIFICANT = 3.0


def significance(a: float, a_stderr: float | None, b: float, b_stderr: float | None) -> float | None:
    """``(a − b) / mean(stderr_a, stderr_b)``; ``None`` when a stderr is missing (lm-eval's "N/A") or both are 0.

    The mean of the two standard errors, not the textbook sqrt(stderr_a² + stderr_b²): for equal
    errors this z is √2 times the usual one, so it marks differences more readily.
    """
    if a_stderr is None or b_stderr is None:
        return None
    scale = (a_stderr + b_stderr) / 2
    return None if scale <= 0 else (a - b) / scale


def mark(z: float | None, higher_is_better: bool = True) -> str:
    """``""``, ``"+"``/``"-"`` (|z| ≥ 2) or ``"++"``/``"--"`` (|z| ≥ 3); ``+`` when A is the better one.

    The thresholds are the usual ≈95% and ≈99.7% two-sided levels of a z score. "Better" is higher,
    or lower for metrics the results file's ``higher_is_better`` says so of (perplexities).
    """
    if z is None or abs(z) < SIGNIFICANT:
        return ""
    a_better = (z > 0) == higher_is_better
    sign = "+" if a_better else "-"
    return sign * 2 if abs(z) >= HIGHLY_SIGNIFICANT else sign


@dataclasses.dataclass(frozen=True)
class MetricComparison:
    """One row of the table."""

    task: str
    metric: str  # "acc"; a filter other than lm-eval's default "none" is appended: "exact_match[strict-match]"
    a: float
    a_stderr: float | None
    b: float
    b_stderr: float | None
    higher_is_better: bool = True

    @property
    def z(self) -> float | None:
        return significance(self.a, self.a_stderr, self.b, self.b_stderr)

    @property
    def mark(self) -> str:
        return mark(self.z, self.higher_is_better)


@dataclasses.dataclass(frozen=True)
class Comparison:
    rows: list[MetricComparison]
    only_a: list[str]  # tasks (or "task metric") found in A's results only
    only_b: list[str]


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """An lm-eval results JSON (``lm_eval --output_path`` or ``scripts/eval.py harness``).

    Raises :class:`EvaluationError` naming the file when it is not JSON text or holds no results.
    """
    with open(path, "rb") as f:
        data = f.read()
    try:
        results = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise EvaluationError(f"{path}: not an lm-eval results file: not UTF-8 text at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise EvaluationError(
            f"{path}: not an lm-eval results file: not JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    if not isinstance(results, dict) or not isinstance(results.get("results"), dict):
        raise EvaluationError(f"{path}: not an lm-eval results file (no 'results' section)")
    return results


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # "N/A" and friends
    return float(value)


def _metrics(task_results: Mapping[str, Any]) -> dict[str, tuple[float, float | None]]:
    """``{"acc": (value, stderr), …}`` from lm-eval's ``{"acc,none": …, "acc_stderr,none": …}``."""
    out = {}
    for key, value in task_results.items():
        metric, comma, filter_name = key.partition(",")
        number = _number(value)
        if not comma or metric.endswith("_stderr") or number is None:
            continue
        name = metric if filter_name == "none" else f"{metric}[{filter_name}]"
        out[name] = (number, _number(task_results.get(f"{metric}_stderr,{filter_name}")))
    return out


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> Comparison:
    """Row per (task, metric) found in both results, in A's task order, then metric name order."""
    rows, only_a = [], []
    only_b = [task for task in b["results"] if task not in a["results"]]
    for task, task_results in a["results"].items():
        if task not in b["results"]:
            only_a.append(task)
            continue
        metrics_a, metrics_b = _metrics(task_results), _metrics(b["results"][task])
        only_a += [f"{task} {name}" for name in sorted(set(metrics_a) - set(metrics_b))]
        only_b += [f"{task} {name}" for name in sorted(set(metrics_b) - set(metrics_a))]
        for name in sorted(set(metrics_a) & set(metrics_b)):
            base = name.split("[")[0]
            known = {**b.get("higher_is_better", {}).get(task, {}), **a.get("higher_is_better", {}).get(task, {})}
            rows.append(
                MetricComparison(
                    task, name, *metrics_a[name], *metrics_b[name], higher_is_better=bool(known.get(base, True))
                )
            )
    return Comparison(rows, only_a, only_b)


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def to_markdown(comparison: Comparison, name_a: str, name_b: str) -> str:
    """The table, then what could not be compared and the legend."""
    lines = [
        f"| Task | Metric | {name_a} | ± | {name_b} | ± | z | Sig. |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for row in comparison.rows:
        arrow = "↑" if row.higher_is_better else "↓"
        z = "n/a" if row.z is None else f"{row.z:+.2f}"
        lines.append(
            f"| {row.task} | {row.metric} {arrow} | {_cell(row.a)} | {_cell(row.a_stderr)} | "
            f"{_cell(row.b)} | {_cell(row.b_stderr)} | {z} | {row.mark} |"
        )
    lines.append("")
    if comparison.only_a:
        lines.append(f"Only in {name_a}: {', '.join(comparison.only_a)}.")
    if comparison.only_b:
        lines.append(f"Only in {name_b}: {', '.join(comparison.only_b)}.")
    lines.append(
        f"z = ({name_a} − {name_b}) / mean of the two stderrs. Sig.: + or - when |z| ≥ {SIGNIFICANT:g}, "
        f"++ or -- when |z| ≥ {HIGHLY_SIGNIFICANT:g}; + means {name_a} is better (↑ higher, ↓ lower is "
        "better)."
    )
    return "\n".join(lines) + "\n"


def plot(comparison: Comparison, name_a: str, name_b: str, path: str | os.PathLike) -> None:
    """A PNG: one panel per metric, a pair of bars (± stderr) per task, the mark above each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not comparison.rows:
        raise ValueError("nothing to plot: the two results files share no task and metric")
    metrics = list(dict.fromkeys(row.metric for row in comparison.rows))
    fig, axes = plt.subplots(
        len(metrics),
        1,
        squeeze=False,
        figsize=(
            max(6.0, 1.2 * max(sum(r.metric == m for r in comparison.rows) for m in metrics) + 2),
            3.2 * len(metrics),
        ),
    )
    width = 0.38
    for ax, metric in zip(axes[:, 0], metrics):
        rows = [row for row in comparison.rows if row.metric == metric]
        x = np.arange(len(rows))

        def errors(stderrs: Sequence[float | None]) -> list[float]:
            return [0.0 if s is None else s for s in stderrs]

        ax.bar(
            x - width / 2,
            [r.a for r in rows],
            width,
            yerr=errors([r.a_stderr for r in rows]),
            capsize=3,
            label=name_a,
            color="tab:blue",
        )
        ax.bar(
            x + width / 2,
            [r.b for r in rows],
            width,
            yerr=errors([r.b_stderr for r in rows]),
            capsize=3,
            label=name_b,
            color="tab:gray",
        )
        for i, row in enumerate(rows):
            if row.mark:
                top = max(row.a + (row.a_stderr or 0), row.b + (row.b_stderr or 0))
                ax.annotate(
                    row.mark,
                    (x[i], top),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    fontweight="bold",
                    color="tab:green" if row.mark.startswith("+") else "tab:red",
                )
        ax.set_xticks(x, [r.task for r in rows], rotation=20, ha="right")
        half = max(len(rows), 3) / 2  # bars keep their width (and stay centred) in a panel of few tasks
        ax.set_xlim((len(rows) - 1) / 2 - half, (len(rows) - 1) / 2 + half)
        ax.set_title(f"{metric} ({'higher' if rows[0].higher_is_better else 'lower'} is better)")
        ax.margins(y=0.15)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)
