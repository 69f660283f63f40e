"""``scripts/serve.py``: settings from flags and ``GPTJ_FLAX_`` variables (and the GPT-4chan names);
one ``error:`` line for a bad setting, file or port, before the model loads; a real server process
that drains and exits 0 on SIGTERM, logging no key in clear."""

import argparse
import logging
import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import pytest

import gptj_flax
from gptj_flax import convert
from gptj_flax.serving import ServeSettings, SettingsError, add_arguments, settings_from
from gptj_flax.serving.auth import key_id
from gptj_flax.serving.settings import DEFAULT_DECODE_STEPS
from tests import commands
from tests.test_serving_support import (
    KEYS,
    checkpoint_dir,
    no_key_leaks,  # noqa: F401 - the autouse leak scan
    scanned,
    secret,
    wait_until,
    write_keys,
)


def parse(argv, environ):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from(parser.parse_args(argv), environ)


def test_flags_win_over_the_environment_which_wins_over_defaults():
    environ = {
        "GPTJ_FLAX_CHECKPOINT": "/runs/a",
        "gptj_flax_port": "9000",
        "GPTJ_FLAX_MAX_BATCH": "8",
        "GPTJ_FLAX_LOG_FILE": "",
        "PATH": "/usr/bin",
    }
    settings = parse(["--port", "8081"], environ)
    assert settings == ServeSettings(checkpoint="/runs/a", port=8081, max_batch=8)
    assert settings.log_file is None and settings.pre_prompt_length == 512 and settings.host == "127.0.0.1"
    assert settings.served_model_name == "a"
    assert parse([], environ).port == 9000
    assert parse(["--checkpoint", "/runs/b/"], {}).served_model_name == "b"


def test_the_decode_steps_setting_is_a_flag_and_a_variable():
    assert parse(["--checkpoint", "c"], {}).decode_steps == DEFAULT_DECODE_STEPS
    assert parse(["--checkpoint", "c", "--decode-steps", "8"], {"GPTJ_FLAX_DECODE_STEPS": "2"}).decode_steps == 8
    assert parse(["--checkpoint", "c"], {"GPTJ_FLAX_DECODE_STEPS": "2"}).decode_steps == 2


def test_the_kv_cache_setting_is_a_flag_and_a_variable():
    assert parse(["--checkpoint", "c"], {}).kv_cache is None
    assert parse(["--checkpoint", "c", "--kv-cache", "int8"], {}).kv_cache == "int8"
    assert parse(["--checkpoint", "c"], {"GPTJ_FLAX_KV_CACHE": "int8"}).kv_cache == "int8"


def test_the_prefill_setting_is_between_unless_told_and_refuses_other_places():
    assert parse(["--checkpoint", "c"], {}).prefill == "between"
    assert parse(["--checkpoint", "c", "--prefill", "beside"], {}).prefill == "beside"
    assert parse(["--checkpoint", "c"], {"GPTJ_FLAX_PREFILL": "beside"}).prefill == "beside"
    with pytest.raises(SettingsError, match=re.escape("--prefill (or GPTJ_FLAX_PREFILL) must be one of")):
        parse(["--checkpoint", "c"], {"GPTJ_FLAX_PREFILL": "sideways"})


def test_the_dtype_takes_either_spelling_and_keeps_the_canonical_name():
    assert parse(["--checkpoint", "/runs/a", "--dtype", "bf16"], {}).dtype == "bfloat16"
    assert parse(["--checkpoint", "/runs/a"], {"GPTJ_FLAX_DTYPE": "fp32"}).dtype == "float32"
    with pytest.raises(
        SettingsError,
        match=re.escape(
            "--dtype (or GPTJ_FLAX_DTYPE) must be float32 (fp32), bfloat16 (bf16) or float16 (fp16), got 'fp64'"
        ),
    ):
        parse(["--checkpoint", "/runs/a", "--dtype", "fp64"], {})


def test_generic_variables_do_not_reconfigure_the_server():
    generic = {
        "HOST": "0.0.0.0",
        "PORT": "9000",
        "MESH": "1,1,8",
        "DTYPE": "float16",
        "CHECKPOINT": "/runs/other",
        "LOG_LEVEL": "debug",
        "MAX_BATCH": "2",
        "LOG_FORMAT": "transcript",
    }
    settings = parse(["--checkpoint", "/runs/a"], generic)
    assert settings == ServeSettings(checkpoint="/runs/a")
    assert settings.host == "127.0.0.1" and settings.port == 8080
    with pytest.raises(SettingsError, match=re.escape("--checkpoint (or GPTJ_FLAX_CHECKPOINT)")):
        parse([], generic)


