"""The original mesh-transformer-jax servers' clients against a real server (uvicorn on 127.0.0.1,
httpx, the tiny model): ``device_serve.py``'s body on ``POST /complete`` and the ``docker/`` API's
``/model/predict`` + ``/model/get_prediction``, next to GPT-4chan's unchanged ``/complete``.

The tiny model's context is 64 tokens, so device_serve.py's 256 new tokens become 63 here.
"""

import asyncio
import json
import re
import shlex
from pathlib import Path

import httpx
import pytest

from gptj_flax.serving.settings import SettingsError
from tests.test_serving_cli import parse
from tests.test_serving_support import (
    KEYS,
    HeldModel,
    RunningServer,
    no_key_leaks,  # noqa: F401 - the autouse leak scan
    secret,
    tiny_model,
    write_keys,
)

CONTEXT = 64
DEVICE_SERVE_LENGTH = CONTEXT - 1  # 256, cut to what the context leaves beside one context token
BEARER = {"Authorization": f"Bearer {KEYS[1]}"}
PROMPTS = ["def add(a, b):", "class Point", "for i in range(", "import os", "The quick brown fox"]
SERVE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "serve.md"


@pytest.fixture(scope="module")
def lm():
    return tiny_model()


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve-legacy")
    write_keys(directory / "keys.txt")
    with RunningServer(
        HeldModel(lm),
        api_keys_file=str(directory / "keys.txt"),
        max_batch=4,
        queue_size=64,
        log_file=str(directory / "requests.jsonl"),
    ) as running:
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=BEARER) as http:
        yield http


@pytest.fixture(scope="module")
def held():
    """The model of ``open_server``; tests that close its gate open it again before they end."""
    return HeldModel(tiny_model())


@pytest.fixture(scope="module")
def open_server(held):
    """No keys, CORS on, one prompt a batch, one waiting, two finished predictions kept."""
    with RunningServer(held, cors=True, max_batch=1, queue_size=1, predictions_kept=2) as running:
        yield running


@pytest.fixture
def open_client(open_server, held):
    with httpx.Client(base_url=open_server.url, timeout=120) as http:
        yield http
    held.gate.set()


def kept(lm, text: str, length: int) -> list[int]:
    """``text``'s last tokens that fit the context with ``length`` new ones, as the server keeps them."""
    tokens = lm.encode(text)
    return tokens[max(0, len(tokens) - (CONTEXT - length)) :]


def greedy(lm, text: str, length: int) -> str:
    return lm.generate(kept(lm, text, length), length, temperature=0).text


def predict(http, context, **fields):
    response = http.post("/model/predict", json={"context": context, **fields})
    assert response.status_code == 200, response.text
    assert set(response.json()) == {"qid"} and isinstance(response.json()["qid"], int)
    return response.json()["qid"]


def fields_named(response) -> set[str]:
    return {str(part) for error in response.json()["detail"] for part in error["loc"][1:]}


def last_log_record(server) -> dict:
    with open(server.settings.log_file) as f:
        return json.loads(f.read().splitlines()[-1])


# -- device_serve.py's body on /complete ---------------------------------------------------------------
def test_a_device_serve_body_gets_its_completion_equal_to_generate(lm, client, server):
    # device_serve.py's own example body, greedy
    response = client.post("/complete", json={"context": PROMPTS[0], "top_p": 0.9, "temp": 0})
    assert response.status_code == 200, response.text
    assert response.json() == {"completion": greedy(lm, PROMPTS[0], DEVICE_SERVE_LENGTH)}
    record = last_log_record(server)
    assert record["endpoint"] == "/complete" and record["prompt"] == PROMPTS[0]
    assert {k: record["settings"][k] for k in ("length", "top_p", "temp")} == {
        "length": DEVICE_SERVE_LENGTH,
        "top_p": 0.9,
        "temp": 0,
    }

    long_context = " ".join(PROMPTS) * 4  # more tokens than the context: its last one is kept
    assert len(lm.encode(long_context)) > CONTEXT
    response = client.post("/complete", json={"context": long_context, "top_p": 1.0, "temp": 0.0})
    assert response.json() == {"completion": greedy(lm, long_context, DEVICE_SERVE_LENGTH)}

    sampled = client.post("/complete", json={"context": PROMPTS[1], "top_p": 0.5, "temp": 0.8})
    assert sampled.status_code == 200 and set(sampled.json()) == {"completion"}
    seed = last_log_record(server)["settings"]["seed"]
    expected = lm.generate(
        kept(lm, PROMPTS[1], DEVICE_SERVE_LENGTH), DEVICE_SERVE_LENGTH, temperature=0.8, top_p=0.5, seed=seed
    )
    assert sampled.json()["completion"] == expected.text


