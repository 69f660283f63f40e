"""Server settings: each is a command-line flag and also an environment variable.

A setting's variable is its name with the ``GPTJ_FLAX_`` prefix, in any case: ``GPTJ_FLAX_PORT=9000``,
``GPTJ_FLAX_API_KEYS_FILE=keys.txt``. The prefix keeps generic variables (``HOST``, ``PORT``) that
other tools set from reconfiguring the server. The four settings the GPT-4chan server read from
the environment (``QUEUE_SIZE``, ``LOG_FILE``, ``API_KEYS_FILE``, ``PRE_PROMPT_LENGTH``, in any case)
are still taken without the prefix, with a deprecation notice. A flag given on the command line
wins over the environment, which wins over the default. Paths are made absolute as they are read.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from gptj_flax.config import KV_CACHE_DTYPES, QUANTIZATIONS, ConfigError, dtype_name
from gptj_flax.convert.hf import HF_PREFIX
from gptj_flax.errors import GptjFlaxError
from gptj_flax.sampling.adapter_bank import split_adapter

logger = logging.getLogger(__name__)

LOG_FORMATS = ("jsonl", "transcript")
PREFILL_PLACES = ("between", "beside")
LOG_LEVELS = ("debug", "info", "warning", "error")
ENV_PREFIX = "GPTJ_FLAX_"
# The GPT-4chan server's own settings, which its deployments set without a prefix.
LEGACY_ENV = ("queue_size", "log_file", "api_keys_file", "pre_prompt_length")
# One step a call: on a 2-core CPU `bench.py serve` reached a smaller share of its bound, and later
# first tokens, with 4 (see docs/performance.md). MAX keeps a call's token buffers, and the time a
# waiting prompt may wait for the call in flight, small.
DEFAULT_DECODE_STEPS = 1
MAX_DECODE_STEPS = 64
PATH_SETTINGS = ("checkpoint", "api_keys_file", "log_file", "chat_template")
# Where a request's model names no adapter's projections: the training default's (config.LoraConfig).
DEFAULT_ADAPTER_RANK, DEFAULT_ADAPTER_TARGETS = 8, ("q_proj", "v_proj")


class ServingError(GptjFlaxError):
    """The server cannot start as configured; the message says what to change."""


class SettingsError(ServingError, ValueError):
    """A setting is missing or out of range; the message names the flag and its variable."""


def boolean(text: str) -> bool:
    """A yes/no setting: 1, true, yes, on or 0, false, no, off, in any case."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a yes/no value: {text!r}")


def _setting(default: Any, parse: Callable[[str], Any], help: str, choices: tuple[str, ...] | None = None):
    return dataclasses.field(default=default, metadata={"parse": parse, "help": help, "choices": choices})


