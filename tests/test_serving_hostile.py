"""Hostile use of the server, second pass (issue 33), against real servers on 127.0.0.1.

- Keys first: a request without a valid key is a 401 before its body is read or validated, on every
  route but /health and /metrics; a key is a key however it is sent (Bearer or body, up to 1024
  characters, any Unicode). A 4xx stays small and a flood of unauthenticated requests with
  megabyte bodies neither slows an authenticated one down nor grows the server's memory.
- The transcript request log writes a block per choice, for every body lm-eval and others send; a
  request log that cannot be written is said once, and never prints a record.
- A drain keeps /model/get_prediction open for the results it finishes; a SIGTERM during the
  warm-up stops compiling and exits 0.
- With ``echo`` and ``logprobs``, ``text_offset`` indexes ``text``.
"""

import collections
import errno
import http.client
import json
import logging
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
import requests
from lm_eval import simple_evaluate
from transformers.convert_slow_tokenizer import bytes_to_unicode

from gptj_flax.evaluation.harness import task_manager
from gptj_flax.sampling import SamplingError, memory_maps
from gptj_flax.serving.auth import BODY_KEY_BYTES, MAX_KEY_CHARS, NO_KEY_UNREAD, key_id
from gptj_flax.serving.offsets import TextOffsets
from gptj_flax.serving.request_log import RequestLog
from tests.evaluation_helpers import write_tasks
from tests.test_serving_support import (
    KEYS,
    HeldModel,
    RunningServer,
    checkpoint_dir,
    no_key_leaks,  # noqa: F401 - the autouse leak scan
    scanned,
    secret,
    tiny_model,
    wait_until,
    write_keys,
)

MAX_BATCH = 4
MAX_4XX_BYTES = 64 * 2**10
LONG_KEY = secret("sk-long-" + "0123456789abcdef" * 12)  # 200 characters, over the old limit of 128
CYRILLIC_KEY = secret("ключ-доступа-0123456789")  # not Latin-1: HTTP clients send it as UTF-8
LATIN_KEY = secret("clé-d'accès-0123456789")  # Latin-1: some clients send it so, others as UTF-8
ALL_KEYS = (*KEYS, LONG_KEY, CYRILLIC_KEY, LATIN_KEY)
BEARER = {"Authorization": f"Bearer {KEYS[0]}"}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def lm():
    return tiny_model()


@pytest.fixture(scope="module")
def vocab(lm) -> int:
    return lm.decoder.valid_vocab  # the tokenizer's ids; the embedding has more rows


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hostile")
    write_keys(directory / "keys.txt", ALL_KEYS)
    log_file = directory / "transcript.txt"
    with RunningServer(
        lm,
        api_keys_file=str(directory / "keys.txt"),
        max_batch=MAX_BATCH,
        log_file=str(log_file),
        log_format="transcript",
    ) as running:
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def bearer(key: str, encoding: str = "utf-8") -> dict:
    """The Authorization header as a client sends a key: its bytes in ``encoding``."""
    return {"Authorization": b"Bearer " + key.encode(encoding)}


