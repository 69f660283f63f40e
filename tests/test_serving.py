"""The HTTP server end to end: real uvicorn on 127.0.0.1, real HTTP clients (httpx), a tiny model.

Every completion asks for at most 16 new tokens and (but for the truncation test) prompts of at
most 16 tokens, so each batch size compiles one program, shared by every server in the module.
"""

import argparse
import asyncio
import json
import logging
import os
import re
import threading
import time

import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from benchmarks import serve as serve_benchmark
from gptj_flax.sampling import Sampling
from gptj_flax.serving import schemas
from gptj_flax.serving.auth import key_id
from gptj_flax.serving.schemas import MAX_TEXT_CHARS, SEED_LIMIT
from tests.test_serving_support import (
    KEYS,
    HeldModel,
    RunningServer,
    no_key_leaks,  # noqa: F401 - the autouse leak scan
    secret,
    tiny_model,
    wait_until,
    write_keys,
)

LENGTH = 12
CONTEXT = 64
MAX_BATCH = 4
PRE_PROMPT_LENGTH = 6
BEARER = {"Authorization": f"Bearer {KEYS[1]}"}
PROMPTS = ["def add(a, b):", "class Point", "for i in range(", "import os", "The quick brown fox", "print(i, i"]


@pytest.fixture(scope="module")
def lm():
    return tiny_model()


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve")
    write_keys(directory / "keys.txt")
    with RunningServer(
        HeldModel(lm),
        api_keys_file=str(directory / "keys.txt"),
        max_batch=MAX_BATCH,
        queue_size=256,
        pre_prompt_length=PRE_PROMPT_LENGTH,
        log_file=str(directory / "requests.jsonl"),
    ) as running:
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def complete(client, prompt, **fields):
    return client.post("/complete", json={"prompt": prompt, "api_key": KEYS[0], "length": LENGTH, **fields})


# -- each endpoint with valid input -----------------------------------------------------------------
def test_each_api_body_gives_its_settings_as_one_sampling():
    """What each API's fields mean to the samplers: top_p / typical_p 0 keep the fewest tokens a filter
    can (the smallest positive float32), top_k -1 is off, a temperature past float32's range is the
    hottest float32, and the original servers' `temp` is the temperature."""
    fewest, hottest = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    gpt4chan = schemas.CompleteRequest(prompt="x", temperature=1e300, top_p=0, typical_p=0.5)
    assert gpt4chan.sampling == Sampling(temperature=hottest, top_p=fewest, typical_p=0.5)
    openai = schemas.completion_request_model(MAX_BATCH, 300)
    body = openai(prompt="x", temperature=0, top_k=-1, top_p=0, min_p=0.1, repetition_penalty=1.5)
    assert body.sampling == Sampling(temperature=0, top_p=fewest, min_p=0.1, repetition_penalty=1.5)
    assert openai(prompt=[1, 2], top_k=7).sampling == Sampling(top_k=7)
    assert schemas.DeviceServeRequest(context="x", top_p=0, temp=2e300).sampling == Sampling(
        temperature=hottest, top_p=fewest
    )
    assert schemas.PredictRequest(context="x").sampling == Sampling(top_p=0.9, top_k=50)  # the docker API's defaults


def test_complete_equals_generate_greedy_and_seeded(lm, client):
    prompt = PROMPTS[0]
    response = complete(client, prompt, temperature=0)
    assert response.status_code == 200
    assert response.json() == {"response": lm.generate(lm.encode(prompt), LENGTH, temperature=0).text}

    sampling = dict(temperature=0.9, top_p=0.9, typical_p=0.95)
    sampled = [complete(client, prompt, seed=seed, **sampling).json()["response"] for seed in (11, 11, 12)]
    expected = [lm.generate(lm.encode(prompt), LENGTH, seed=seed, **sampling).text for seed in (11, 12)]
    assert sampled == [expected[0], expected[0], expected[1]]


