"""Continuous batching: requests join and leave the decode slots between steps, each row with its own
settings, and every output equals what ``generate`` gives the same prompt alone.

A real server on 127.0.0.1, real HTTP clients; the reference is ``LanguageModel.generate`` of each
prompt in a batch of its own.
"""

import asyncio
import contextlib
import dataclasses
import json
import re
import threading
import time

import httpx
import jax
import numpy as np
import pytest

from gptj_flax.sampling.api import LanguageModel
from tests.test_serving_support import HeldModel, RunningServer, tiny_model, wait_until

LONG_CONTEXT = 256
SLOTS = 4
MULTI_STEPS = 4  # --decode-steps of the module's server


@pytest.fixture(scope="module")
def lm():
    """The serving tests' tiny model and tokenizer with a context long enough for 200-token requests."""
    short = tiny_model()
    return LanguageModel(
        dataclasses.replace(short.decoder.config, max_len=LONG_CONTEXT), short.decoder.params, short.tokenizer
    )


@pytest.fixture(scope="module")
def held(lm):
    return HeldModel(lm)


@pytest.fixture(scope="module", params=["beside", "between"])
def server(held, request):
    """A server that prefills on a spare device beside the decode steps, or between them on its own
    (the one-device default); both run up to ``MULTI_STEPS`` decode steps a call."""
    settings = dict(max_batch=SLOTS, queue_size=64, prefill_chunk=16, prefill=request.param)
    with RunningServer(held, **settings, decode_steps=MULTI_STEPS) as running:
        assert (running.service.worker.prefill_mesh is not None) == (request.param == "beside")
        assert running.service.worker.decode_steps == MULTI_STEPS
        yield running


@pytest.fixture(scope="module")
def one_step(lm, server):
    """The same server as ``server`` (its prefill place), but with one decode step a device call."""
    settings = dict(max_batch=SLOTS, queue_size=64, prefill_chunk=16, prefill=server.settings.prefill)
    with RunningServer(HeldModel(lm), **settings, decode_steps=1) as running:
        yield running


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def prompt_of(lm, words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    vocabulary = ["def", "class", "return", "import", "for", "while", "print", "self", "value", "(", ")", ":"]
    return " ".join(rng.choice(vocabulary, words))


def alone(lm, prompt: str, n: int, **settings):
    return lm.generate(lm.encode(prompt), n, return_tokens=True, **settings)


def test_short_requests_finish_before_a_long_one_and_every_output_equals_generate_alone(lm, held, server):
    # a prompt that greedy decoding does not end early, so the long request really is 200 tokens
    long_prompt = next(
        p
        for p in (prompt_of(lm, 5, s) for s in range(50))
        if alone(lm, p, 200, temperature=0).finish_reason == "length"
    )
    shorts = [prompt_of(lm, 3 + i % 5, 100 + i) for i in range(20)]
    finished: dict[str, float] = {}

    async def one(http, name, prompt, n):
        response = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0})
        assert response.status_code == 200, response.text
        finished[name] = time.monotonic()
        return response.json()

    async def until(condition) -> None:
        for _ in range(3000):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    async def everyone():
        # The long prompt's prefill waits at the gate until every short one is queued: it takes a
        # slot first, and the short ones arrive while it has all its tokens still to make (a
        # multi-step engine makes this tiny model's 200 tokens in less time than an HTTP round trip).
        held.gate.clear()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                long = asyncio.ensure_future(one(http, "long", long_prompt, 200))
                await until(lambda: held.waiting)
                queued = [asyncio.ensure_future(one(http, f"short {i}", p, 8)) for i, p in enumerate(shorts)]
                await until(lambda: server.service.worker.queued_rows == len(shorts))
                held.gate.set()
                return await asyncio.gather(long, *queued)
        finally:
            held.gate.set()

    long_answer, *short_answers = asyncio.run(everyone())
    start = min(finished.values())
    assert all(finished[f"short {i}"] < finished["long"] for i in range(len(shorts))), {
        name: round(at - start, 3) for name, at in finished.items()
    }
    for prompt, n, answer in [(long_prompt, 200, long_answer)] + [(p, 8, a) for p, a in zip(shorts, short_answers)]:
        reference = alone(lm, prompt, n, temperature=0)
        assert answer["choices"][0]["text"] == reference.text
        assert answer["usage"]["completion_tokens"] == reference.completion_tokens