# -- 1. keys before bodies, one key rule, small 4xx, the flood -----------------------------------------
ANSWERED_WITH_A_KEY = [  # (method, path, body) answered 200 with a valid key
    ("POST", "/complete", {"prompt": "def", "length": 2}),
    ("POST", "/complete", {"context": "def", "top_p": 0.9, "temp": 0.5}),  # device_serve.py's body
    ("POST", "/v1/completions", {"prompt": "def", "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "def"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/model/predict", {"context": "def", "length": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/tokenizer_info", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
    ("GET", "/redoc", None),
]


def test_every_route_but_health_and_metrics_refuses_a_request_without_a_key_before_reading_its_body(
    client, server, vocab
):
    qid = client.post("/model/predict", json={"context": "x", "length": 2}, headers=BEARER).json()["qid"]
    routes = [*ANSWERED_WITH_A_KEY, ("POST", "/model/get_prediction", {"qid": qid})]
    hostile = [  # bodies that would be a 400 or a 422 (with a key): without one, they are not even read
        json.dumps({"prompt": [[vocab] * 16384], "max_tokens": 1}).encode(),
        b'{"prompt": "x", ',
        b"[1, 2, 3]",
        json.dumps({"prompt": "x", "api_key": "\ud800"}).encode(),  # a key no keys file can hold
        json.dumps({"prompt": "x", "api_key": 12345678901234567890}).encode(),
        json.dumps({"prompt": "x", "api_key": "k" * (MAX_KEY_CHARS + 1)}).encode(),
    ]
    wrong = secret("sk-wrong-0123456789")
    for method, path, body in [*routes, ("GET", "/no-such-route", None)]:
        attempts = [({}, None), ({"Authorization": f"Bearer {wrong}"}, None)]
        if method == "POST":
            attempts += [({}, {**body, "api_key": wrong})] + [({}, raw) for raw in hostile]
        for headers, sent in attempts:
            content = sent if isinstance(sent, bytes) else json.dumps(sent if sent is not None else body).encode()
            response = client.request(
                method, path, content=content if method == "POST" else None, headers=headers | JSON
            )
            assert response.status_code == 401, (path, headers, content[:60], response.text[:200])
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json() == {
                "detail": "a valid API key is required (the api_key field or Authorization: Bearer)"
            }
    for method, path, body in routes:
        answered = client.request(method, path, json=body, headers=BEARER)
        assert answered.status_code == 200, (path, answered.text[:200])
    for path in ("/health", "/metrics"):  # for probes and scrapers, which hold no key
        assert client.get(path).status_code == 200
    # A body too large to be one that holds its key is refused unread, its connection closed (a
    # client still sending it may see the connection reset instead).
    large = json.dumps({"prompt": [[vocab] * 16384] * MAX_BATCH, "api_key": KEYS[0]}).encode()
    assert len(large) > BODY_KEY_BYTES
    status, answer = unauthenticated(server.url, "/v1/completions", large)
    assert status == "reset" or (status, json.loads(answer)) == (401, {"detail": NO_KEY_UNREAD}), answer


def test_one_key_rule_on_every_route_however_the_key_is_sent(client):
    for key in ALL_KEYS:
        ways = [("body", None, key), ("Bearer, UTF-8", bearer(key), None)]
        if key == LATIN_KEY:
            ways.append(("Bearer, Latin-1", bearer(key, "latin-1"), None))
        for way, headers, body_key in ways:
            for method, path, body in ANSWERED_WITH_A_KEY:
                if method == "GET" and body_key is not None:
                    continue  # a GET has no body to hold a key
                sent = None if body is None else {**body, **({"api_key": body_key} if body_key else {})}
                response = client.request(method, path, json=sent, headers=headers)
                assert response.status_code == 200, (len(key), way, path, response.text[:200])
    # the same key, whichever way it comes, is the same caller: a qid answers to it
    qid = client.post("/model/predict", json={"context": "x", "length": 2}, headers=bearer(CYRILLIC_KEY)).json()["qid"]
    collected = client.post("/model/get_prediction", json={"qid": qid, "api_key": CYRILLIC_KEY})
    assert collected.status_code == 200
    assert client.post("/model/get_prediction", json={"qid": qid}, headers=BEARER).status_code == 404
    # a key in the body lets a body with a bad field in, which is then named (not called a bad key)
    named = client.post(
        "/v1/completions",
        content=b'{"prompt": "x", "temperature": NaN, "api_key": "%s"}' % (KEYS[1].encode()),
        headers=JSON,
    )
    assert named.status_code == 422 and named.json()["detail"][0]["loc"] == ["body", "temperature"]


def hostile_bodies(vocab: int) -> list[tuple[str, dict]]:
    """Bodies under the size limit whose errors, one per item, made 422s of megabytes."""
    ids = [vocab] * 16384
    return [
        ("/v1/completions", {"prompt": [ids] * MAX_BATCH, "max_tokens": 1}),
        ("/v1/completions", {"prompt": ids, "max_tokens": 1}),
        ("/v1/completions", {"prompt": [[1.5] * 16384] * MAX_BATCH}),
        ("/v1/completions", {"prompt": [["x"] * 16384] * MAX_BATCH}),
        ("/v1/completions", {"prompt": ["x"] * 40000}),
        ("/v1/completions", {"prompt": "x", **{f"field{i}": 0 for i in range(30000)}}),
        ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): "x" for i in range(30000)}}),
        ("/v1/completions", {"prompt": "x", "f" * 60000: 1}),
        ("/detokenize", {"tokens": ids}),
        ("/detokenize", {"tokens": [[1]] * 16384}),
        ("/complete", {"prompt": ["x"] * 40000}),
        ("/tokenize", {"prompt": "x" * 60000}),
        ("/model/predict", {"context": 5, "length": "x"}),
    ]