def test_complete_keeps_the_pre_prompts_first_tokens_and_the_prompts_last(lm, client):
    pre_prompt = "import os\nimport sys\n\nif __name__"
    pre = lm.encode(pre_prompt)
    assert len(pre) > PRE_PROMPT_LENGTH
    response = complete(client, PROMPTS[1], pre_prompt=pre_prompt, temperature=0)
    tokens = pre[:PRE_PROMPT_LENGTH] + lm.encode(PROMPTS[1])
    assert response.json()["response"] == lm.generate(tokens, LENGTH, temperature=0).text

    long_prompt = " ".join(PROMPTS) * 4  # far more tokens than the context holds
    prompt_tokens = lm.encode(long_prompt)
    assert len(prompt_tokens) > CONTEXT
    response = complete(client, long_prompt, pre_prompt=pre_prompt, temperature=0, typical_p=0.5, seed=3)
    kept = pre[:PRE_PROMPT_LENGTH] + prompt_tokens[-(CONTEXT - LENGTH - PRE_PROMPT_LENGTH) :]
    assert len(kept) == CONTEXT - LENGTH
    assert response.json()["response"] == lm.generate(kept, LENGTH, temperature=0, typical_p=0.5, seed=3).text


def test_v1_completions_list_prompt_stop_logprobs_and_seed(lm, client, server):
    prompts = PROMPTS[:2]
    body = {"prompt": prompts, "max_tokens": LENGTH, "temperature": 0, "stop": ["\n\n", "zz"], "logprobs": 0}
    response = client.post("/v1/completions", json=body, headers=BEARER)
    assert response.status_code == 200
    out = response.json()
    expected = lm.generate(
        [lm.encode(p) for p in prompts],
        LENGTH,
        temperature=0,
        stop=["\n\n", "zz"],
        return_tokens=True,
        return_logprobs=True,
    )
    assert out["object"] == "text_completion" and out["model"] == server.settings.served_model_name
    for i, (choice, reference) in enumerate(zip(out["choices"], expected, strict=True)):
        assert choice["index"] == i and choice["text"] == reference.text
        assert choice["finish_reason"] == {"eos": "stop", "stop": "stop", "length": "length"}[reference.finish_reason]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(reference.logprobs)
        assert choice["logprobs"]["tokens"] == [lm.decode([t]) for t in reference.tokens]
        assert choice["logprobs"]["text_offset"][0] == len(prompts[i])
    assert out["usage"] == {
        "prompt_tokens": sum(c.prompt_tokens for c in expected),
        "completion_tokens": sum(c.completion_tokens for c in expected),
        "total_tokens": sum(c.prompt_tokens + c.completion_tokens for c in expected),
    }

    body = {
        "prompt": PROMPTS[2],
        "max_tokens": LENGTH,
        "temperature": 0.7,
        "top_p": 0.8,
        "seed": 5,
        "model": server.settings.served_model_name,
    }
    text = client.post("/v1/completions", json=body, headers=BEARER).json()["choices"][0]["text"]
    assert text == lm.generate(lm.encode(PROMPTS[2]), LENGTH, temperature=0.7, top_p=0.8, seed=5).text
    wrong_model = client.post("/v1/completions", json={**body, "model": "gpt-4"}, headers=BEARER)
    assert wrong_model.status_code == 404 and "gpt-4" in wrong_model.json()["detail"]


def test_v1_completions_streams_server_sent_events(lm, client):
    body = {"prompt": PROMPTS[3], "max_tokens": LENGTH, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body, headers=BEARER) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    events = [line.removeprefix("data: ") for line in lines if line]
    assert all(line.startswith("data: ") for line in lines if line) and events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(c["object"] == "text_completion" and c["choices"][0]["index"] == 0 for c in chunks)
    expected = lm.generate(lm.encode(PROMPTS[3]), LENGTH, temperature=0)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    # every chunk but the last carries text; the last says why the choice ended, as OpenAI's do
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[:-1] == [None] * (len(chunks) - 1) and chunks[-1]["choices"][0]["text"] == ""
    assert reasons[-1] == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]