def test_rows_with_different_settings_share_the_steps_and_each_equals_generate(lm, server):
    requests = [
        dict(temperature=0.0),
        dict(temperature=0.7, top_p=0.9, seed=1),
        dict(temperature=1.3, seed=2),
        dict(temperature=1.0, top_p=0.5, seed=3),
        dict(temperature=0.9, seed=4, stop=["("]),
        dict(temperature=0.0, stop=[":"]),
    ]
    prompts = [prompt_of(lm, 4, 200 + i) for i in range(len(requests))]

    async def everyone():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            return await asyncio.gather(
                *(
                    http.post("/v1/completions", json={"prompt": p, "max_tokens": 24, **settings})
                    for p, settings in zip(prompts, requests)
                )
            )

    for prompt, settings, response in zip(prompts, requests, asyncio.run(everyone())):
        assert response.status_code == 200, response.text
        reference = alone(lm, prompt, 24, **settings)
        assert response.json()["choices"][0]["text"] == reference.text, settings


def test_a_long_prompt_is_prefilled_chunk_by_chunk_while_others_decode(lm, server, held):
    long_prompt = prompt_of(lm, 50, 300)
    assert len(lm.encode(long_prompt)) > 4 * 16  # several 16-token chunks
    short_prompt = prompt_of(lm, 3, 301)
    calls: list[str] = []
    steps: list[int | None] = []  # each call's decode steps (None: a chunk)
    threads: set[tuple[str, str]] = set()
    slots = server.service.worker.slots
    chunk, decode = slots.prefill_chunk, slots.dispatch_decode

    def record(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            steps.append(args[1] if name == "decode" else None)
            threads.add((name, threading.current_thread().name))
            return fn(*args, **kwargs)

        return wrapped

    slots.prefill_chunk, slots.dispatch_decode = record("chunk", chunk), record("decode", decode)
    held.step_delay_s = 0.02  # the short request is still decoding when the long one arrives
    try:

        async def both():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                short = asyncio.ensure_future(
                    http.post("/v1/completions", json={"prompt": short_prompt, "max_tokens": 100, "temperature": 0})
                )
                await asyncio.sleep(0.2)
                long = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 8, "temperature": 0})
                return await asyncio.gather(short, long)

        short_answer, long_answer = asyncio.run(both())
    finally:
        del slots.prefill_chunk, slots.dispatch_decode
        held.step_delay_s = 0.0
    assert short_answer.status_code == long_answer.status_code == 200, (short_answer.text, long_answer.text)
    first, last = calls.index("chunk"), len(calls) - 1 - calls[::-1].index("chunk")
    chunks = calls[first : last + 1]
    assert chunks.count("chunk") >= 4
    # while a prompt is being prefilled, decode calls are of one step: the prefill is not held up
    assert {k for k in steps[first : last + 1] if k is not None} <= {1}, steps
    if server.settings.prefill == "beside":
        # the chunks run on the prefill thread (and device), the decode steps go on beside them
        assert threads == {("chunk", "gptj-prefill"), ("decode", "gptj-engine")}, threads
    else:
        # the short request kept decoding: a decode step between every two chunks of the long prompt
        assert all(a != b for a, b in zip(chunks, chunks[1:])), chunks
    assert short_answer.json()["choices"][0]["text"] == alone(lm, short_prompt, 100, temperature=0).text
    assert long_answer.json()["choices"][0]["text"] == alone(lm, long_prompt, 8, temperature=0).text