def test_a_4xx_is_small_names_no_value_and_counts_what_it_leaves_out(client, vocab):
    for path, body in hostile_bodies(vocab):
        started = time.monotonic()
        response = client.post(path, json=body, headers=BEARER)
        seconds = time.monotonic() - started
        print(
            f"{path} {json.dumps(body)[:50]}…: {response.status_code}, {len(response.content)} bytes, {seconds:.2f} s"
        )
        assert 400 <= response.status_code < 500 and len(response.content) <= MAX_4XX_BYTES, (path, response.text[:300])
        errors = response.json()["detail"]
        assert len(errors) <= 21 and all(len(str(part)) <= 64 for e in errors for part in e["loc"])
        for value in ('"x"', "1.5", "f" * 65, f"{vocab}, {vocab}"):
            assert value not in response.text
    out_of_range = client.post("/v1/completions", json=hostile_bodies(vocab)[0][1], headers=BEARER).json()["detail"]
    assert out_of_range == [
        {
            "loc": ["body", "prompt", "token_lists", i],
            "msg": f"token ids must be integers in [0, {vocab}): 16384 of 16384 are not, the first at position 0",
            "type": "token_id",
        }
        for i in range(MAX_BATCH)
    ]
    unknown = client.post("/v1/completions", json=hostile_bodies(vocab)[5][1], headers=BEARER).json()["detail"]
    assert [e["loc"] for e in unknown] == [["body", f"field{i}"] for i in range(20)]


class _SlotsWithoutWarmUp:
    def __init__(self, slots):
        self._slots = slots

    def __getattr__(self, name):
        return getattr(self._slots, name)

    def warm_up(self, **kwargs):
        return True


class NoWarmUp:
    """The model, its decode slots not compiled ahead: the flood test's 16 slots (the default, which
    sets the body limit the flood fills) would compile a warm-up's every program, minutes on a small
    CPU, for one-token completions that use one of them."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def slots(self, **kwargs):
        return _SlotsWithoutWarmUp(self._model.slots(**kwargs))


def unauthenticated(url: str, path: str, body: bytes) -> tuple[int | str, bytes]:
    """One request without a key on a connection of its own: its status and answer, or "reset"
    where the server closed the connection, refusing the body unread, before all was sent."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        connection.request("POST", path, body=body, headers=JSON)
        response = connection.getresponse()
        return response.status, response.read()
    except (BrokenPipeError, ConnectionResetError):
        return "reset", b""
    finally:
        connection.close()


def one_token_latency(http: httpx.Client) -> float:
    started = time.perf_counter()
    response = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    return time.perf_counter() - started


# The attackers, in a process of their own (in the server's, their threads would hold its
# interpreter lock), at the lowest CPU priority (on a machine of their own, their CPU would not be the
# server's): on each line read, four connections, then "sending" on a line as the four requests go
# out at once, then their (status, size) on a line.
FLOOD_CLIENTS = """
import concurrent.futures, http.client, json, os, sys, threading
os.nice(19)
host, port, path, body_file = sys.argv[1:]
body = open(body_file, "rb").read()
ready = threading.Barrier(5)

def send(_):
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        connection.connect()
        ready.wait()
        connection.request("POST", path, body=body, headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, len(response.read())
    except (BrokenPipeError, ConnectionResetError):
        return "reset", 0
    finally:
        connection.close()

with concurrent.futures.ThreadPoolExecutor(4) as pool:
    for _ in sys.stdin:
        sent = pool.map(send, range(4))
        ready.wait()
        print("sending", flush=True)
        print(json.dumps(list(sent)), flush=True)
"""