def test_health_models_and_metrics(client, server):
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json() == {
        "status": "ready",
        "model": server.settings.served_model_name,
        "queued_prompts": 0,
        "error": None,
    }
    models = client.get("/v1/models", headers=BEARER).json()
    assert models["data"][0]["id"] == server.settings.served_model_name
    assert models["data"][0]["max_model_len"] == CONTEXT
    complete(client, PROMPTS[4], temperature=0)
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    for series in (
        "gptj_queue_depth 0.0",
        f"gptj_slots {float(MAX_BATCH)}",
        "gptj_busy_slots 0.0",
        "gptj_kv_pages_used 0.0",
        "gptj_time_to_first_token_seconds_count",
        "gptj_inter_token_latency_seconds_count",
        "gptj_slot_steps_total",
        "gptj_busy_slot_steps_total",
        "gptj_generated_tokens_total",
        'gptj_request_latency_seconds_bucket{endpoint="/complete"',
        'gptj_requests_total{endpoint="/complete",status="200"}',
        "gptj_queue_wait_seconds_count",
    ):
        assert series in metrics.text, series


# -- bad input ----------------------------------------------------------------------------------
def fields_named(response) -> set[str]:
    return {str(part) for error in response.json()["detail"] for part in error["loc"][1:]}


BAD_FIELDS = [
    ("/complete", {"prompt": "x", "length": "12"}, "length"),
    ("/complete", {"prompt": 5}, "prompt"),
    ("/complete", {"prompt": "x", "temperature": True}, "temperature"),
    ("/complete", {"prompt": "x", "top_p": "0.5"}, "top_p"),
    ("/complete", {"prompt": "x", "length": 0}, "length"),
    ("/complete", {"prompt": "x", "length": 1025}, "length"),
    ("/complete", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/complete", {"prompt": "x", "top_p": -0.1}, "top_p"),
    ("/complete", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/complete", {"prompt": "x", "typical_p": 1.01}, "typical_p"),
    ("/complete", {"prompt": "x", "seed": -1}, "seed"),
    ("/complete", {"prompt": "x", "seed": SEED_LIMIT}, "seed"),
    ("/complete", {"prompt": "x" * (MAX_TEXT_CHARS + 1)}, "prompt"),
    ("/complete", {"prompt": "x", "pre_prompt": "y" * (MAX_TEXT_CHARS + 1)}, "pre_prompt"),
    ("/complete", {"length": 5}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": ""}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": ["x"] * (MAX_BATCH + 1)}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": True, "echo": True}, "echo"),
]


@pytest.mark.parametrize("path,body,field", BAD_FIELDS, ids=[f"{p}-{f}-{i}" for i, (p, _, f) in enumerate(BAD_FIELDS)])
def test_a_wrong_type_or_out_of_range_field_is_a_422_naming_it(client, path, body, field):
    response = client.post(path, json={"api_key": KEYS[0], **body})
    assert response.status_code == 422, response.text
    assert field in fields_named(response)


def test_bad_keys_malformed_bodies_and_overlong_prompts(client, server):
    secret("sk-wrong")
    for path in ("/complete", "/v1/completions"):
        for headers, body_key in [
            ({}, None),
            ({}, "sk-wrong"),
            ({"Authorization": "Bearer sk-wrong"}, None),
            ({"Authorization": f"Basic {KEYS[0]}"}, None),
            ({"Authorization": "Bearer"}, None),
        ]:
            body = {"prompt": "x"} if body_key is None else {"prompt": "x", "api_key": body_key}
            response = client.post(path, json=body, headers=headers)
            assert response.status_code == 401, (path, headers, body_key)
            assert response.headers["www-authenticate"] == "Bearer"

    malformed = client.post(
        "/complete", content=b'{"prompt": "x", ', headers={"content-type": "application/json", **BEARER}
    )
    assert malformed.status_code == 400 and malformed.json()["detail"].startswith("malformed JSON at character 16")
    not_json = client.post("/complete", content=b"prompt=x", headers={"content-type": "text/plain", **BEARER})
    assert not_json.status_code == 422
    oversized = b"{" + b" " * (server.service.max_body_bytes + 1) + b"}"
    huge = client.post("/complete", content=oversized, headers={"content-type": "application/json", **BEARER})
    assert huge.status_code == 413
    chunked = client.post(
        "/complete",
        content=iter([oversized[:100], oversized[100:]]),  # no Content-Length
        headers={"content-type": "application/json", **BEARER},
    )
    assert chunked.status_code == 413

    # The pre_prompt's kept tokens, one prompt token and length must fit the 64-token context (the
    # truncation test shows a prompt cut to fill it exactly).
    too_long = complete(client, "x", length=CONTEXT)
    assert too_long.status_code == 413 and "context of 64 tokens" in too_long.json()["detail"]
    over = client.post("/v1/completions", json={"prompt": " ".join(PROMPTS) * 4, "max_tokens": 4}, headers=BEARER)
    assert over.status_code == 413 and "prompt 0 has" in over.json()["detail"]

    assert client.get("/health").status_code == 200
    assert 'status="500"' not in client.get("/metrics").text


def test_keys_file_is_reloaded_and_keys_never_reach_a_log(client, server, caplog):
    caplog.set_level(logging.DEBUG)
    keys_file = server.settings.api_keys_file
    extra = secret("sk-charlie-5555555555")
    try:
        write_keys(keys_file, [KEYS[0]])
        assert complete(client, "x", temperature=0).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "x"}, headers=BEARER).status_code == 401
        write_keys(keys_file, [*KEYS, extra])
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=BEARER).status_code == 200
        assert complete(client, "x", api_key=extra, temperature=0).status_code == 200
        os.remove(keys_file)  # a vanished keys file refuses everyone
        assert complete(client, "x").status_code == 401
    finally:
        write_keys(keys_file)
    assert complete(client, "x", temperature=0).status_code == 200

    with open(server.settings.log_file) as f:
        log_text = f.read()
    records = [json.loads(line) for line in log_text.splitlines()]
    assert {key_id(KEYS[0]), key_id(KEYS[1]), key_id(extra)} <= {r["key_id"] for r in records}
    assert set(records[-1]) == {
        "time",
        "key_id",
        "endpoint",
        "prompt",
        "pre_prompt",
        "settings",
        "response",
        "latency_s",
    }
    for key in (*KEYS, extra):
        assert key not in log_text and key not in caplog.text