def test_a_gpt4chan_body_is_still_answered_with_its_response(lm, client):
    for body in (
        {"prompt": PROMPTS[2], "length": 12, "temperature": 0},
        {"prompt": PROMPTS[2], "length": 12, "temperature": 0, "top_p": 1.0, "api_key": KEYS[0]},
    ):
        response = client.post("/complete", json=body)
        assert response.status_code == 200, response.text
        assert response.json() == {"response": lm.generate(lm.encode(PROMPTS[2]), 12, temperature=0).text}


BOTH_OR_NEITHER = [
    ({"prompt": "x", "context": "y", "top_p": 0.9, "temp": 1.0}, ["prompt"]),
    ({"context": "y", "top_p": 0.9, "temp": 1.0, "length": 8, "temperature": 0}, ["length", "temperature"]),
    ({"prompt": "x", "temp": 1.0}, ["prompt"]),
]


@pytest.mark.parametrize("body,gpt4chan_fields", BOTH_OR_NEITHER)
def test_a_body_with_both_sets_of_fields_is_a_422_naming_them(client, server, body, gpt4chan_fields):
    before = len(server.app.state.service.worker.model.batches)
    response = client.post("/complete", json=body)
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body"] and error["type"] == "mixed_body"
    assert "not both" in error["msg"] and error["msg"].endswith(", ".join(gpt4chan_fields))
    assert len(server.app.state.service.worker.model.batches) == before  # nothing reached the model


@pytest.mark.parametrize("body", [{}, {"top_p": 0.9}, {"api_key": KEYS[0]}])
def test_a_body_with_neither_is_gpt4chans_422_naming_the_prompt(client, body):
    response = client.post("/complete", json=body)
    assert response.status_code == 422
    assert response.json()["detail"] == [{"loc": ["body", "prompt"], "msg": "Field required", "type": "missing"}]


DEVICE_SERVE = {"context": "x", "top_p": 0.9, "temp": 0.7}
BAD_DEVICE_SERVE = [
    ({"top_p": 0.9, "temp": 0.7}, "context"),
    ({"context": "x", "temp": 0.7}, "top_p"),
    ({"context": "x", "top_p": 0.9}, "temp"),
    ({**DEVICE_SERVE, "top_p": "0.9"}, "top_p"),  # device_serve.py ran float() on it; strings are refused here
    ({**DEVICE_SERVE, "temp": True}, "temp"),
    ({**DEVICE_SERVE, "top_p": 1.5}, "top_p"),
    ({**DEVICE_SERVE, "temp": -1}, "temp"),
    ({**DEVICE_SERVE, "context": 5}, "context"),
    ({**DEVICE_SERVE, "context": None}, "context"),
    ({**DEVICE_SERVE, "context": "x" * 16385}, "context"),
]


@pytest.mark.parametrize("body,field", BAD_DEVICE_SERVE, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_DEVICE_SERVE)])
def test_a_bad_device_serve_field_is_a_422_naming_it(client, body, field):
    response = client.post("/complete", json=body)
    assert response.status_code == 422, response.text
    assert fields_named(response) == {field}


