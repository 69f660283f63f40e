"""Continuous batching: requests join and leave the decode slots between steps, each row with its own
settings, and every output equals what ``generate`` gives the same prompt alone.

A real server on 127.0.0.1, real HTTP clients; the reference is ``LanguageModel.generate`` of each
prompt in a batch of its own.
"""

import asyncio
import contextlib
import dataclasses
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
    (the one-device default)."""
    with RunningServer(held, max_batch=SLOTS, queue_size=64, prefill_chunk=16, prefill=request.param) as running:
        assert (running.service.worker.prefill_mesh is not None) == (request.param == "beside")
        yield running


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def prompt_of(lm, words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    vocabulary = ["def", "class", "return", "import", "for", "while", "print", "self", "value", "(", ")", ":"]
    return " ".join(rng.choice(vocabulary, words))


def alone(lm, prompt: str, n: int, **settings):
    return lm.generate(lm.encode(prompt), n, return_tokens=True, **settings)


def test_short_requests_finish_before_a_long_one_and_every_output_equals_generate_alone(lm, server):
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

    async def everyone():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            long = asyncio.ensure_future(one(http, "long", long_prompt, 200))
            await asyncio.sleep(0.05)  # the long request is in a slot before the short ones arrive
            return await asyncio.gather(long, *(one(http, f"short {i}", p, 8) for i, p in enumerate(shorts)))

    long_answer, *short_answers = asyncio.run(everyone())
    assert all(finished[f"short {i}"] < finished["long"] for i in range(len(shorts)))
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
    threads: set[tuple[str, str]] = set()
    slots = server.service.worker.slots
    chunk, decode = slots.prefill_chunk, slots.dispatch_decode

    def record(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
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
def test_a_client_that_disconnects_frees_its_slot_within_one_step(lm, server, held, stream):
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
            else:
                with pytest.raises(httpx.ReadTimeout):
                    http.post("/v1/completions", json=body, timeout=0.5)
                steps = metric(http.get("/metrics").text, "gptj_decode_steps_total")
            # leaving the block (or the timeout) closed the connection; once the server has seen it
            # go, the row may still be placed (a first token comes before its slot, with a prefill
            # device), but it is freed at the next step
            wait_until(lambda: server.service.in_flight == 0, 30, "the server to see the client go")
            wait_until(lambda: metric(http.get("/metrics").text, "gptj_busy_slots") == 0, 30, "the slot to be freed")
            text = http.get("/metrics").text
            assert metric(text, "gptj_decode_steps_total") - steps <= 2  # the step in flight, and the next
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