def test_transcript_log_rotates_by_size(lm, tmp_path):
    log_file = tmp_path / "logs" / "transcript.txt"
    with RunningServer(
        lm, max_batch=1, log_file=str(log_file), log_format="transcript", log_max_bytes=100, log_backups=2
    ) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            responses = [
                http.post("/complete", json={"prompt": p, "pre_prompt": "#", "length": 4, "temperature": 0}).json()[
                    "response"
                ]
                for p in PROMPTS
            ]
    assert sorted(os.listdir(log_file.parent)) == ["transcript.txt", "transcript.txt.1", "transcript.txt.2"]
    record = r"##### - ##### \d+ #####\n#\n###\n" + re.escape(f"{PROMPTS[-1]}\n#####\n{responses[-1]}\n\n")
    assert re.fullmatch(record, log_file.read_text())  # records are small: the newest file holds the last one


# -- queue, batching, disconnects, shutdown ----------------------------------------------------------
def test_not_ready_until_warmed_up(lm):
    held = HeldModel(lm)
    held.gate.clear()  # hold the warm-up
    server = RunningServer(held, max_batch=2)
    try:
        server.start(wait_ready=False)
        assert httpx.get(server.url + "/health").json()["status"] == "warming_up"
        refused = httpx.post(server.url + "/complete", json={"prompt": "x", "length": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        held.gate.set()
        wait_until(lambda: server.health() == 200, 120, "the warm-up")
        assert httpx.post(server.url + "/complete", json={"prompt": "x", "length": 2}, timeout=60).status_code == 200
    finally:
        held.gate.set()
        server.stop()


def test_a_model_that_fails_its_warm_up_stops_the_server(lm):
    held = HeldModel(lm)
    held.fail_next = True
    server = RunningServer(held)
    server.thread.start()
    server.thread.join(60)  # it exits by itself (scripts/serve.py then exits 1)
    assert not server.thread.is_alive()
    assert server.service.status == "failed" and "device lost" in server.service.worker.error
    server.stop()


def test_full_queue_is_429_and_a_departed_client_frees_its_slot(lm):
    held = HeldModel(lm)
    body = {"length": 4, "temperature": 0}
    with RunningServer(held, queue_size=2, max_batch=1) as server:
        held.gate.clear()
        held.batches.clear()
        worker = server.service.worker

        async def until(condition):
            for _ in range(3000):
                if condition():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("timed out")

        async def scenario():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

                def send(prompt):
                    return asyncio.ensure_future(http.post("/complete", json={"prompt": prompt, **body}))

                first = send(PROMPTS[0])
                await until(lambda: held.waiting)  # in the model, held at the gate
                leaver, stayer = send(PROMPTS[1]), send(PROMPTS[2])
                await until(lambda: worker.queued_rows == 2)
                full = await http.post("/complete", json={"prompt": PROMPTS[3], **body})
                assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
                leaver.cancel()  # the client disconnects while its request waits
                await until(lambda: worker.queued_rows == 1)
                late = send(PROMPTS[4])  # the freed slot takes a new request
                await until(lambda: worker.queued_rows == 2)
                held.gate.set()
                return [(await task).json()["response"] for task in (first, stayer, late)]

        try:
            responses = asyncio.run(scenario())
        finally:
            held.gate.set()
        assert server.health() == 200
    expected = [lm.generate(lm.encode(p), 4, temperature=0).text for p in (PROMPTS[0], PROMPTS[2], PROMPTS[4])]
    assert responses == expected
    generated = [prompt for batch in held.batches for prompt in batch]
    assert lm.encode(PROMPTS[1]) not in generated  # the departed request never reached the model
    assert len(generated) == 3


def test_a_client_leaving_mid_stream_stops_its_generation(lm):
    held = HeldModel(lm)
    prompt = next(p for p in PROMPTS if lm.generate(lm.encode(p), 16, temperature=0).finish_reason == "length")
    with RunningServer(held, max_batch=2) as server:
        held.step_delay_s = 0.1
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                first = next(line for line in response.iter_lines() if line)
                assert first.startswith("data: {")
            # leaving the block closed the connection mid-stream: its slot is freed, long before 16 tokens
            wait_until(lambda: "gptj_busy_slots 0.0" in http.get("/metrics").text, 30, "the slot to be freed")
            calls = held.decode_calls
            time.sleep(0.5)
            assert held.decode_calls == calls  # nothing runs on for the client that left
            assert http.get("/health").status_code == 200
            after = http.post("/complete", json={"prompt": prompt, "length": 4, "temperature": 0})
            assert after.status_code == 200
    assert server.service.in_flight == 0


def test_64_concurrent_clients_each_get_their_own_answer_exactly_once(lm):
    clients, rounds = 64, 3
    prompts = [[f"{PROMPTS[(c + r) % len(PROMPTS)]} {c} {r}" for r in range(rounds)] for c in range(clients)]
    held = HeldModel(lm)
    with RunningServer(held, max_batch=MAX_BATCH, queue_size=clients) as server:
        held.batches.clear()

        async def one_client(http, own):
            answers = []
            for prompt in own:
                response = await http.post("/complete", json={"prompt": prompt, "length": 8, "temperature": 0})
                assert response.status_code == 200, response.text
                answers.append(response.json()["response"])
            return answers

        async def everyone():
            limits = httpx.Limits(max_connections=clients)
            async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
                return await asyncio.gather(*(one_client(http, own) for own in prompts))

        answers = asyncio.run(everyone())
        metrics = httpx.get(server.url + "/metrics").text
    flat_prompts = [p for own in prompts for p in own]
    unbatched = {p: lm.generate(lm.encode(p), 8, temperature=0).text for p in flat_prompts}
    assert [a for own in answers for a in own] == [unbatched[p] for p in flat_prompts]
    generated = sorted(tuple(p) for batch in held.batches for p in batch)
    assert generated == sorted(tuple(lm.encode(p)) for p in flat_prompts)  # each request generated exactly once
    # with 64 clients waiting on 4 slots, every slot is busy at (nearly) every step
    busy, steps = (
        float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1))
        for name in ("gptj_busy_slot_steps_total", "gptj_slot_steps_total")
    )
    assert busy / steps > 0.8, (busy, steps)
    assert 'gptj_requests_total{endpoint="/complete",status="200"} 192.0' in metrics


