"""Hostile input against a real server on 127.0.0.1: keys-file comments and short keys, NaN, infinities
and lone surrogates in JSON, validation errors that echo nothing, a keys file that turns unusable,
and seeds over the whole [0, 2**32) range."""

import asyncio
import logging
import os
import re

import httpx
import pytest
import requests

from gptj_flax.serving.auth import KeysFileError, KeyStore
from tests.test_serving_support import (
    KEYS,
    RunningServer,
    no_key_leaks,  # noqa: F401 - the autouse leak scan
    secret,
    tiny_model,
    write_keys,
)

LENGTH = 8
JSON = {"content-type": "application/json"}
BEARER = {"Authorization": f"Bearer {KEYS[1]}"}
SHORT_KEY = secret("shortkey10")


@pytest.fixture(scope="module")
def lm():
    return tiny_model()


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    write_keys(keys_file)
    with RunningServer(lm, api_keys_file=str(keys_file), max_batch=2) as running:
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def no_server_error(client) -> bool:
    return 'status="500"' not in client.get("/metrics").text


# -- the keys file ------------------------------------------------------------------------------------
def test_a_comment_line_in_the_keys_file_is_not_a_key(client, server):
    with open(server.settings.api_keys_file) as f:
        assert f.readline().startswith("# ")  # the file the server reads starts with a comment
    for path in ("/complete", "/v1/completions", "/v1/chat/completions"):
        assert client.post(path, json={"prompt": "x", "api_key": "#"}).status_code == 401
        assert client.post(path, json={"prompt": "x"}, headers={"Authorization": "Bearer #"}).status_code == 401
    answered = client.post("/complete", json={"prompt": "x", "length": 2, "api_key": KEYS[0]})
    assert answered.status_code == 200
    # a valid key lets a chat request through to the route (this server has no chat template)
    chat = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "api_key": KEYS[0]}
    )
    assert chat.status_code == 400 and "--chat-template" in chat.json()["detail"]


def test_a_short_key_is_refused_when_the_file_is_read_by_its_line_number(tmp_path):
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"# keys\n\n   # an indented comment\n{KEYS[0]} client-0\n{SHORT_KEY} client-1\n")
    with pytest.raises(KeysFileError) as refused:
        KeyStore(keys_file)
    assert str(refused.value) == (
        f"API keys file {keys_file} line 5: the key is shorter than 16 characters; use a "
        "longer random key, or start the line with # to comment it out"
    )
    assert SHORT_KEY not in str(refused.value)

    keys_file.write_text(f"\ufeff# saved by an editor that writes a byte order mark\n{KEYS[0]}\n\n\t\n")
    keys = KeyStore(keys_file)
    assert len(keys) == 1 and keys.is_valid(KEYS[0]) and not keys.is_valid("#")


@pytest.mark.parametrize("problem", ["a directory", "not UTF-8"])
def test_an_unusable_keys_file_at_startup_is_named(problem, tmp_path):
    keys_file = tmp_path / "keys.txt"
    if problem == "a directory":
        keys_file.mkdir()
    else:
        keys_file.write_bytes(f"{KEYS[0]}\nsk-caf\xe9-0123456789\n".encode("latin-1"))
    with pytest.raises(KeysFileError, match=re.escape(f"API keys file {keys_file} is {problem}")):
        KeyStore(keys_file)


