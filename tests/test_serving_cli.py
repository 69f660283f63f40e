"""``scripts/serve.py``: settings from flags and the environment; a real server process that drains
and exits 0 on SIGTERM, logging no key in clear."""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from gptj_flax.serving import ServeSettings, SettingsError, add_arguments, settings_from
from gptj_flax.serving.auth import key_id
from tests.test_serving_support import KEYS, checkpoint_dir, wait_until, write_keys


def parse(argv, environ):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from(parser.parse_args(argv), environ)


def test_flags_win_over_the_environment_which_wins_over_defaults():
    environ = {"CHECKPOINT": "/runs/a", "QUEUE_SIZE": "64", "api_keys_file": "keys.txt", "Port": "9000",
               "LOG_FILE": "", "PATH": "/usr/bin"}
    settings = parse(["--port", "8081", "--max-batch", "8"], environ)
    assert settings == ServeSettings(checkpoint="/runs/a", queue_size=64, api_keys_file="keys.txt", port=8081,
                                     max_batch=8)
    assert settings.log_file is None and settings.pre_prompt_length == 512 and settings.host == "127.0.0.1"
    assert settings.served_model_name == "a"
    assert parse(["--checkpoint", "/runs/b/"], {}).served_model_name == "b"


@pytest.mark.parametrize("argv,environ,message", [
    ([], {}, "--checkpoint (or CHECKPOINT)"),
    (["--checkpoint", "c", "--max-batch", "0"], {}, "--max-batch (or MAX_BATCH) must be >= 1"),
    (["--checkpoint", "c", "--queue-size", "8"], {"MAX_BATCH": "16"}, "--queue-size (or QUEUE_SIZE) must be >= "
                                                                      "--max-batch (16)"),
    (["--checkpoint", "c"], {"QUEUE_SIZE": "many"}, "QUEUE_SIZE='many' is not a valid int"),
    (["--checkpoint", "c"], {"LOG_FORMAT": "xml"}, "--log-format (or LOG_FORMAT) must be one of"),
    (["--checkpoint", "c"], {"PORT": "70000"}, "--port (or PORT) must be in 0..65535"),
])
def test_bad_settings_are_named(argv, environ, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        parse(argv, environ)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(process: subprocess.Popen, url: str) -> None:
    def ready():
        assert process.poll() is None, process.stdout.read()
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, 300, "the server to warm up", interval_s=0.2)


@pytest.mark.slow
def test_serve_script_serves_then_drains_and_exits_on_sigterm(tmp_path, repo_root):
    write_keys(tmp_path / "keys.txt")
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "CHECKPOINT": checkpoint_dir(),
           "API_KEYS_FILE": str(tmp_path / "keys.txt"), "LOG_FILE": str(tmp_path / "transcript.txt"),
           "LOG_FORMAT": "transcript", "MAX_BATCH": "1"}
    process = subprocess.Popen(
        [sys.executable, str(repo_root / "scripts" / "serve.py"), "--port", str(port), "--warmup-tokens", "8"],
        env=env, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url)
        answered = httpx.post(url + "/complete", json={"prompt": "def add(", "length": 4, "api_key": KEYS[0]})
        assert answered.status_code == 200 and isinstance(answered.json()["response"], str)
        refused = httpx.post(url + "/complete", json={"prompt": "x", "length": 4, "api_key": "sk-not-a-key"})
        assert refused.status_code == 401
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert "draining" in output and '"POST /complete HTTP/1.1" 401' in output
    transcript = (tmp_path / "transcript.txt").read_text()
    assert transcript.startswith(f"##### {key_id(KEYS[0])} ##### ")
    for key in (*KEYS, "sk-not-a-key"):
        assert key not in output and key not in transcript


@pytest.mark.slow
def test_serve_script_serves_a_huggingface_directory(tmp_path, repo_root):
    """``--checkpoint hf:DIR``: the GPT-4chan server's HF backend, without a second backend."""
    import gptj_flax
    from gptj_flax import convert

    hf_dir = convert.to_hf(checkpoint_dir(), tmp_path / "hf")
    expected = gptj_flax.load(checkpoint_dir()).generate("def add(", 4, temperature=0).text
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(
        [sys.executable, str(repo_root / "scripts" / "serve.py"), "--checkpoint", f"hf:{hf_dir}", "--port", str(port),
         "--warmup-tokens", "8"], env=env, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url)
        answered = httpx.post(url + "/complete", json={"prompt": "def add(", "length": 4, "temperature": 0})
        assert answered.status_code == 200, answered.text
        assert answered.json() == {"response": expected}
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
