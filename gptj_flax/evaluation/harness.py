"""lm-evaluation-harness backed by gptj_flax: the ``gptj_flax`` model of ``lm_eval``.

Importing this module registers the model with lm-eval, which is what the ``gptj-lm-eval`` command
(lm-eval's command line) and ``gptj-eval harness`` do::

    gptj-lm-eval --model gptj_flax --model_args checkpoint=runs/demo --tasks lambada_openai piqa

(lm-eval 0.4 discovers no models from other packages, so its own ``lm_eval`` command cannot.)

GPT-J's convention, from the original evaluation: every sequence starts with the EOS token, the
model's only "start of text". A (context, continuation) pair is scored as
``[EOS] + context + continuation`` — with an empty context, ``[EOS] + continuation`` — and the
result is the summed log-probability of the continuation tokens, plus whether greedy decoding
would have produced them. Generation is greedy unless the task asks for sampling, from
``[EOS] + context``, and stops at the EOS, at the task's ``until`` strings or after
``max_gen_toks`` tokens.

On a multi-host slice every process builds the model and runs every request (the mesh spans all
processes, and each compiled call runs on all of them in lockstep); only process 0 writes results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax
import lm_eval.models  # noqa: F401  (lm-eval imports its own models only while its registry is empty: before ours)
from jax.sharding import Mesh
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import (
    get_rolling_token_windows,
    handle_non_serializable,
    make_disjoint_window,
    simple_parse_args_string,
)
from tqdm.auto import tqdm

from gptj_flax import partitioning
from gptj_flax.config import ModelConfig, dtype_name
from gptj_flax.evaluation.errors import EvaluationError
from gptj_flax.evaluation.scoring import TokenScorer
from gptj_flax.sampling import LanguageModel, MissingTokenizer, load

MODEL_NAME = "gptj_flax"
DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_GEN_TOKS = 256


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """One ``generate_until`` request's ``gen_kwargs``, in :meth:`LanguageModel.generate`'s terms."""

    until: tuple[str, ...]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    min_p: float
    repetition_penalty: float

    # lm-eval task keys → generate() arguments (with their "off" values when a task leaves them out)
    FILTERS: ClassVar[dict[str, float]] = {
        "top_k": 0,
        "top_p": 1.0,
        "typical_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }

    @classmethod
    def parse(cls, gen_kwargs: Mapping[str, Any], default_max_new_tokens: int) -> GenerationSettings:
        """HuggingFace-style task settings: ``do_sample`` false (or ``temperature`` 0) means greedy.

        Unknown keys are an error rather than silently dropped: a task asking for beam search must
        not quietly get greedy decoding.
        """
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None)
        until = () if until is None else (until,) if isinstance(until, str) else tuple(until)
        max_new_tokens = int(kwargs.pop("max_gen_toks", default_max_new_tokens))
        do_sample = kwargs.pop("do_sample", None)
        temperature = kwargs.pop("temperature", None)
        temperature = float(temperature) if temperature is not None else (1.0 if do_sample else 0.0)
        if do_sample is False:
            temperature = 0.0
        filters = {}
        for name, off in cls.FILTERS.items():
            value = kwargs.pop(name, None)
            filters[name] = off if value is None else type(off)(value)
        if kwargs:
            raise ValueError(
                f"gen_kwargs {sorted(kwargs)} are not supported by {MODEL_NAME}; supported: until, "
                f"max_gen_toks, do_sample, temperature, {', '.join(cls.FILTERS)}"
            )
        if max_new_tokens < 1:
            raise ValueError(f"max_gen_toks must be >= 1, got {max_new_tokens}")
        return cls(
            until=tuple(s for s in until if s), max_new_tokens=max_new_tokens, temperature=temperature, **filters
        )


def _positive_int(name: str, value) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"{name} must be a positive integer, got {value!r}"
            + ("; automatic batch sizing is not supported: give a number" if name == "batch_size" else "")
        )
    return value


@register_model(MODEL_NAME)
class GPTJFlaxLM(TemplateLM):
    """An lm-eval ``LM`` over gptj_flax parameters on any mesh.

    ``loglikelihood`` and ``loglikelihood_rolling`` run through one compiled, length-bucketed
    :class:`TokenScorer`; ``generate_until`` through :meth:`LanguageModel.generate`. lm-eval
    builds it from ``model_args`` with :meth:`from_checkpoint`; a training run from its live
    parameters with the constructor.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Any,
        tokenizer,
        mesh: Mesh,
        *,
        step: int | None = None,
        checkpoint: str | None = None,
        batch_size: int | str = DEFAULT_BATCH_SIZE,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        seed: int = 0,
    ):
        """
        Args:
          config, params: the model and its ``params`` collection (either layer layout), placed on
            ``mesh`` as the partitioning rules say (a checkpoint restored onto it, a training state).
          tokenizer: a HuggingFace tokenizer with an EOS token: lm-eval tasks are text.
          step, checkpoint: where the parameters come from, recorded in the results.
          batch_size: requests per compiled call (``lm_eval --batch_size``).
          max_gen_toks: generation length when a task does not set one.
          seed: the sampling seed of tasks that sample (``do_sample``); greedy tasks do not use it.
        """
        super().__init__()
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise ValueError(
                f"{MODEL_NAME}: lm-eval tasks are text: the model needs a tokenizer with an EOS token "
                "(save one beside the checkpoint or pass tokenizer=DIR)"
            )
        self.config, self.params, self.tokenizer, self.mesh = config, params, tokenizer, mesh
        self.step, self.checkpoint = step, checkpoint
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self.seed = int(seed)
        self.scorer = TokenScorer(config, mesh, batch_size=self.batch_size, valid_vocab=len(tokenizer))
        self._sampler: LanguageModel | None = None

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str | os.PathLike,
        *,
        mesh=None,
        dtype: str | None = None,
        step: int | None = None,
        tokenizer: str | os.PathLike | None = None,
        **kwargs,
    ) -> GPTJFlaxLM:
        """Load a checkpoint with :func:`gptj_flax.load` (``lm_eval --model_args checkpoint=DIR``).

        Args:
          checkpoint: an Orbax run or step directory, or a HuggingFace directory (``hf:DIR``).
          mesh: a layout name (``tp``, ``dp``, …), sizes ``D,F,M`` (``DxFxM`` inside
            ``model_args``, which lm-eval splits on commas), a 3-tuple or a ``Mesh``; default one device.
          dtype: parameter and compute dtype (``float32``/``fp32``, ``bfloat16``/``bf16``,
            ``float16``/``fp16``); default as :func:`gptj_flax.load` chooses.
          step: this step instead of the latest; ``tokenizer``: a directory overriding the saved one.
          kwargs: the constructor's ``batch_size``, ``max_gen_toks``, ``seed``.
        """
        loaded = load(checkpoint, mesh=mesh, dtype=dtype, step=step, tokenizer=tokenizer)
        if loaded.tokenizer is None:
            raise MissingTokenizer(f"{checkpoint} has no tokenizer saved beside it; pass tokenizer=DIR")
        decoder = loaded.decoder  # its parameters serve the scorer too: one copy of the weights
        model = cls(
            decoder.config,
            decoder.params,
            loaded.tokenizer,
            loaded.mesh,
            step=loaded.step,
            checkpoint=os.fspath(checkpoint),
            **kwargs,
        )
        model._sampler = loaded
        return model

    @classmethod
    def create_from_arg_obj(cls, arg_dict: Mapping[str, Any], additional_config: Mapping[str, Any] | None = None):
        """lm-eval's way in: ``model_args`` plus its own ``batch_size``, ``max_batch_size``, ``device``.

        lm-eval passes a torch ``device`` to every model; JAX places arrays by the mesh, so it is
        dropped. ``max_batch_size`` only bounds automatic batch sizing, which this model does not do.
        """
        extra = {key: value for key, value in (additional_config or {}).items() if value is not None}
        extra.pop("device", None)
        if "max_batch_size" in extra:
            raise ValueError(
                f"{MODEL_NAME} does not size batches automatically; give --batch_size, not --max_batch_size"
            )
        args = {**extra, **arg_dict}  # model_args win over lm-eval's defaults
        if "checkpoint" not in args:
            raise ValueError(f"{MODEL_NAME} needs --model_args checkpoint=DIR")
        return cls.from_checkpoint(args.pop("checkpoint"), **args)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Mapping[str, Any] | None = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def set_params(self, params: Any, step: int | None = None) -> None:
        """Evaluate other parameters of the same model on the same mesh (a training run's latest).

        Scoring recompiles nothing and copies nothing: the scorer takes the parameters as they
        are. The sampler, which holds its own copy, is dropped (``None`` releases everything).
        """
        self.params, self.step, self._sampler = params, step, None

    def sampler(self) -> LanguageModel:
        """The generation model, built at first use and kept (with its compiled programs) until
        :meth:`set_params`. It lays the weights out its own way: a second copy of them."""
        if self._sampler is None:
            # A training run calls the harness inside its sharding scope, whose logical rules would
            # make building the parameters' abstract shapes constrain concrete values (a TypeError);
            # the sampler places everything itself from its own mesh and rules.
            with nn.logical_axis_rules(()):
                self._sampler = LanguageModel(
                    self.config, self.params, tokenizer=self.tokenizer, mesh=self.mesh, step=self.step
                )
        return self._sampler

    # -- what lm-eval asks of a model -------------------------------------------------------
    # lm-eval gives each rank of a torch data-parallel job a share of the requests. Processes of a
    # slice are not such ranks: every one runs every request, the mesh spanning them all.
    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def param_dtype(self) -> str:
        """The dtype the parameters are held in (``config.dtype`` is the compute dtype)."""
        return dtype_name(jax.tree.leaves(self.params)[0].dtype)

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def max_length(self) -> int:
        return self.config.max_len

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path or MODEL_NAME).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None) -> list[int]:
        """Plain BPE ids, whatever lm-eval asks: the only special token, the EOS prefix, is added by
        the scoring and generation code itself."""
        return self.tokenizer.encode(string, add_special_tokens=False)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def get_model_info(self) -> dict:
        """Written into the results' ``config``, for telling runs apart."""
        return {
            "checkpoint": self.checkpoint,
            "step": self.step,
            "parameters": self.config.param_count(),
            "dtype": self.config.dtype,
            "param_dtype": self.param_dtype,
            "max_length": self.config.max_len,
            "mesh": partitioning.mesh_shape(self.mesh),
        }

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Score each (context, continuation) as ``[EOS] + context + continuation`` (see the module doc)."""
        encoded = []
        for context, continuation in (request.args for request in requests):
            if context:
                context_ids, continuation_ids = self._encode_pair(context, continuation)
            else:
                context_ids, continuation_ids = [], self.tok_encode(continuation)
            encoded.append(((context, continuation), [self.eot_token_id, *context_ids], continuation_ids))
        return self._loglikelihood_tokens(encoded, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``requests``: ``(cache key, context ids, continuation ids)``, as lm-eval's TemplateLM passes them."""
        results = self.scorer.score(
            self.params, [(ctx, cont) for _, ctx, cont in requests], progress=not disable_tqdm, desc="loglikelihood"
        )
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood over disjoint ``max_length`` windows, the first after the EOS.

        lm-eval's own window utilities cut the text, so every token is predicted exactly once,
        each window with as much preceding text as fits.
        """
        windows, owners = [], []
        texts = [request.args[0] for request in requests]
        for index, text in enumerate(texts):
            token_windows = get_rolling_token_windows(
                self.tok_encode(text), prefix_token=self.eot_token_id, max_seq_len=self.max_length, context_len=1
            )
            for context, prediction in map(make_disjoint_window, token_windows):
                windows.append((context, prediction))
                owners.append(index)
        scores = self.scorer.score(self.params, windows, progress=not disable_tqdm, desc="loglikelihood_rolling")
        totals = [0.0] * len(texts)
        for owner, (log_prob, _) in zip(owners, scores):
            totals[owner] += log_prob
        for text, total in zip(texts, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context (after the EOS prefix) until a stop string, the EOS or ``max_gen_toks``.

        The context is cut from the left so that it and the new tokens fit the model's context.
        Requests are batched longest first; each keeps its own settings inside a batch.
        """
        if not requests:
            return []
        sampler = self.sampler()
        jobs = []
        for context, gen_kwargs in (request.args for request in requests):
            settings = GenerationSettings.parse(gen_kwargs, self.max_gen_toks)
            if settings.max_new_tokens >= self.max_length:
                raise ValueError(
                    f"max_gen_toks={settings.max_new_tokens} leaves no room for a prompt in the "
                    f"model's context of {self.max_length} tokens"
                )
            prompt = [self.eot_token_id, *self.tok_encode(context)][-(self.max_length - settings.max_new_tokens) :]
            jobs.append((context, gen_kwargs, prompt, settings))
        order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][2]))
        outputs = [""] * len(jobs)
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, desc="generate_until", unit="batch", disable=disable_tqdm):
            settings = [jobs[i][3] for i in batch]

            def each(field: str, settings: list = settings) -> list:
                return [getattr(s, field) for s in settings]

            completions = sampler.generate(
                [jobs[i][2] for i in batch],
                each("max_new_tokens"),
                temperature=each("temperature"),
                top_k=each("top_k"),
                top_p=each("top_p"),
                typical_p=each("typical_p"),
                min_p=each("min_p"),
                repetition_penalty=each("repetition_penalty"),
                stop=[list(s.until) for s in settings],
                seed=[self.seed] * len(batch),
            )
            for i, completion in zip(batch, completions):
                outputs[i] = completion.text
                context, gen_kwargs = jobs[i][:2]
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), completion.text)
        return outputs