def test_four_unauthenticated_megabyte_requests_at_once_neither_slow_a_keyed_one_nor_grow_memory(lm, tmp_path):
    """Issue 33's flood: four such requests at once, and a keyed one-token completion sent with them,
    round after round; against the same completion alone."""
    write_keys(tmp_path / "keys.txt")
    max_batch, rounds = 16, 40  # the default max_batch, which sets the default body limit (3.2 MB)
    body = json.dumps({"prompt": [[lm.decoder.valid_vocab] * 16384] * max_batch, "max_tokens": 1}).encode()
    (tmp_path / "body.json").write_bytes(body)
    process = psutil.Process()
    with (
        RunningServer(NoWarmUp(lm), api_keys_file=str(tmp_path / "keys.txt"), max_batch=max_batch) as server,
        httpx.Client(base_url=server.url, timeout=300, headers=BEARER) as http,
        subprocess.Popen(
            [sys.executable, "-c", FLOOD_CLIENTS, *server.url.removeprefix("http://").split(":"), "/v1/completions"]
            + [str(tmp_path / "body.json")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as attackers,
    ):
        for _ in range(5):
            one_token_latency(http)  # compiles what a one-token completion runs
        rss_before = peak = process.memory_info().rss
        alone, flooded, answers = [], [], []
        for _ in range(rounds):  # alternately alone and with the attackers, as the machine's load drifts
            alone.append(one_token_latency(http))
            attackers.stdin.write("go\n")
            attackers.stdin.flush()
            assert attackers.stdout.readline() == "sending\n"
            flooded.append(one_token_latency(http))
            answers += json.loads(attackers.stdout.readline())
            peak = max(peak, process.memory_info().rss)
        attackers.stdin.close()
    growth_mb, quiet, during = (peak - rss_before) / 2**20, statistics.median(alone), statistics.median(flooded)
    statuses = collections.Counter(status for status, _ in answers)
    print(
        f"one-token completion: {quiet * 1e3:.1f} ms alone, {during * 1e3:.1f} ms sent with 4 requests of "
        f"{len(body) / 2**20:.2f} MB without a key ({rounds} rounds; answers {dict(statuses)}, the largest "
        f"{max(size for _, size in answers)} bytes); server RSS grew {growth_mb:.1f} MB (medians; a shared machine)"
    )
    assert set(statuses) <= {401, "reset"} and statuses[401] > 0 and max(size for _, size in answers) < 1024
    assert during <= 2 * quiet and growth_mb < 50


# -- 2. the transcript log --------------------------------------------------------------------------
def transcript_pattern(key: str | None, blocks: list[tuple[str, str]]) -> str:
    """A regular expression of one request's transcript record: a block per (prompt, response)."""
    head = re.escape(f"##### {key or '-'} ##### ") + r"\d+" + re.escape(" #####\n\n###\n")
    return "\n".join(head + re.escape(f"{prompt}\n#####\n{response}\n") for prompt, response in blocks) + "\n"


def streamed_texts(response, choices: int) -> list[str]:
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    texts = [""] * choices
    for line in lines[:-1]:
        choice = json.loads(line.removeprefix("data: "))["choices"][0]
        texts[choice["index"]] += choice["text"]
    return texts


def test_the_transcript_holds_a_block_per_choice_for_every_kind_of_body(lm, client, server):
    log_file = server.settings.log_file
    bodies = [
        {"prompt": ["a"], "max_tokens": 3},
        {"prompt": [1, 2, 3], "max_tokens": 3, "n": 2},
        {"prompt": ["a b"], "max_tokens": 0, "echo": True, "n": 2},
        {"prompt": ["a", "b c"], "max_tokens": 2, "n": 2},
        {"prompt": "a", "n": 2, "max_tokens": 2},
        {"prompt": [[5, 6], [7]], "max_tokens": 2},
        {"prompt": ["a"], "max_tokens": 3, "n": 2, "stream": True},
    ]
    for body in bodies:
        start = os.path.getsize(log_file)
        prompts = (
            [body["prompt"]]
            if isinstance(body["prompt"], str) or isinstance(body["prompt"][0], int)
            else body["prompt"]
        )
        texts = [p if isinstance(p, str) else lm.decode(p) for p in prompts for _ in range(body.get("n", 1))]
        if body.get("stream"):
            with client.stream("POST", "/v1/completions", json=body, headers=BEARER) as response:
                assert response.status_code == 200
                answers = streamed_texts(response, len(texts))
        else:
            response = client.post("/v1/completions", json=body, headers=BEARER)
            assert response.status_code == 200, (body, response.text)
            answers = [choice["text"] for choice in response.json()["choices"]]
        with open(log_file, "rb") as f:  # as written: a response may hold a \r
            f.seek(start)
            record = scanned(f.read().decode("utf-8"), "the request log")
        assert re.fullmatch(transcript_pattern(key_id(KEYS[0]), list(zip(texts, answers, strict=True))), record), (
            body,
            record,
        )


def per_request(results, task) -> list[list[float]]:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[float(r[0]) if isinstance(r, (list, tuple)) else float(r) for r in s["filtered_resps"]] for s in samples]


def test_lm_eval_scores_the_same_with_the_transcript_log_which_holds_each_request(lm, tmp_path, monkeypatch):
    for variable, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}.items():
        monkeypatch.setenv(variable, value)
    tasks = ["tiny_choice", "tiny_text"]
    index = task_manager(write_tasks(tmp_path / "tasks"), include_defaults=False)
    exchanges: list[tuple[dict, dict]] = []  # each completions request lm-eval sent, and its answer
    send = requests.adapters.HTTPAdapter.send

    def recording_send(adapter, request, **kwargs):
        response = send(adapter, request, **kwargs)
        if request.url.endswith("/v1/completions"):
            exchanges.append((json.loads(request.body), response.json()))
        return response

    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", recording_send)

    def evaluate(**log) -> dict:
        with RunningServer(lm, max_batch=MAX_BATCH, model_name="m", **log) as server:
            return simple_evaluate(
                model="local-completions",
                model_args=f"base_url={server.url}/v1/completions,model=m,max_length=64,batch_size={MAX_BATCH}",
                tasks=tasks,
                task_manager=index,
                log_samples=True,
            )

    plain = evaluate()
    exchanges.clear()
    log_file = tmp_path / "transcript.txt"
    logged = evaluate(log_file=str(log_file), log_format="transcript")
    for task in tasks:
        assert per_request(logged, task) == per_request(plain, task), task
    assert exchanges and all(isinstance(sent["prompt"][0], list) for sent, _ in exchanges)  # token ids, batched
    blocks = [
        (lm.decode(prompt), choice["text"])
        for sent, answer in exchanges
        for prompt, choice in zip(sent["prompt"], answer["choices"], strict=True)
    ]
    print(f"{len(exchanges)} requests of lm-eval, {len(blocks)} prompts, each in the transcript")
    expected = "".join(
        transcript_pattern(None, [(lm.decode(p), c["text"]) for p, c in zip(sent["prompt"], answer["choices"])])
        for sent, answer in exchanges
    )
    assert re.fullmatch(expected, log_file.read_bytes().decode("utf-8"))