def test_a_failed_batch_is_answered_with_an_error_and_the_server_goes_on(lm, caplog):
    held = HeldModel(lm)
    with RunningServer(held, max_batch=2) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"prompt": PROMPTS[0], "length": 4, "temperature": 0}
        held.fail_next = True
        failed = http.post("/complete", json=body)
        assert failed.status_code == 500 and "generation failed" in failed.json()["detail"]
        held.fail_next = True
        stream_body = {"prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
        with http.stream("POST", "/v1/completions", json=stream_body) as response:
            events = [line for line in response.iter_lines() if line]
        assert response.status_code == 200 and len(events) == 1 and '"server_error"' in events[0]
        assert http.post("/complete", json=body).status_code == 200
        assert http.get("/health").status_code == 200
    assert "device lost" in caplog.text


def test_shutdown_finishes_work_in_flight_and_refuses_new_requests(lm):
    held = HeldModel(lm)
    server = RunningServer(held, max_batch=2).start()
    held.gate.clear()
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault(
            "response",
            httpx.post(
                server.url + "/complete", json={"prompt": PROMPTS[0], "length": 4, "temperature": 0}, timeout=120
            ),
        )
    )
    thread.start()
    wait_until(lambda: held.waiting, 30, "the request to reach the model")
    try:
        server.drain()  # what SIGTERM does
        refused = httpx.post(server.url + "/complete", json={"prompt": PROMPTS[1], "length": 4})
        assert refused.status_code == 503
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
    finally:
        held.gate.set()
    thread.join(60)
    assert result["response"].status_code == 200
    assert result["response"].json()["response"] == lm.generate(lm.encode(PROMPTS[0]), 4, temperature=0).text
    server.thread.join(60)  # the server exits by itself once nothing is in flight
    assert not server.thread.is_alive() and server.service.worker.state == "stopped"
    server.stop()