@contextlib.contextmanager
def _bootstrap_in_process():
    """lm-eval bootstraps some stderrs in a forked process pool; forking a process whose JAX runtime
    has threads running can deadlock, so inside a training run bootstrap in this process."""
    previous = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["DISABLE_MULTIPROC"]
        else:
            os.environ["DISABLE_MULTIPROC"] = previous


def task_manager(include_path: str | os.PathLike | None = None, *, include_defaults: bool = True):
    """lm-eval's index of tasks: its ~13,000 built-in YAML files (about 10 s to read) and ``include_path``'s.

    Build it once and pass it to every :func:`run_tasks` call; ``include_defaults=False`` indexes
    only ``include_path``.
    """
    from lm_eval.tasks import TaskManager

    return TaskManager(
        include_path=None if include_path is None else os.fspath(include_path), include_defaults=include_defaults
    )


def unknown_tasks(tasks: Sequence[str], tasks_index) -> list[str]:
    """The entries of ``tasks`` that are neither a task, group or tag of ``tasks_index`` (a
    :func:`task_manager`) nor a task YAML file, each quoted, with the closest known name if one is near."""
    known = tasks_index.all_tasks
    names = set(known)
    unknown = []
    for task in tasks:
        if task in names or os.path.isfile(task):
            continue
        close = difflib.get_close_matches(task, known, n=1)
        unknown.append(f"{task!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return unknown


def run_tasks(
    model: GPTJFlaxLM,
    tasks: Sequence[str],
    *,
    num_fewshot: int | None = None,
    limit: float | None = None,
    tasks_index=None,
    bootstrap_iters: int = 100_000,
    log_samples: bool = False,
    seed: int | None = 1234,
    in_process_bootstrap: bool = False,
) -> dict:
    """Run lm-eval ``tasks`` on ``model``; returns lm-eval's results dictionary (``results``, ``configs``, …).

    Args:
      tasks_index: a :func:`task_manager`; default lm-eval's built-in tasks.
      bootstrap_iters: resamples for the stderr of metrics without a closed form (perplexities);
        0 computes no stderr at all.
      seed: lm-eval's seeds (Python, numpy, torch, few-shot sampling), as its CLI sets them.
        ``None`` leaves the process's global generators alone and draws few-shot examples with
        a fixed seed — what a training run wants.
      in_process_bootstrap: never fork for bootstrapping (see ``_bootstrap_in_process``).
    """
    from lm_eval import simple_evaluate

    tasks_index = tasks_index if tasks_index is not None else task_manager()
    unknown = unknown_tasks(tasks, tasks_index)
    if unknown:
        raise EvaluationError(
            f"lm-eval knows no task {', '.join(unknown)}; the names it knows are the task index's all_tasks"
        )
    with _bootstrap_in_process() if in_process_bootstrap else contextlib.nullcontext():
        results = simple_evaluate(
            model=model,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=tasks_index,
            bootstrap_iters=bootstrap_iters,
            log_samples=log_samples,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=1234 if seed is None else seed,
            batch_size=model.batch_size,
        )
    results["config"]["model"] = MODEL_NAME
    return results


def write_results(results: Mapping[str, Any], path: str | os.PathLike) -> None:
    """lm-eval's results as JSON at ``path``, replaced whole (a crash never leaves half a file).

    On a multi-host slice every process holds the same results; call this on process 0 only.
    """
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
    os.replace(tmp, path)


def flat_metrics(results: Mapping[str, Any], prefix: str = "harness") -> dict[str, float]:
    """``{"harness/TASK/METRIC": value}`` for every finite numeric metric (stderrs too) of lm-eval results.

    A filter other than lm-eval's default ``none`` is kept: ``exact_match[strict-match]``.
    """
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, comma, filter_name = key.partition(",")
            if not comma or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            name = metric if filter_name == "none" else f"{metric}[{filter_name}]"
            out[f"{prefix}/{task}/{name}"] = float(value)
    return out