# -- 3. a request log that cannot be written ----------------------------------------------------------
PRIVATE_PROMPT = "def private_prompt_7f3a(x):"


def test_an_unwritable_request_log_is_said_once_and_never_prints_a_record(lm, capfd, no_key_leaks):
    with RunningServer(lm, max_batch=MAX_BATCH, log_file="/dev/full") as server:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for _ in range(3):
                answered = http.post("/v1/completions", json={"prompt": PRIVATE_PROMPT, "max_tokens": 2})
                assert answered.status_code == 200
            assert http.post("/complete", json={"prompt": PRIVATE_PROMPT, "length": 2}).status_code == 200
            body = {"prompt": PRIVATE_PROMPT, "max_tokens": 2, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                streamed_texts(response, 1)  # the stream ends with [DONE]
    out, err = capfd.readouterr()
    assert "Logging error" not in err and "Message:" not in err and PRIVATE_PROMPT not in out + err
    errors = [r for r in no_key_leaks.records if r.levelno >= logging.ERROR]
    assert [(r.name, r.getMessage()) for r in errors] == [
        (
            "gptj_flax.serving.request_log",
            "the request log /dev/full cannot be written (No space left on device): requests are answered but "
            "not logged until it can",
        )
    ]
    console = [r for r in no_key_leaks.records if not r.name.startswith("gptj_flax.serving.requests:")]
    assert not any(PRIVATE_PROMPT in r.getMessage() for r in console)  # only the request log holds it


class _FailingStream:
    """A file whose writes fail as a failing disk's do."""

    def write(self, text):
        raise OSError(errno.EIO, "Input/output error")

    def flush(self):
        pass

    def seek(self, *args):
        return 0

    def tell(self):
        return 0


def test_an_io_error_in_the_request_log_is_said_once_and_its_recovery_too(tmp_path, capfd, no_key_leaks):
    log = RequestLog(tmp_path / "requests.jsonl")
    working, log._handler.stream = log._handler.stream, _FailingStream()
    record = dict(key_id=None, endpoint="/complete", pre_prompt="", settings={}, latency_s=0.1)
    for _ in range(3):
        log.write(prompt=PRIVATE_PROMPT, response="lost", **record)
    log._handler.stream = working
    log.write(prompt="kept", response="written", **record)
    log.close()
    messages = [
        (r.levelname, r.getMessage()) for r in no_key_leaks.records if r.name == "gptj_flax.serving.request_log"
    ]
    assert messages == [
        (
            "ERROR",
            f"the request log {tmp_path}/requests.jsonl cannot be written (Input/output error): requests are "
            "answered but not logged until it can",
        ),
        ("WARNING", f"the request log {tmp_path}/requests.jsonl is written again"),
    ]
    assert [json.loads(line)["prompt"] for line in (tmp_path / "requests.jsonl").read_text().splitlines()] == ["kept"]
    assert PRIVATE_PROMPT not in "".join(capfd.readouterr())


# -- 11. draining ---------------------------------------------------------------------------------
def test_a_drain_keeps_get_prediction_open_for_the_jobs_it_finishes_then_a_grace_for_uncollected(lm):
    held, grace = HeldModel(lm), 2.0
    contexts = ["def add(a, b):", "class Point", "import os"]
    with RunningServer(held, max_batch=MAX_BATCH, predictions_grace=grace) as server:
        url, store = server.url, server.service.predictions
        held.gate.clear()
        qids = [
            httpx.post(url + "/model/predict", json={"context": c, "length": 4, "temp": 0}).json()["qid"]
            for c in contexts
        ]
        wait_until(lambda: held.waiting, 30, "the jobs to reach the model")
        server.drain()  # what SIGTERM does
        assert httpx.post(url + "/model/predict", json={"context": "x"}).status_code == 503
        assert httpx.post(url + "/model/get_prediction", json={"qid": 1}).status_code == 404  # open, and unknown
        collected: dict[int, httpx.Response] = {}
        pollers = [  # the last job's result is never collected
            threading.Thread(
                target=lambda q=q: collected.setdefault(
                    q, httpx.post(url + "/model/get_prediction", json={"qid": q}, timeout=120)
                )
            )
            for q in qids[:-1]
        ]
        for poller in pollers:
            poller.start()
        held.gate.set()
        for poller in pollers:
            poller.join(120)
        server.thread.join(60)
        exited = time.monotonic()
        assert not server.thread.is_alive(), "the drain did not end"
        last = store.get(qids[-1], None)
    for qid, context in zip(qids[:-1], contexts, strict=False):
        assert collected[qid].status_code == 200, collected[qid].text
        assert collected[qid].json()["completion"] == lm.generate(lm.encode(context), 4, temperature=0).text
    waited = exited - (last.submitted + last.seconds)
    print(f"the server exited {waited:.2f} s after the uncollected result was ready (grace {grace} s)")
    assert grace - 0.2 <= waited <= grace + 10


def test_a_sigterm_during_the_warm_up_stops_compiling_and_exits_0(repo_root):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GPTJ_FLAX_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root), env.get("PYTHONPATH")) if p)
    command = [sys.executable, str(repo_root / "scripts" / "serve.py"), "--checkpoint", checkpoint_dir()]
    # 16 slots (the default) take the longest warm-up of the default settings
    command += ["--port", str(port), "--max-batch", "16"]
    process = subprocess.Popen(
        command, env={**env, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def warming_up() -> bool:
        assert process.poll() is None, process.stdout.read()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"] == "warming_up"
        except httpx.TransportError:
            return False

    try:
        wait_until(warming_up, 300, "the warm-up to begin", interval_s=0.2)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
        seconds = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    print(f"exited {seconds:.1f} s after SIGTERM, rc {process.returncode}")
    assert process.returncode == 0, output
    assert "warm-up stopped after" in output and "programs compiled in" not in output, output


def test_a_warm_up_near_the_kernels_limit_on_memory_maps_stops_with_the_fix_not_an_llvm_error(lm, monkeypatch, caplog):
    # a limit already reached (the programs may be compiled already in this process, taking no new maps,
    # so only a limit below the maps in use is sure to be met): the server says why and exits
    room = memory_maps.maps_in_use() - 100
    monkeypatch.setattr(memory_maps, "_read_int", lambda path: room if path == memory_maps.LIMIT_FILE else None)
    running = RunningServer(HeldModel(lm), max_batch=MAX_BATCH, queue_size=8)
    with caplog.at_level(logging.ERROR, logger="gptj_flax"):
        running.thread.start()
        running.thread.join(120)
    assert not running.thread.is_alive(), "the server kept running after its warm-up failed"
    running.sock.close()
    error = running.service.worker.error
    assert error.startswith("warm-up failed: the warm-up stopped: with ") and "programs compiled" in error, error
    assert f"of the {room:,} the kernel allows (vm.max_map_count)" in error, error
    assert "sysctl -w vm.max_map_count=1048576" in error and "--max-batch, --max-len" in error, error
    failed = [r for r in caplog.records if r.getMessage().startswith("warm-up failed")]
    assert len(failed) == 1 and failed[0].exc_info is None  # one line that says it all, no traceback


@pytest.mark.parametrize(
    "error, traceback",
    [(SamplingError("the slots need 9 GiB; pass a smaller --max-len"), False), (RuntimeError("device lost"), True)],
    ids=["project-error", "unexpected"],
)
def test_a_failed_warm_up_is_one_line_for_a_project_error_and_keeps_the_traceback_of_any_other(
    lm, caplog, error, traceback
):
    """A project error's message says what to do (as the memory-map check's above): one log line.
    Anything else is a bug or a lost device, and its traceback is what a report needs."""
    held = HeldModel(lm)

    def failing(**_):
        raise error

    held.slots = failing
    running = RunningServer(held, max_batch=MAX_BATCH, queue_size=8)
    with caplog.at_level(logging.ERROR, logger="gptj_flax"):
        running.thread.start()
        running.thread.join(120)
    assert not running.thread.is_alive(), "the server kept running after its warm-up failed"
    running.sock.close()
    assert running.service.worker.error == f"warm-up failed: {error}"
    failed = [r for r in caplog.records if r.getMessage().startswith("warm-up failed")]
    assert len(failed) == 1 and (failed[0].exc_info is not None) == traceback


# -- 12. text_offset ----------------------------------------------------------------------------------
def byte_offsets(lm, tokens: list[int], start: int = 0) -> list[int]:
    """Each token's offset from its bytes: the index, in their text decoded as the tokenizer does
    (each maximal invalid subpart one U+FFFD), of the character holding the token's first byte: the
    last character of the bytes up to that one, decoded."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    pieces = [bytes(byte_of[c] for c in piece) for piece in lm.tokenizer.convert_ids_to_tokens(tokens)]
    data = b"".join(pieces)
    firsts = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    return [start + len(data[: first + 1].decode("utf-8", "replace")) - 1 for first in firsts]


@pytest.mark.parametrize("prompt", ["", "日本語", "déjà vu", "a\u00e9\u65e5b", "ids ending in half a character"])
def test_echo_offsets_index_the_text_for_an_empty_prompt_and_split_characters(lm, client, prompt):
    if prompt == "ids ending in half a character":
        prompt = lm.encode("x日")[:-1]
        assert lm.decode(prompt).endswith("\ufffd")
    body = {"prompt": prompt, "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0}
    choice = client.post("/v1/completions", json=body, headers=BEARER).json()["choices"][0]
    prompt_text = prompt if isinstance(prompt, str) else lm.decode(prompt)
    echoed = lm.encode(prompt) or [lm.eos_token_id]  # an empty prompt starts from the end-of-text token
    generated = lm.generate(echoed, 4, temperature=0, return_tokens=True)
    text, logprobs = choice["text"], choice["logprobs"]
    assert text == prompt_text + generated.text
    assert logprobs["tokens"] == [lm.decode([t]) for t in echoed + generated.tokens]
    offsets = logprobs["text_offset"]
    # the prompt's tokens index the prompt; the generated ones the text after it
    expected = [0] if prompt == "" else byte_offsets(lm, echoed)  # the start token adds nothing to the text
    assert offsets == expected + byte_offsets(lm, generated.tokens, len(prompt_text))
    for token, offset, id_ in zip(logprobs["tokens"], offsets, echoed + generated.tokens, strict=True):
        if id_ != lm.eos_token_id and "\ufffd" not in token:  # a whole token's text is where it says
            assert text[offset : offset + len(token)] == token


def test_offsets_of_a_stream_split_anywhere_are_those_of_the_whole(lm):
    text = "日本語 déjà vu, naïve café — ok"
    tokens = lm.encode(text)
    whole = byte_offsets(lm, tokens, 7)
    assert TextOffsets(lm.decode, 7).add(tokens) == whole
    for cut in range(1, len(tokens)):
        offsets = TextOffsets(lm.decode, 7)
        assert offsets.add(tokens[:cut]) + offsets.add(tokens[cut:]) == whole, cut