def test_non_finite_numbers_and_broken_json_are_4xx_not_500(client, server):
    for raw, status in [
        (b'{"context": "x", "top_p": NaN, "temp": 1}', 422),
        (b'{"context": "x", "top_p": 0.9, "temp": 1e309}', 422),
        (b'{"context": "x", "top_p": 0.9, "temp": Infinity}', 422),
        (b'{"context": "\\ud800", "top_p": 0.9, "temp": 1}', 422),
        (b'{"context": "x", "top_p": 0.9, ', 400),
        (b'[{"context": "x"}]', 422),
    ]:
        response = client.post("/complete", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == status, (raw, response.text)
    # with a body that is not JSON, FastAPI reads no fields: the GPT-4chan route's 422, as before
    as_text = client.post("/complete", content=json.dumps(DEVICE_SERVE), headers={"content-type": "text/plain"})
    assert as_text.status_code == 422
    oversized = b"{" + b" " * (server.service.max_body_bytes + 1) + b"}"
    for content in (oversized, iter([oversized[:100], oversized[100:]])):  # with and without Content-Length
        huge = client.post("/complete", content=content, headers={"content-type": "application/json"})
        assert huge.status_code == 413 and "Content Too Large" in huge.text
    assert 'status="500"' not in client.get("/metrics").text


# -- the docker API ------------------------------------------------------------------------------------
def test_docker_predict_then_get_prediction_gets_the_documented_result(lm, client, server):
    body = {"context": PROMPTS[3], "temp": 0.0, "top_p": 0.9, "top_k": 0, "length": 10}
    qid = predict(client, **body)
    result = client.post("/model/get_prediction", json={"qid": qid})
    assert result.status_code == 200, result.text
    out = result.json()
    assert set(out) == {"context", "completion", "time"}
    assert out["context"] == PROMPTS[3] and out["completion"] == greedy(lm, PROMPTS[3], 10)
    assert isinstance(out["time"], float) and 0 <= out["time"] < 120
    assert client.post("/model/get_prediction", json={"qid": qid}).json() == out  # kept: it can be fetched again
    record = last_log_record(server)
    assert record["endpoint"] == "/model/predict" and record["response"] == out["completion"]

    metrics = client.get("/metrics").text
    assert 'gptj_requests_total{endpoint="/model/predict",status="200"}' in metrics
    assert 'gptj_requests_total{endpoint="/model/get_prediction",status="200"}' in metrics


def test_docker_defaults_are_the_originals(lm, client, server):
    # length 256 does not fit the tiny model's context: the 413 shows the default
    too_long = client.post("/model/predict", json={"context": PROMPTS[4]})
    assert too_long.status_code == 413 and too_long.json()["detail"].startswith("length 256 ")
    qid = predict(client, PROMPTS[4], length=8)
    out = client.post("/model/get_prediction", json={"qid": qid}).json()
    settings = last_log_record(server)["settings"]
    assert {k: settings[k] for k in ("length", "temp", "top_p", "top_k")} == {
        "length": 8,
        "temp": 1.0,
        "top_p": 0.9,
        "top_k": 50,
    }
    expected = lm.generate(lm.encode(PROMPTS[4]), 8, temperature=1.0, top_p=0.9, top_k=50, seed=settings["seed"])
    assert out["completion"] == expected.text


BAD_DOCKER = [
    ("/model/predict", {"temp": 1.0}, "context"),
    ("/model/predict", {"context": "x", "length": 0}, "length"),
    ("/model/predict", {"context": "x", "length": "8"}, "length"),
    ("/model/predict", {"context": "x", "temp": None}, "temp"),
    ("/model/predict", {"context": "x", "top_p": -0.5}, "top_p"),
    ("/model/predict", {"context": "x", "top_k": -1}, "top_k"),
    ("/model/predict", {"context": "x", "top_k": 4.0}, "top_k"),
    ("/model/get_prediction", {}, "qid"),
    ("/model/get_prediction", {"qid": "5"}, "qid"),
    ("/model/get_prediction", {"qid": 0}, "qid"),
    ("/model/get_prediction", {"qid": 2**53}, "qid"),
]


@pytest.mark.parametrize("path,body,field", BAD_DOCKER, ids=[f"{p}-{f}-{i}" for i, (p, _, f) in enumerate(BAD_DOCKER)])
def test_a_bad_docker_field_is_a_422_naming_it(client, path, body, field):
    response = client.post(path, json=body)
    assert response.status_code == 422, response.text
    assert fields_named(response) == {field}


def test_an_unknown_qid_or_another_keys_is_a_404(client, server):
    unknown = client.post("/model/get_prediction", json={"qid": 12345})
    assert unknown.status_code == 404 and "no prediction has this qid" in unknown.json()["detail"]
    qid = predict(client, PROMPTS[0], length=4, temp=0.0)
    assert client.post("/model/get_prediction", json={"qid": qid}).status_code == 200
    # only the other key (the client's Bearer token, KEYS[1], would be looked at first)
    other_key = httpx.post(client.base_url.join("/model/get_prediction"), json={"qid": qid, "api_key": KEYS[0]})
    assert other_key.status_code == 404 and other_key.json() == unknown.json()


def test_a_prediction_polled_before_it_finishes_is_answered_once_ready(lm, held, open_client):
    held.gate.clear()  # hold the model

    async def scenario():
        async with httpx.AsyncClient(base_url=open_client.base_url, timeout=120) as http:
            answer = await http.post("/model/predict", json={"context": PROMPTS[1], "temp": 0, "length": 6})
            assert answer.status_code == 200  # answered at once, while the model is held
            qid = answer.json()["qid"]
            poll = asyncio.ensure_future(http.post("/model/get_prediction", json={"qid": qid}))
            for _ in range(3000):
                if held.waiting:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            assert not poll.done()  # as the original: get_prediction waits for the result
            held.gate.set()
            return await poll

    result = asyncio.run(scenario())
    assert result.status_code == 200
    assert result.json()["completion"] == greedy(lm, PROMPTS[1], 6)


def test_a_poll_whose_client_leaves_keeps_the_result_for_the_next(lm, held, open_client):
    held.gate.clear()
    qid = predict(open_client, PROMPTS[2], temp=0, length=5)
    with pytest.raises(httpx.ReadTimeout):
        open_client.post("/model/get_prediction", json={"qid": qid}, timeout=0.5)
    held.gate.set()
    result = open_client.post("/model/get_prediction", json={"qid": qid})
    assert result.status_code == 200 and result.json()["completion"] == greedy(lm, PROMPTS[2], 5)


def test_only_the_newest_finished_predictions_are_kept(lm, open_client):
    qids = []
    for prompt in PROMPTS[:3]:  # one at a time: the queue holds one prompt
        qids.append(predict(open_client, prompt, temp=0, length=3))
        assert open_client.post("/model/get_prediction", json={"qid": qids[-1]}).status_code == 200
    answers = [open_client.post("/model/get_prediction", json={"qid": q}) for q in qids]
    # three finished, two kept (predictions_kept=2): the oldest is gone
    assert [a.status_code for a in answers] == [404, 200, 200]
    assert [a.json()["completion"] for a in answers[1:]] == [greedy(lm, p, 3) for p in PROMPTS[1:3]]


def test_a_failed_prediction_is_answered_with_an_error_and_the_server_goes_on(held, open_client):
    held.fail_next = True
    qid = predict(open_client, PROMPTS[0], temp=0, length=3)
    failed = open_client.post("/model/get_prediction", json={"qid": qid})
    assert failed.status_code == 500 and failed.json() == {
        "detail": "generation failed; the server log has the details"
    }
    assert (
        open_client.post("/model/get_prediction", json={"qid": predict(open_client, "x", length=2)}).status_code == 200
    )


# -- what the new routes share with the rest -----------------------------------------------------------
def test_keys_are_needed_on_the_new_routes(client):
    wrong = secret("sk-wrong-legacy-0000")
    for path, body in [
        ("/complete", DEVICE_SERVE),
        ("/model/predict", {"context": "x", "length": 2}),
        ("/model/get_prediction", {"qid": 1}),
    ]:
        for headers, extra in [({}, {}), ({"Authorization": f"Bearer {wrong}"}, {}), ({}, {"api_key": wrong})]:
            response = httpx.post(client.base_url.join(path), json={**body, **extra}, headers=headers, timeout=60)
            assert response.status_code == 401, (path, headers, extra)
            assert response.headers["www-authenticate"] == "Bearer"
    assert client.post("/complete", json={**DEVICE_SERVE, "api_key": KEYS[0]}, headers={}).status_code == 200


def test_a_full_queue_is_429_on_the_new_routes(held, open_client, open_server):
    held.gate.clear()
    worker = open_server.service.worker

    async def scenario():
        async with httpx.AsyncClient(base_url=open_client.base_url, timeout=120) as http:
            first = asyncio.ensure_future(http.post("/complete", json={**DEVICE_SERVE, "temp": 0}))
            for _ in range(3000):  # the first is in the model, the second fills the one-prompt queue
                if held.waiting:
                    break
                await asyncio.sleep(0.01)
            qid = (await http.post("/model/predict", json={"context": "y", "length": 2})).json()["qid"]
            assert worker.queued_rows == 1
            full = [
                await http.post("/complete", json=DEVICE_SERVE),
                await http.post("/model/predict", json={"context": "z", "length": 2}),
            ]
            held.gate.set()
            return full, await first, await http.post("/model/get_prediction", json={"qid": qid})

    full, first, queued = asyncio.run(scenario())
    for response in full:
        assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
    assert first.status_code == 200 and queued.status_code == 200


def test_cors_headers_only_with_the_option(client, open_client):
    origin = {"Origin": "https://page.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    for path in ("/complete", "/model/predict", "/model/get_prediction"):
        without = client.options(path, headers=preflight)
        assert without.status_code == 405 and "access-control-allow-origin" not in without.headers
        allowed = open_client.options(path, headers=preflight)
        assert allowed.status_code == 200, path
        assert allowed.headers["access-control-allow-origin"] == "*"
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert allowed.headers["access-control-allow-headers"].lower() == "authorization"  # Bearer keys may be sent

    answered = open_client.post("/complete", json={**DEVICE_SERVE, "temp": 0}, headers=origin)
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "*"
    refused = open_client.post("/model/predict", json={"context": 1}, headers=origin)
    assert refused.status_code == 422 and refused.headers["access-control-allow-origin"] == "*"
    plain = client.post("/complete", json={**DEVICE_SERVE, "temp": 0}, headers=origin)
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_the_cors_setting_is_off_by_default_and_a_yes_no_flag():
    base = ["--checkpoint", "/runs/a"]
    assert parse(base, {}).cors is False
    assert parse([*base, "--cors"], {}).cors is True
    assert parse([*base, "--cors", "off"], {"GPTJ_FLAX_CORS": "1"}).cors is False
    assert parse(base, {"GPTJ_FLAX_CORS": "Yes"}).cors is True
    with pytest.raises(SettingsError, match="GPTJ_FLAX_CORS='maybe' is not a valid boolean"):
        parse(base, {"GPTJ_FLAX_CORS": "maybe"})
    with pytest.raises(SettingsError, match=re.escape("--predictions-kept (or GPTJ_FLAX_PREDICTIONS_KEPT)")):
        parse([*base, "--predictions-kept", "0"], {})


def test_the_docs_examples_get_their_documented_responses(client):
    """docs/serve.md's ```sh examples for the original clients, sent as curl would send them."""
    blocks = re.findall(r"^```sh\n(.*?)^```", SERVE_PAGE.read_text(), re.MULTILINE | re.DOTALL)
    commands = [
        shlex.split(line, comments=True)
        for block in blocks
        for line in block.replace("\\\n", " ").splitlines()
        if line.strip()
    ]
    answers = {}
    for words in commands:
        assert words[0] == "curl"
        url = next(w for w in words if w.startswith("http://"))
        data = words[words.index("-d") + 1].replace("$QID", str(answers.get("qid")))
        response = client.post(httpx.URL(url).path, content=data, headers={"content-type": "application/json"})
        assert response.status_code == 200, (url, response.text)
        answers.update(response.json())
    assert set(answers) == {"completion", "qid", "context", "time"}