def adapter_list(text: str) -> tuple[str, ...]:
    """``--adapter`` values from one string: the environment variable's, separated by commas."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """What the server runs with; each field is a flag (``--queue-size``) and a variable
    (``GPTJ_FLAX_QUEUE_SIZE``). Local paths are made absolute."""

    checkpoint: str | None = _setting(None, str, "Orbax run or step directory with its tokenizer (required)")
    adapter: tuple[str, ...] = _setting(
        (),
        str,
        "LoRA adapters (a LoRA run or step directory, or a PEFT directory): NAME=DIR serves DIR beside the "
        "base as model NAME, chosen per request by its model field (repeat the flag for more; the variable "
        "takes a comma-separated list); a bare DIR, alone, is merged into the base instead, as before",
    )
    max_adapters: int | None = _setting(
        None,
        int,
        "adapters the server can hold at once, loaded at start (--adapter NAME=DIR) or by POST /v1/adapters; "
        "they sit on the device in one stack of this size, so adding one compiles nothing "
        "(default: the number of named --adapter flags; 0 with none)",
    )
    max_adapter_rank: int | None = _setting(
        None,
        int,
        f"the highest LoRA rank an adapter may have (default: the highest of the named --adapter flags', else "
        f"{DEFAULT_ADAPTER_RANK}); smaller ones are padded to it",
    )
    adapter_targets: str | None = _setting(
        None,
        str,
        "comma-separated projections adapters may adapt (q_proj, k_proj, v_proj, out_proj, fc_in, fc_out; default: "
        f"those of the named --adapter flags, else {','.join(DEFAULT_ADAPTER_TARGETS)})",
    )
    host: str = _setting("127.0.0.1", str, "address to listen on")
    port: int = _setting(8080, int, "TCP port to listen on")
    mesh: str | None = _setting(None, str, "data,fsdp,model sizes or a layout name (default: one device)")
    dtype: str | None = _setting(
        None,
        str,
        "parameter and compute dtype: float32/fp32, bfloat16/bf16 or float16/fp16 "
        "(default: as stored, see gptj_flax.load)",
    )
    quantize: str | None = _setting(
        None,
        str,
        "store the block projections as int8 with a scale per output channel, quantised as the model loads "
        "(about half the memory of bf16 weights; default: as stored, int8 for a gptj-convert quantize output)",
        QUANTIZATIONS,
    )
    kv_cache: str | None = _setting(
        None,
        str,
        "store the decode slots' cached keys and values as int8 with a scale per (row, head, slot): about half "
        "a bf16 cache's memory, so twice the slots or context (default: the compute dtype)",
        KV_CACHE_DTYPES,
    )
    api_keys_file: str | None = _setting(
        None,
        str,
        "file of valid API keys: the first whitespace-separated token of each line, 16 to 1024 "
        "characters; blank lines and lines starting with # are skipped; re-read when it changes. Every route "
        "but /health and /metrics then needs a key (default: no authentication)",
    )
    queue_size: int = _setting(1024, int, "prompts that may wait for the model; beyond it requests get 429")
    max_batch: int = _setting(
        16, int, "decode slots: the most prompts generated together (continuous batching), and per request"
    )
    max_len: int | None = _setting(
        None,
        int,
        "the longest prompt + completion of one prompt: each decode slot's cache holds this many tokens "
        "(default: the model's context)",
    )
    prefill_chunk: int = _setting(
        128,
        int,
        "prompts longer than this are prefilled in chunks of this many tokens, one chunk between two "
        "decode steps, so a long prompt never holds the others up for longer (a power of two >= 16)",
    )
    prefill: str = _setting(
        "between",
        str,
        "where new prompts are prefilled: between = on the mesh's own devices, between two decode steps; "
        "beside = on as many spare devices outside the mesh (with a copy of the parameters), while the "
        "decode step runs, so a first token does not wait for the step",
        PREFILL_PLACES,
    )
    decode_steps: int = _setting(
        DEFAULT_DECODE_STEPS,
        int,
        "the most decode steps one device call runs while no prompt waits to be admitted (1 to "
        f"{MAX_DECODE_STEPS}): fewer host round trips between steps; a prompt that arrives waits for at most "
        "the call in flight, and stop strings, max_tokens and cancelled requests end their rows as with 1",
    )
    pre_prompt_length: int = _setting(512, int, "tokens of /complete's pre_prompt that are kept (its first ones)")
    chat_template: str | None = _setting(
        None,
        str,
        "Jinja chat template file that /v1/chat/completions renders messages with, as transformers' "
        "apply_chat_template does (default: the tokenizer's own template; without either, that route answers 400)",
    )
    model_name: str | None = _setting(
        None, str, "model id in /v1/models and responses (default: the checkpoint directory's name)"
    )
    log_file: str | None = _setting(None, str, "append every answered completion here (default: no request log)")
    log_format: str = _setting(
        "jsonl", str, "request log format: one JSON object per line, or the GPT-4chan transcript", LOG_FORMATS
    )
    log_max_bytes: int = _setting(100 * 2**20, int, "rotate the request log at this size (0: never)")
    log_backups: int = _setting(5, int, "rotated request logs kept")
    log_level: str = _setting("info", str, "server log level (info includes uvicorn's access log)", LOG_LEVELS)
    cors: bool = _setting(
        False,
        boolean,
        "let web pages from any origin call the server (CORS, as mesh-transformer-jax's device_serve.py "
        "and docker API did): answer preflights, allow any origin, method and header",
    )
    no_ui: bool = _setting(False, boolean, "do not serve the playground page at / (it is then a 404)")
    no_prefix_cache: bool = _setting(
        False,
        boolean,
        "do not keep the full pages of prompts in the KV cache for later prompts that start with the same "
        "tokens (the prefix cache; it serves prompts prefilled between decode steps, not --prefill beside), "
        "nor those of prompts scored with echo and logprobs for later ones",
    )
    predictions_kept: int = _setting(
        1024, int, "finished /model/predict results kept for /model/get_prediction; beyond it the oldest go"
    )
    predictions_grace: float = _setting(
        10.0,
        float,
        "after SIGTERM, /model/get_prediction stays open until every /model/predict job has finished, and "
        "then for up to this many seconds after each finishes, while its result has not been collected",
    )

    def __post_init__(self):
        def check(ok: bool, name: str, accepted: str):
            if not ok:
                raise SettingsError(
                    f"{flag(name)} (or {env_name(name)}) must be {accepted}, got {getattr(self, name)!r}"
                )

        for name in PATH_SETTINGS:  # the frozen dataclass's own way to normalise a field
            object.__setattr__(self, name, absolute_path(getattr(self, name)))

        check(bool(self.checkpoint), "checkpoint", "the checkpoint directory to serve")
        object.__setattr__(self, "adapter", self._adapters())
        check(0 <= self.port <= 65535, "port", "in 0..65535")
        check(self.queue_size >= 1, "queue_size", ">= 1")
        check(self.max_batch >= 1, "max_batch", ">= 1")
        check(
            self.queue_size >= self.max_batch,
            "queue_size",
            f">= --max-batch ({self.max_batch}), or a request with that many prompts could never be queued",
        )
        check(self.max_len is None or self.max_len >= 2, "max_len", ">= 2 (a prompt token and a generated one)")
        check(
            self.prefill_chunk >= 16 and self.prefill_chunk & (self.prefill_chunk - 1) == 0,
            "prefill_chunk",
            "a power of two >= 16",
        )
        check(1 <= self.decode_steps <= MAX_DECODE_STEPS, "decode_steps", f"in 1..{MAX_DECODE_STEPS}")
        check(self.pre_prompt_length >= 0, "pre_prompt_length", ">= 0")
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", dtype_name(self.dtype))
            except ConfigError:
                check(False, "dtype", "float32 (fp32), bfloat16 (bf16) or float16 (fp16)")
        check(self.quantize is None or self.quantize in QUANTIZATIONS, "quantize", f"one of {list(QUANTIZATIONS)}")
        check(self.kv_cache is None or self.kv_cache in KV_CACHE_DTYPES, "kv_cache", f"one of {list(KV_CACHE_DTYPES)}")
        check(self.log_format in LOG_FORMATS, "log_format", f"one of {list(LOG_FORMATS)}")
        check(self.prefill in PREFILL_PLACES, "prefill", f"one of {list(PREFILL_PLACES)}")
        check(self.log_max_bytes >= 0, "log_max_bytes", ">= 0")
        check(self.log_backups >= 0, "log_backups", ">= 0")
        check(self.log_level in LOG_LEVELS, "log_level", f"one of {list(LOG_LEVELS)}")
        check(self.predictions_kept >= 1, "predictions_kept", ">= 1")
        check(self.max_adapters is None or self.max_adapters >= 0, "max_adapters", ">= 0")
        check(
            self.max_adapters is None or self.max_adapters >= len(self.served_adapters),
            "max_adapters",
            f">= the {len(self.served_adapters)} adapters named by --adapter",
        )
        check(self.max_adapter_rank is None or self.max_adapter_rank >= 1, "max_adapter_rank", ">= 1")
        check(
            self.prefill == "between" or self.adapter_slots == 0,
            "prefill",
            "between when adapters are served (--adapter NAME=DIR, --max-adapters): they live on the decode devices",
        )
        check(0 <= self.predictions_grace <= 3600, "predictions_grace", "seconds in 0..3600")

    def _adapters(self) -> tuple[str, ...]:
        """``--adapter`` values with their paths made absolute, checked: one bare DIR alone (merged), or
        NAME=DIR values with distinct names."""
        values = (self.adapter,) if isinstance(self.adapter, str) else tuple(self.adapter or ())
        split = [split_adapter(v) for v in values]
        bare = [path for name, path in split if name is None]
        if bare and len(values) > 1:
            raise SettingsError(
                f"--adapter {bare[0]} (a bare directory) merges it into the base, which serves no other adapter: "
                f"name it (--adapter NAME={bare[0]}) to serve it beside the others"
            )
        names = [name for name, _ in split if name is not None]
        for name in names:
            if names.count(name) > 1 or name == self.served_model_name:
                taken = "the base model's" if name == self.served_model_name else "another --adapter's"
                raise SettingsError(f"--adapter {name}=…: the name {name!r} is {taken}; give each adapter its own")
        absolute = [(name, absolute_path(path) or path) for name, path in split]
        return tuple(path if name is None else f"{name}={path}" for name, path in absolute)

    @property
    def merged_adapter(self) -> str | None:
        """The one bare ``--adapter DIR``, merged into the base at load (None if there is none)."""
        split = [split_adapter(v) for v in self.adapter]
        return split[0][1] if len(split) == 1 and split[0][0] is None else None

    @property
    def served_adapters(self) -> dict[str, str]:
        """``--adapter NAME=DIR`` values: name → directory, served beside the base."""
        return {name: path for name, path in map(split_adapter, self.adapter) if name is not None}

    @property
    def adapter_slots(self) -> int:
        """Adapters the server holds at most (0: it serves the base alone)."""
        return len(self.served_adapters) if self.max_adapters is None else self.max_adapters

    @property
    def served_model_name(self) -> str:
        return self.model_name or os.path.basename(os.path.normpath(self.checkpoint))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def absolute_path(path: str | None) -> str | None:
    """``path`` made absolute (``~`` expanded), also after an ``hf:`` prefix; URLs (``gs://…``) as given."""
    if not path or "://" in path:
        return path
    if path.startswith(HF_PREFIX):
        return HF_PREFIX + os.path.abspath(os.path.expanduser(path[len(HF_PREFIX) :]))
    return os.path.abspath(os.path.expanduser(path))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; each help text names its environment variable and default."""
    for field in dataclasses.fields(ServeSettings):
        meta = field.metadata
        default = "" if field.default in (None, ()) else f"; default {field.default}"
        legacy = f" (or {field.name.upper()}, deprecated)" if field.name in LEGACY_ENV else ""
        # A yes/no flag alone means yes (--cors); it also takes a value (--cors off), as its variable does.
        switch: dict[str, Any] = {"nargs": "?", "const": True} if meta["parse"] is boolean else {}
        if field.name == "adapter":
            switch = {"action": "append"}  # repeatable; its variable is parsed by adapter_list
        parser.add_argument(
            flag(field.name),
            dest=field.name,
            type=meta["parse"],
            choices=meta["choices"],
            default=None,
            help=f"{meta['help']} [env {env_name(field.name)}{legacy}{default}]",
            **switch,
        )


def _from_environment(name: str, env: Mapping[str, tuple[str, str]]) -> tuple[str, str] | None:
    """The variable that sets ``name`` and its value: the prefixed one, else a GPT-4chan name."""
    for candidate in (env_name(name), name.upper()) if name in LEGACY_ENV else (env_name(name),):
        variable, value = env.get(candidate, (candidate, ""))
        if value:  # an empty variable leaves the default (GPTJ_FLAX_LOG_FILE= keeps logging off)
            if candidate != env_name(name):
                logger.warning("environment variable %s is deprecated: set %s instead", variable, env_name(name))
            return variable, value
    return None


def settings_from(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> ServeSettings:
    """Settings from parsed flags (``add_arguments``), then the environment, then the defaults."""
    environ = os.environ if environ is None else environ
    env = {k.upper(): (k, v) for k, v in environ.items()}
    values = {}
    for field in dataclasses.fields(ServeSettings):
        given = None if args is None else getattr(args, field.name, None)
        if given is not None:
            values[field.name] = given
        elif (found := _from_environment(field.name, env)) is not None:
            variable, value = found
            parse = adapter_list if field.name == "adapter" else field.metadata["parse"]
            try:
                values[field.name] = parse(value)
            except ValueError:
                raise SettingsError(
                    f"environment variable {variable}={value!r} is not a valid {field.metadata['parse'].__name__}"
                ) from None
    return ServeSettings(**values)