# Lowering a program to XLA comes before every compilation, also one the tests' persistent compilation
# cache answers without compiling (conftest.py), so counting both still sees every new program.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration")


@contextlib.contextmanager
def counting_compilations():
    """Counts the programs lowered or compiled in this process while the block runs."""
    compiled: list[float] = []

    def listen(event: str, seconds: float, **_) -> None:
        if event in COMPILE_EVENTS:
            compiled.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_nothing_compiles_as_requests_come_and_go(lm, server):
    bodies = [
        {"prompt": prompt_of(lm, n, 400 + n), "max_tokens": m, "temperature": t, "seed": n}
        for n, m, t in ((1, 1, 0.0), (7, 30, 0.8), (20, 5, 0.0), (50, 60, 1.0), (3, 2, 0.5))
    ]

    async def everyone():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            plain = [http.post("/v1/completions", json=b) for b in bodies]
            streamed = http.post("/v1/completions", json={**bodies[1], "stream": True})
            return await asyncio.gather(*plain, streamed)

    with counting_compilations() as compiled:
        responses = asyncio.run(everyone())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert len(compiled) == 0


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "plain"])
def test_a_client_that_disconnects_frees_its_slot_within_one_call(lm, server, held, stream):
    prompt = next(
        p
        for p in (prompt_of(lm, 4, 500 + s) for s in range(50))
        if alone(lm, p, 60, temperature=0).finish_reason == "length"
    )
    body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "stream": stream}
    held.step_delay_s = 0.1
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            if stream:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    assert next(line for line in response.iter_lines() if line).startswith("data: {")
                    steps = metric(http.get("/metrics").text, "gptj_decode_steps_total")
                    calls_then = held.decode_calls
            else:
                with pytest.raises(httpx.ReadTimeout):
                    http.post("/v1/completions", json=body, timeout=0.5)
                steps = metric(http.get("/metrics").text, "gptj_decode_steps_total")
                calls_then = held.decode_calls
            # leaving the block (or the timeout) closed the connection; once the server has seen it
            # go, the row may still be placed (a first token comes before its slot, with a prefill
            # device), but it is freed at the next step
            wait_until(lambda: server.service.in_flight == 0, 30, "the server to see the client go")
            wait_until(lambda: metric(http.get("/metrics").text, "gptj_busy_slots") == 0, 30, "the slot to be freed")
            text = http.get("/metrics").text
            # the call in flight, and the next (each of up to --decode-steps steps)
            assert held.decode_calls - calls_then <= 2
            assert metric(text, "gptj_decode_steps_total") - steps <= 2 * MULTI_STEPS
            assert metric(text, "gptj_kv_pages_used") == 0 < metric(text, "gptj_kv_pages")  # its pages too
            calls = held.decode_calls
            time.sleep(0.5)
            assert held.decode_calls == calls
    finally:
        held.step_delay_s = 0.0