# -- whole-API checks ------------------------------------------------------------------------------
OVERFLOW = "__1e309__"  # stands for the literal 1e309, which Python's json reads as inf
# What JSON as Python parses it holds beyond the schema's types: non-finite numbers and lone surrogates.
POISONS = [float("nan"), float("inf"), float("-inf"), OVERFLOW, "\ud800", "text \udfff", ["\udbff"]]
BODY_FIELDS = {
    "/complete": sorted(schemas.CompleteRequest.model_fields),
    "/v1/completions": sorted(schemas.completion_request_model(1, 300).model_fields),
    "/v1/chat/completions": sorted(schemas.chat_request_model(1).model_fields),
    "/tokenize": sorted(schemas.TokenizeRequest.model_fields),
    "/detokenize": sorted(schemas.detokenize_request_model(300).model_fields),
    "/v1/adapters": sorted(schemas.AdapterRequest.model_fields),
}


def poisoned_json(body, field: str, poison, shape: str) -> bytes:
    """``body`` with ``poison`` as ``field``'s value (or in a list there), optionally inside an array body."""
    body = dict(body) if isinstance(body, dict) else {}
    body[field] = [poison] if shape == "in a list" else poison
    text = json.dumps([body] if shape == "in an array body" else body)  # NaN, Infinity; surrogates as \uXXXX
    return text.replace(f'"{OVERFLOW}"', "1e309").encode()