def test_a_keys_file_that_turns_unusable_fails_closed_with_one_logged_error(client, server, no_key_leaks):
    keys_file = server.settings.api_keys_file
    body = {"prompt": "x", "length": 2, "api_key": KEYS[0]}

    def refused_three_times(problem: str) -> None:
        no_key_leaks.forget()
        for _ in range(3):
            response = client.post("/complete", json=body)
            assert response.status_code == 503, (problem, response.text)
            assert response.json() == {"detail": "the server cannot check API keys at the moment; try again later"}
        errors = [r for r in no_key_leaks.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, (problem, [r.getMessage() for r in errors])
        assert errors[0].name == "gptj_flax.serving.auth" and problem in errors[0].getMessage()
        assert keys_file in errors[0].getMessage()

    try:
        os.remove(keys_file)
        os.mkdir(keys_file)
        refused_three_times("is a directory")
        os.rmdir(keys_file)
        with open(keys_file, "wb") as f:
            f.write(f"{KEYS[0]}\nsk-caf\xe9-0123456789\n".encode("latin-1"))
        refused_three_times("is not UTF-8 text")
        with open(keys_file, "w") as f:
            f.write(f"{KEYS[0]}\n\n{SHORT_KEY}\n")
        refused_three_times("line 3: the key is shorter than 16 characters")
    finally:
        if os.path.isdir(keys_file):
            os.rmdir(keys_file)
        write_keys(keys_file)
    assert client.post("/complete", json=body).status_code == 200  # fixed: the keys work again
    assert client.get("/health").status_code == 200 and no_server_error(client)


# -- NaN, infinities and lone surrogates ---------------------------------------------------------------
def raw(template: str) -> bytes:
    """A JSON body as a client may send it: ``KEY`` stands for a valid key."""
    return template.replace("KEY", KEYS[0]).encode()


NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e309", "-1e309"]
HOSTILE = [
    *[("/complete", f'{{"prompt": "x", "temperature": {v}, "api_key": "KEY"}}', "temperature") for v in NON_FINITE],
    ("/complete", '{"prompt": "x", "top_p": NaN, "api_key": "KEY"}', "top_p"),
    ("/complete", '{"prompt": "x", "typical_p": 1e309, "api_key": "KEY"}', "typical_p"),
    ("/complete", '{"prompt": "x", "length": NaN, "api_key": "KEY"}', "length"),
    ("/complete", '{"prompt": "x", "seed": Infinity, "api_key": "KEY"}', "seed"),
    ("/complete", '{"prompt": "\\ud800", "api_key": "KEY"}', "prompt"),
    ("/complete", '{"prompt": "text \\udfff text", "api_key": "KEY"}', "prompt"),
    ("/complete", '{"prompt": "x", "pre_prompt": "\\udbff", "api_key": "KEY"}', "pre_prompt"),
    ("/complete", '{"prompt": "x", "api_key": "\\ud800"}', "api_key"),
    ("/complete", '[{"api_key": "KEY", "prompt": "x", "temperature": NaN}]', None),
    ("/complete", '[{"api_key": "KEY", "prompt": "\\ud800"}]', None),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN, "api_key": "KEY"}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_p": -Infinity, "api_key": "KEY"}', "top_p"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1e309, "api_key": "KEY"}', "max_tokens"),
    ("/v1/completions", '{"prompt": "\\ud800", "api_key": "KEY"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udc00"], "api_key": "KEY"}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": "\\ud800", "api_key": "KEY"}', "stop"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\n", "\\ud800"], "api_key": "KEY"}', "stop"),
    ("/v1/completions", '{"prompt": "x", "model": "\\ud800", "api_key": "KEY"}', "model"),
    ("/v1/completions", '[{"api_key": "KEY", "prompt": "x", "temperature": NaN}]', None),
    ("/v1/completions", '[{"api_key": "KEY", "prompt": "x", "stop": ["\\udfff"]}]', None),
]


@pytest.mark.parametrize("path,template,field", HOSTILE, ids=[f"{p}-{t}" for p, t, _ in HOSTILE])
def test_nan_infinities_and_lone_surrogates_are_a_422_naming_the_field(client, path, template, field, no_key_leaks):
    # With a valid Bearer key too: a body that holds no usable key of its own (an array, a lone
    # surrogate as the key) is a 401 before it is validated (test_serving_hostile).
    response = client.post(path, content=raw(template), headers={**JSON, **BEARER})
    assert response.status_code == 422, response.text
    errors = response.json()["detail"]
    assert errors and all(set(error) == {"loc", "msg", "type"} for error in errors)  # no "input", no "ctx"
    if field is None:  # an array where an object belongs
        assert errors == [
            {
                "loc": ["body"],
                "msg": "Input should be a valid dictionary or object to extract fields from",
                "type": "model_attributes_type",
            }
        ]
    else:
        assert all(error["loc"][:2] == ["body", field] for error in errors)
    for value in ("NaN", "Infinity", "inf", "1e309", "\\ud", "\\udc", "\\udf", "\\udb"):
        assert value not in response.text
    assert not [r for r in no_key_leaks.records if r.levelno >= logging.ERROR]  # no traceback in the log
    assert no_server_error(client)


def test_a_422_names_fields_and_problems_but_echoes_no_value_and_no_key(client):
    cases = [
        ("/complete", {"api_key": KEYS[0], "length": 5}, [(["body", "prompt"], "Field required")]),
        (
            "/complete",
            {"api_key": KEYS[0], "prompt": "x", "length": "twelve-tokens"},
            [(["body", "length"], "Input should be a valid integer")],
        ),
        (
            "/v1/completions",
            {"api_key": KEYS[0], "prompt": "x", "stop": ["one-stop-string"] * 5, "seed": -3},
            [
                (["body", "stop", "constrained-str"], "Input should be a valid string"),
                (["body", "stop", "list[constrained-str]"], "List should have at most 4 items after validation, not 5"),
                (["body", "seed"], "Input should be greater than or equal to 0"),
            ],
        ),
        (
            "/v1/completions",
            {"api_key": KEYS[0], "prompt": "x", "stream": True, "echo": True},
            [(["body", "echo"], "echo is not available with stream")],
        ),
    ]
    for path, body, expected in cases:
        response = client.post(path, json=body)
        assert response.status_code == 422, response.text
        assert [(e["loc"], e["msg"]) for e in response.json()["detail"]] == expected
        for value in (KEYS[0], "twelve-tokens", "one-stop-string", "-3", '"x"'):
            assert value not in response.text


def test_malformed_json_is_a_400_and_neither_echoes_nor_fails(client):
    for body in (
        b'{"prompt": "x", "api_key": "' + KEYS[0].encode() + b'", ',
        b'{"prompt": NaNa}',
        b'{"prompt": "\xff\xfe"}',
        b"[" * 100_000,
    ):
        # with the key as Bearer: a key in a body that is not JSON cannot be read (that is a 401)
        response = client.post("/complete", content=body, headers={**JSON, **BEARER})
        assert response.status_code == 400, (body[:40], response.text)
        assert "prompt" not in response.text and KEYS[0] not in response.text
    unread = client.post("/complete", content=b'{"prompt": "x", "api_key": "' + KEYS[0].encode() + b'", ', headers=JSON)
    assert unread.status_code == 401
    assert no_server_error(client)


# -- seeds --------------------------------------------------------------------------------------------
def test_seeds_take_the_whole_uint32_range(lm, client):
    prompt, seed = "def add(a, b):", 2**31 + 7
    sampling = dict(temperature=1.0, top_p=0.95)

    def completed(seed):
        response = client.post(
            "/complete", json={"prompt": prompt, "length": LENGTH, "seed": seed, "api_key": KEYS[0], **sampling}
        )
        assert response.status_code == 200, response.text
        return response.json()["response"]

    def v1_completed(seed, prompts):
        response = client.post(
            "/v1/completions", json={"prompt": prompts, "max_tokens": LENGTH, "seed": seed, **sampling}, headers=BEARER
        )
        assert response.status_code == 200, response.text
        return [choice["text"] for choice in response.json()["choices"]]

    expected = lm.generate(lm.encode(prompt), LENGTH, seed=seed, **sampling).text
    assert completed(seed) == completed(seed) == expected
    assert completed(7) == lm.generate(lm.encode(prompt), LENGTH, seed=7, **sampling).text != expected
    assert v1_completed(seed, prompt) == v1_completed(seed, prompt) == [expected]
    # a list prompt draws row i with seed + i, wrapping at 2**32 as generate does
    prompts = [prompt, "class Point"]
    reference = lm.generate([lm.encode(p) for p in prompts], LENGTH, seed=2**32 - 1, **sampling)
    assert v1_completed(2**32 - 1, prompts) == [c.text for c in reference]
    assert reference[1].text == lm.generate(lm.encode(prompts[1]), LENGTH, seed=0, **sampling).text
    for path, body in (("/complete", {"prompt": "x"}), ("/v1/completions", {"prompt": "x"})):
        response = client.post(path, json={**body, "seed": 2**32, "api_key": KEYS[0]})
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "seed"]