def test_the_gpt4chan_variables_still_work_with_a_deprecation_notice(caplog):
    caplog.set_level(logging.WARNING, "gptj_flax.serving.settings")
    environ = {
        "QUEUE_SIZE": "64",
        "api_keys_file": "/srv/keys.txt",
        "Log_File": "/srv/requests.log",
        "PRE_PROMPT_LENGTH": "100",
        "GPTJ_FLAX_CHECKPOINT": "/runs/a",
    }
    settings = parse([], environ)
    assert (settings.queue_size, settings.api_keys_file, settings.log_file, settings.pre_prompt_length) == (
        64,
        "/srv/keys.txt",
        "/srv/requests.log",
        100,
    )
    notices = [r.getMessage() for r in caplog.records]
    assert notices == [
        f"environment variable {name} is deprecated: set GPTJ_FLAX_{name.upper()} instead"
        for name in ("api_keys_file", "QUEUE_SIZE", "PRE_PROMPT_LENGTH", "Log_File")
    ]
    caplog.clear()
    assert parse([], {**environ, "GPTJ_FLAX_QUEUE_SIZE": "32"}).queue_size == 32  # the prefixed name wins
    assert "QUEUE_SIZE" not in caplog.text


def test_help_names_the_prefixed_variables():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for name in ("PORT", "HOST", "CHECKPOINT", "MESH", "DTYPE", "LOG_LEVEL", "MAX_BATCH"):
        assert f"[env GPTJ_FLAX_{name};" in text or f"[env GPTJ_FLAX_{name}]" in text, name
    assert "[env GPTJ_FLAX_QUEUE_SIZE (or QUEUE_SIZE, deprecated); default 1024]" in text
    assert "[env PORT" not in text and "[env HOST" not in text


def test_relative_paths_are_made_absolute_as_settings_are_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = parse(
        ["--checkpoint", "runs/demo", "--api-keys-file", "keys.txt"], {"GPTJ_FLAX_LOG_FILE": "logs/requests.jsonl"}
    )
    assert settings.checkpoint == str(tmp_path / "runs" / "demo")
    assert settings.api_keys_file == str(tmp_path / "keys.txt")
    assert settings.log_file == str(tmp_path / "logs" / "requests.jsonl")
    assert parse(["--checkpoint", "hf:models/gptj"], {}).checkpoint == f"hf:{tmp_path / 'models' / 'gptj'}"
    assert parse(["--checkpoint", "gs://bucket/run"], {}).checkpoint == "gs://bucket/run"