def test_prompts_sharing_a_prefix_take_its_cached_pages_and_each_equals_generate(lm, server):
    """Between steps the prefix cache is on (the default): a prompt's rows after the first, and later
    requests, prefill only what their cached pages do not hold; beside, every token is prefilled."""
    page = server.service.worker.slots.page
    rng = np.random.default_rng(7)
    shared = [int(t) for t in rng.integers(1, lm.decoder.valid_vocab, 2 * page)]
    tails = [[int(t) for t in rng.integers(1, lm.decoder.valid_vocab, n)] for n in (5, 7)]
    # two rows of one request; then prompts ending at a page boundary and just past it
    requests = [[shared + tails[0], shared + tails[1]], [shared, shared + tails[0][:1]]]
    with httpx.Client(base_url=server.url, timeout=300) as http:
        before = http.get("/metrics").text
        for prompts in requests:
            body = {"prompt": prompts, "max_tokens": 6, "temperature": 0, "logprobs": 0}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            for prompt, choice in zip(prompts, response.json()["choices"], strict=True):
                reference = lm.generate(prompt, 6, temperature=0, return_tokens=True, return_logprobs=True)
                assert choice["text"] == reference.text
                np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], reference.logprobs, atol=1e-5)
        after = http.get("/metrics").text
    prompt_tokens = sum(len(p) for prompts in requests for p in prompts)

    def added(name):
        return metric(after, name) - metric(before, name)

    assert added("gptj_prompt_tokens_total") == prompt_tokens
    if server.service.worker.prefill_mesh is not None:
        assert added("gptj_prompt_tokens_prefilled_total") == prompt_tokens
        assert metric(after, "gptj_prefix_cache_pages") == 0
        return
    # prompts of 256 columns in chunks of 16: the first prefilled from its first real chunk on, the
    # others from the chunk holding their first token past the cached pages (the one ending at a
    # page boundary keeps its last page's tokens to run: its last token's logits are needed)
    chunk = server.service.worker.slots.chunk
    first = len(shared) + len(tails[0])
    assert added("gptj_prompt_tokens_prefilled_total") == first + chunk + page + chunk
    assert metric(after, "gptj_prefix_cache_pages") >= 2
    assert 0 < metric(after, "gptj_prefix_cache_hit_rate") < 1


def stop_inside(lm, prompt: str, n: int) -> str:
    """A stop string that greedy decoding of ``prompt`` meets part-way through its ``n`` tokens."""
    text = alone(lm, prompt, n, temperature=0).text
    middle = len(text) // 3
    return text[middle : middle + 2] if text[middle : middle + 2].strip() else text[middle : middle + 3]


async def answers_and_a_cancelled_stream(url: str, bodies: list[dict], cancelled: dict) -> list[dict]:
    """Every body's answer (streamed ones joined), while one streamed request leaves after its first chunk."""

    async def leave(http):
        async with http.stream("POST", "/v1/completions", json={**cancelled, "stream": True}) as response:
            await anext(line async for line in response.aiter_lines() if line.startswith("data: {"))

    async def answer(http, body):
        if not body.get("stream"):
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0] | {"usage": response.json()["usage"]}
        text, finish = "", None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[len("data: ") :])["choices"][0]
                    text, finish = text + choice["text"], choice["finish_reason"] or finish
        return {"text": text, "finish_reason": finish}

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        *answered, _ = await asyncio.gather(*(answer(http, b) for b in bodies), leave(http))
    return answered