# -- the leak scan itself -----------------------------------------------------------------------------
def test_the_leak_scan_sees_logs_and_every_clients_response_bodies(client, server, no_key_leaks):
    """The scan that guards every serving test: it must see what it claims to, or it proves nothing."""
    client.post("/complete", json={"prompt": "x", "api_key": secret("sk-invalid-but-long-enough")})
    with client.stream(
        "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}, headers=BEARER
    ) as response:
        assert response.status_code == 200
        list(response.iter_lines())

    async def async_get():
        async with httpx.AsyncClient(base_url=server.url) as http:
            return (await http.get("/v1/models", headers=BEARER)).status_code

    assert asyncio.run(async_get()) == 200
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    texts = no_key_leaks.texts()
    seen = "\n".join(text for _, text in texts)
    assert "refused /complete: an invalid API key" in seen  # a record logged by the server's thread
    assert "data: [DONE]" in seen  # a streamed body
    assert '"max_model_len"' in seen and '"status":"ready"' in seen
    assert {where for where, _ in texts} >= {
        "a response body (httpx)",
        "a response body (httpx async)",
        "a response body (requests)",
    }

    assert not no_key_leaks.leaks()
    logging.getLogger("gptj_flax.serving.test").debug("presented %s", KEYS[1])
    leaks = no_key_leaks.leaks()
    assert len(leaks) == 1 and leaks[0].endswith("in a log record of gptj_flax.serving.test")
    assert KEYS[1] not in leaks[0]
    no_key_leaks.forget()  # the planted leak is not the server's