def test_schemathesis_finds_no_server_error_and_no_schema_violation(lm, tmp_path):
    write_keys(tmp_path / "keys.txt")
    # A template that reads every message field, so that generated conversations are rendered too.
    (tmp_path / "chat.jinja").write_text(
        "{% for m in messages %}{{ m.name or '' }} {{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with RunningServer(
        lm, max_batch=1, api_keys_file=str(tmp_path / "keys.txt"), chat_template=str(tmp_path / "chat.jinja")
    ) as server:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=BEARER)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.label for op in operations} == {
            "POST /complete",
            "POST /v1/completions",
            "POST /v1/chat/completions",
            "POST /tokenize",
            "POST /detokenize",
            "GET /tokenizer_info",
            "GET /v1/models",
            "POST /v1/adapters",
            "DELETE /v1/adapters/{name}",
            "GET /health",
            "GET /metrics",
        }
        for operation in operations:
            # negative cases (schema-breaking bodies) exist only for operations that take a body
            modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.body else [])
            for mode in modes:

                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(
                    max_examples=40,
                    deadline=None,
                    database=None,
                    derandomize=True,
                    suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.generate],
                )
                def call(case):
                    # A schema-valid request may still not fit the model's context (413): a limit that
                    # depends on tokenization, which the schema cannot state.
                    case.call_and_validate(headers=BEARER, excluded_checks=[positive_data_acceptance])

                call()
            if operation.body:

                @given(
                    case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
                    field=st.sampled_from(BODY_FIELDS[operation.path]),
                    poison=st.sampled_from(POISONS),
                    shape=st.sampled_from(["as the value", "in a list", "in an array body"]),
                )
                @settings(
                    max_examples=40,
                    deadline=None,
                    database=None,
                    derandomize=True,
                    suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.generate],
                )
                def call_poisoned(case, field, poison, shape):
                    case.body = poisoned_json(case.body, field, poison, shape)  # bytes go out as they are
                    response = case.call_and_validate(headers=BEARER, excluded_checks=[positive_data_acceptance])
                    assert response.status_code == 422, (field, shape, response.text)  # every field is typed

                call_poisoned()
        assert server.health() == 200
        # /health's 503s are the start-up's polls during the warm-up, as documented
        errors = re.findall(r'endpoint="([^"]+)",status="(5\d\d)"', httpx.get(server.url + "/metrics").text)
        assert set(errors) <= {("/health", "503")}, errors


def test_serve_benchmark_runs_against_a_running_server(server, capsys):
    parser = argparse.ArgumentParser()
    serve_benchmark.add_arguments(parser)
    args = parser.parse_args(
        ["--url", server.url, "--api-key", KEYS[0], "--concurrency", "1,4", "--warmup", "0.5", "--seconds", "1"]
        + ["--new-tokens", "8"]
    )
    serve_benchmark.run(args)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
    assert [row[0] for row in rows] == ["1", "4"]
    assert "4 clients: " in out and "x the generated tokens/s of 1 client" in out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["clients", "requests"])
    assert (
        header.split()
        == (
            "clients requests gen tokens/s bound tokens/s of bound TTFT p50 s TTFT p99 s ITL p50 ms ITL p99 ms occupancy"
        ).split()
    )
    # another's server: no model to time the step alone on, so no bound
    assert all(row[3:5] == ["n/a", "n/a"] for row in rows), out
    assert "bound: not measured (with --url the benchmark has no model)" in out
    for row in rows:
        assert int(row[1]) >= 1 and float(row[2].replace(",", "")) > 0
        assert float(row[5]) > 0 and float(row[7]) >= 0  # a real first-token time and a gap
        assert row[-1].endswith("%") and 0 < float(row[-1][:-1]) <= 100


def test_serve_benchmark_counts_only_the_window():
    """Requests sent before the window and tokens that came after it are left out; a token inside
    counts whoever sent it."""
    timed = serve_benchmark._Timed
    results = [
        timed(sent=0.0, arrivals=[0.5, 1.5, 2.5], gaps=[1.0, 1.0], ended=2.6),  # sent before: 2 tokens inside
        timed(sent=1.2, arrivals=[1.3, 1.4, 3.5], gaps=[0.1, 2.1], ended=3.6),  # inside: 2 tokens inside
        timed(sent=2.9, arrivals=[], gaps=[], ended=3.9),  # inside, no token: TTFT until it ended
        timed(sent=3.2, arrivals=[3.4], gaps=[], ended=3.5),  # after the window
    ]
    r = serve_benchmark._window(results, clients=2, opens=1.0, closes=3.0, occupancy=0.5)
    assert (r.requests, r.tokens, r.seconds) == (2, 4, 2.0)
    assert r.ttft == pytest.approx([0.1, 1.0])
    assert sorted(r.itl) == pytest.approx([0.1, 1.0, 1.0])  # 1.5 and 2.5 of the first, 1.4 of the second