@pytest.mark.parametrize(
    "argv,environ,message",
    [
        ([], {}, "--checkpoint (or GPTJ_FLAX_CHECKPOINT)"),
        (["--checkpoint", "c", "--max-batch", "0"], {}, "--max-batch (or GPTJ_FLAX_MAX_BATCH) must be >= 1"),
        (
            ["--checkpoint", "c", "--queue-size", "8"],
            {"GPTJ_FLAX_MAX_BATCH": "16"},
            "--queue-size (or GPTJ_FLAX_QUEUE_SIZE) must be >= --max-batch (16)",
        ),
        (["--checkpoint", "c"], {"GPTJ_FLAX_QUEUE_SIZE": "many"}, "GPTJ_FLAX_QUEUE_SIZE='many' is not a valid int"),
        (["--checkpoint", "c"], {"queue_size": "many"}, "queue_size='many' is not a valid int"),
        (
            ["--checkpoint", "c"],
            {"GPTJ_FLAX_LOG_FORMAT": "xml"},
            "--log-format (or GPTJ_FLAX_LOG_FORMAT) must be one of",
        ),
        (["--checkpoint", "c"], {"GPTJ_FLAX_PORT": "70000"}, "--port (or GPTJ_FLAX_PORT) must be in 0..65535"),
        (
            ["--checkpoint", "c"],
            {"GPTJ_FLAX_KV_CACHE": "int4"},
            "--kv-cache (or GPTJ_FLAX_KV_CACHE) must be one of ['int8'], got 'int4'",
        ),
        (
            ["--checkpoint", "c", "--prefill-chunk", "100"],
            {},
            "--prefill-chunk (or GPTJ_FLAX_PREFILL_CHUNK) must be a power of two >= 16, got 100",
        ),
        (
            ["--checkpoint", "c", "--decode-steps", "0"],
            {},
            "--decode-steps (or GPTJ_FLAX_DECODE_STEPS) must be in 1..64, got 0",
        ),
        (
            ["--checkpoint", "c"],
            {"GPTJ_FLAX_DECODE_STEPS": "65"},
            "--decode-steps (or GPTJ_FLAX_DECODE_STEPS) must be in 1..64, got 65",
        ),
    ],
)
def test_bad_settings_are_named(argv, environ, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        parse(argv, environ)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_env(repo_root, **variables) -> dict:
    """The environment of a server process: this one's without GPTJ_FLAX_ settings, plus ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GPTJ_FLAX_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root), env.get("PYTHONPATH")) if p)
    return {**env, "JAX_PLATFORMS": "cpu", **variables}


def run_serve(run_command, cwd, *args, **variables) -> tuple[int, str]:
    """Run scripts/serve.py in this process to its end, with this environment's GPTJ_FLAX_ settings
    replaced by ``variables``; its exit status and its output (stdout and stderr)."""
    unset = {key: None for key in os.environ if key.upper().startswith("GPTJ_FLAX_")}
    ran = run_command(commands.script("serve.py"), *args, cwd=cwd, env={**unset, **variables})
    return ran.status, scanned(ran.out + ran.err)


def assert_one_error_line(status: int, output: str, expected: str) -> None:
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert status == 1 and errors == [expected], output
    assert "Traceback" not in output
    assert "gptj_flax.serving.server: loaded" not in output  # found before the model loads


def write_short_key_file(path) -> str:
    short = secret("tenchars10")
    path.write_text(f"# keys\n{KEYS[0]}  client-0\n{short}  client-1\n")
    return short


CHAT_TEMPLATE_CASES = ["missing chat template", "unreadable chat template", "chat template not Jinja"]


@pytest.mark.parametrize(
    "case", ["missing checkpoint", "missing keys file", "short key", "bad setting", *CHAT_TEMPLATE_CASES]
)
def test_a_bad_setting_or_file_is_one_error_line_before_the_model_loads(case, tmp_path, run_command):
    args, variables = ["--checkpoint", checkpoint_dir(), "--port", str(free_port())], {}
    if case in CHAT_TEMPLATE_CASES:
        args, expected = chat_template_case(case, tmp_path, args, variables)
    if case == "missing checkpoint":
        args[1] = "runs/missing"  # relative: the message names the absolute path
        expected = f"error: checkpoint not found: {tmp_path}/runs/missing (set --checkpoint or GPTJ_FLAX_CHECKPOINT)"
    elif case == "missing keys file":
        variables["GPTJ_FLAX_API_KEYS_FILE"] = "keys.txt"
        expected = f"error: API keys file not found: {tmp_path}/keys.txt"
    elif case == "short key":
        short = write_short_key_file(tmp_path / "keys.txt")
        args += ["--api-keys-file", "keys.txt"]
        expected = (
            f"error: API keys file {tmp_path}/keys.txt line 3: the key is shorter than 16 characters; use "
            "a longer random key, or start the line with # to comment it out"
        )
    elif case == "bad setting":
        variables["GPTJ_FLAX_MAX_BATCH"] = "0"
        expected = "error: --max-batch (or GPTJ_FLAX_MAX_BATCH) must be >= 1, got 0"
    status, output = run_serve(run_command, tmp_path, *args, **variables)
    assert_one_error_line(status, output, expected)
    if case == "short key":
        assert short not in output


def chat_template_case(case: str, tmp_path, args: list[str], variables: dict) -> tuple[list[str], str]:
    """The arguments (and variables) of a bad --chat-template, and the error line expected."""
    if case == "missing chat template":  # relative: the message names the absolute path
        return [*args, "--chat-template", "chat.jinja"], (
            f"error: --chat-template file not found: {tmp_path}/chat.jinja "
            "(set --chat-template or GPTJ_FLAX_CHAT_TEMPLATE)"
        )
    if case == "unreadable chat template":  # a directory, given as the variable
        (tmp_path / "templates").mkdir()
        variables["GPTJ_FLAX_CHAT_TEMPLATE"] = "templates"
        return args, f"error: --chat-template {tmp_path}/templates cannot be read: Is a directory"
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}\n{{ m.role }")
    return [*args, "--chat-template", "chat.jinja"], (
        f"error: --chat-template {tmp_path}/chat.jinja is not a valid Jinja template: line 2: unexpected '}}'"
    )


def test_the_chat_template_setting_is_a_flag_and_a_variable_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse(["--checkpoint", "c"], {}).chat_template is None
    assert parse(["--checkpoint", "c", "--chat-template", "chat.jinja"], {}).chat_template == str(
        tmp_path / "chat.jinja"
    )
    flag_wins = parse(["--checkpoint", "c", "--chat-template", "/t/a.jinja"], {"GPTJ_FLAX_CHAT_TEMPLATE": "b.jinja"})
    assert flag_wins.chat_template == "/t/a.jinja"
    assert parse(["--checkpoint", "c"], {"GPTJ_FLAX_CHAT_TEMPLATE": "b.jinja"}).chat_template == str(
        tmp_path / "b.jinja"
    )


def test_a_port_in_use_is_one_error_line_before_the_model_loads(tmp_path, run_command):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, output = run_serve(run_command, tmp_path, "--checkpoint", checkpoint_dir(), GPTJ_FLAX_PORT=str(port))
    assert_one_error_line(
        status,
        output,
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use; "
        "another process is listening there: stop it or choose another --port "
        "(GPTJ_FLAX_PORT)",
    )


def listening_addresses(port: int) -> set[str]:
    """The local IPv4 addresses listening on ``port``, as the kernel lists them (hex, as in /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {row[1].split(":")[0] for row in rows if row[3] == "0A" and int(row[1].split(":")[1], 16) == port}


def wait_until_healthy(process: subprocess.Popen, url: str) -> None:
    def ready():
        assert process.poll() is None, process.stdout.read()
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, 300, "the server to warm up", interval_s=0.2)


@pytest.mark.slow  # a real server process, its port and SIGTERM are the point
def test_serve_script_serves_then_drains_and_exits_on_sigterm(tmp_path, repo_root):
    write_keys(tmp_path / "keys.txt")
    port, generic_port = free_port(), free_port()
    # relative paths (the process runs in tmp_path); generic HOST and PORT, which must change nothing
    env = serve_env(
        repo_root,
        GPTJ_FLAX_CHECKPOINT=checkpoint_dir(),
        GPTJ_FLAX_API_KEYS_FILE="keys.txt",
        GPTJ_FLAX_LOG_FILE="logs/transcript.txt",
        GPTJ_FLAX_LOG_FORMAT="transcript",
        GPTJ_FLAX_MAX_BATCH="1",
        GPTJ_FLAX_PORT=str(port),
        QUEUE_SIZE="8",
        HOST="0.0.0.0",
        PORT=str(generic_port),
    )
    process = subprocess.Popen(
        [sys.executable, str(repo_root / "scripts" / "serve.py"), "--max-len", "32"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url)
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only, not 0.0.0.0
        assert not listening_addresses(generic_port)
        answered = httpx.post(url + "/complete", json={"prompt": "def add(", "length": 4, "api_key": KEYS[0]})
        assert answered.status_code == 200 and isinstance(answered.json()["response"], str)
        refused = httpx.post(url + "/complete", json={"prompt": "x", "length": 4, "api_key": secret("sk-not-a-key")})
        assert refused.status_code == 401
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    scanned(output)
    assert process.returncode == 0, output
    assert "draining" in output and '"POST /complete HTTP/1.1" 401' in output
    assert f"listening on http://127.0.0.1:{port};" in output
    assert "environment variable QUEUE_SIZE is deprecated: set GPTJ_FLAX_QUEUE_SIZE instead" in output
    assert f"loaded 2 API key(s) from {tmp_path}/keys.txt" in output
    transcript = scanned((tmp_path / "logs" / "transcript.txt").read_text(), "the request log")
    assert transcript.startswith(f"##### {key_id(KEYS[0])} ##### ")
    for key in (*KEYS, "sk-not-a-key"):
        assert key not in output and key not in transcript


@pytest.mark.slow  # a real server process converting a HuggingFace directory as it starts
def test_serve_script_serves_a_huggingface_directory(tmp_path, repo_root):
    """``--checkpoint hf:DIR``: the GPT-4chan server's HF backend, without a second backend."""
    hf_dir = convert.to_hf(checkpoint_dir(), tmp_path / "hf")
    expected = gptj_flax.load(checkpoint_dir()).generate("def add(", 4, temperature=0).text
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            str(repo_root / "scripts" / "serve.py"),
            "--checkpoint",
            f"hf:{hf_dir}",
            "--port",
            str(port),
            "--max-len",
            "32",
            "--max-batch",  # the backend is under test, not the batch: fewer programs to compile
            "2",
        ],
        env=serve_env(repo_root),
        cwd=repo_root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url)
        answered = httpx.post(url + "/complete", json={"prompt": "def add(", "length": 4, "temperature": 0})
        assert answered.status_code == 200, answered.text
        assert answered.json() == {"response": expected}
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            scanned(process.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