def test_multi_step_calls_answer_as_one_step_calls_do(lm, server, one_step):
    """Greedy text, logprobs, finish_reason and usage with --decode-steps 1 and 4: stop
    strings met inside a call, token limits that are no multiple of it, a client that leaves."""
    prompts = [prompt_of(lm, 3 + i % 4, 600 + i) for i in range(8)]
    bodies = [
        {"prompt": p, "max_tokens": 40, "temperature": 0, "logprobs": 2, "stop": [stop_inside(lm, p, 40)]}
        for p in prompts[:4]
    ]
    bodies += [
        {"prompt": p, "max_tokens": n, "temperature": 0, "logprobs": 1} for p, n in zip(prompts[4:], (1, 3, 6, 9))
    ]
    bodies += [{**bodies[0], "stream": True}, {**bodies[5], "temperature": 0.9, "seed": 7}]
    cancelled = {"prompt": prompts[1], "max_tokens": 60, "temperature": 0}
    multi, single = (asyncio.run(answers_and_a_cancelled_stream(s.url, bodies, cancelled)) for s in (server, one_step))
    assert [a["finish_reason"] for a in multi[:4]] == ["stop"] * 4  # the stops really were met
    assert [a["usage"]["completion_tokens"] for a in multi[4:8]] == [1, 3, 6, 9]
    for body, got, expected in zip(bodies, multi, single, strict=True):
        assert got.keys() == expected.keys()
        assert {k: v for k, v in got.items() if k != "logprobs"} == {
            k: v for k, v in expected.items() if k != "logprobs"
        }
        if "logprobs" in got:
            assert got["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
            assert [list(t) for t in got["logprobs"]["top_logprobs"]] == [
                list(t) for t in expected["logprobs"]["top_logprobs"]
            ]
            np.testing.assert_allclose(
                got["logprobs"]["token_logprobs"], expected["logprobs"]["token_logprobs"], atol=1e-5
            )
        if body["temperature"] == 0:  # and as the prompt decoded alone, cut at its stop string
            reference = alone(lm, body["prompt"], body["max_tokens"], temperature=0, stop=body.get("stop"))
            assert got["text"] == reference.text
    for running in (server, one_step):  # the client that left freed its slot and pages
        with httpx.Client(base_url=running.url) as http:
            wait_until(lambda: metric(http.get("/metrics").text, "gptj_busy_slots") == 0, 30, "the slots to be freed")
            assert metric(http.get("/metrics").text, "gptj_kv_pages_used") == 0


def test_a_prompt_that_arrives_during_a_multi_step_call_is_admitted_after_it(lm, server, held):
    first = next(
        p
        for p in (prompt_of(lm, 4, 700 + s) for s in range(50))
        if alone(lm, p, 120, temperature=0).finish_reason == "length"
    )
    second = prompt_of(lm, 2, 760)
    assert len(lm.encode(second)) <= 16  # admitted whole, not chunk by chunk
    worker = server.service.worker
    slots = worker.slots
    calls: list[tuple] = []
    admit_name = "place" if server.settings.prefill == "beside" else "dispatch_admit"
    originals = {name: getattr(slots, name) for name in ("dispatch_decode", admit_name)}

    def recorded(name, fn):
        def wrapped(*args, **kwargs):
            calls.append((name, args[1] if name == "dispatch_decode" else None))
            return fn(*args, **kwargs)

        return wrapped

    for name, fn in originals.items():
        setattr(slots, name, recorded(name, fn))
    submit = worker.submit
    worker.submit = recorded("submit", submit)
    held.step_delay_s = 0.05  # a call (of a few steps) outlasts the HTTP round trip of the second prompt
    try:

        async def both():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                body = {"prompt": first, "max_tokens": 120, "temperature": 0}
                long = asyncio.ensure_future(http.post("/v1/completions", json=body))
                deadline = time.monotonic() + 120
                while ("dispatch_decode", MULTI_STEPS) not in calls:  # the first prompt decodes
                    assert time.monotonic() < deadline and not long.done(), calls
                    await asyncio.sleep(0.01)
                short = await http.post("/v1/completions", json={"prompt": second, "max_tokens": 4, "temperature": 0})
                return await long, short

        long_answer, short_answer = asyncio.run(both())
    finally:
        for name in originals:
            delattr(slots, name)
        del worker.submit
        held.step_delay_s = 0.0
    assert long_answer.status_code == short_answer.status_code == 200
    submitted = [i for i, (name, _) in enumerate(calls) if name == "submit"]
    assert len(submitted) == 2, calls
    arrived = submitted[1]
    admitted = next((i for i, (name, _) in enumerate(calls) if name == admit_name and i > arrived), None)
    assert admitted is not None, calls
    before, between = calls[submitted[0] : arrived], calls[arrived:admitted]
    assert ("dispatch_decode", MULTI_STEPS) in before, calls  # the first prompt ran in multi-step calls
    # the second prompt waited for the call in flight at most (and, while prefilled beside, for one-step calls)
    assert sum(1 for name, steps in between if name == "dispatch_decode" and steps > 1) <= 1, between
    if server.settings.prefill == "between":
        assert sum(1 for name, _ in between if name == "dispatch_decode") <= 1, between
    assert long_answer.json()["choices"][0]["text"] == alone(lm, first, 120, temperature=0).text
    assert short_answer.json()["choices"][0]["text"] == alone(lm, second, 4, temperature=0).text
