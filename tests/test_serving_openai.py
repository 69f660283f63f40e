"""``/v1/completions`` as its real clients use it: the official ``openai`` SDK and lm-eval's
``local-completions`` model, unmodified, against a real server on 127.0.0.1.

A tiny random HuggingFace GPT-J, saved as a HuggingFace directory, is served in float32 — in this
process for the SDK (one server for the module), and by ``scripts/serve.py --dtype float32`` for
lm-eval — so the same weights give the independent references: PyTorch's log-probs, lm-eval's own
``hf`` model, and ``LanguageModel.generate`` for what is sampled.
"""

import copy
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from lm_eval import simple_evaluate

import gptj_flax
from gptj_flax.evaluation.harness import task_manager
from gptj_flax.sampling.api import Scored
from gptj_flax.serving import chat
from gptj_flax.serving.scoring import PLACEHOLDER, next_token
from tests.evaluation_helpers import CFG, TEXT_DOCS, make_tokenizer, write_tasks
from tests.helpers import hf_model
from tests.test_serving_support import (
    RunningServer,
    no_key_leaks,  # noqa: F401 - the autouse leak scan
    wait_until,
)

MAX_BATCH = 4
NAME = "tiny-gptj"
PROMPTS = ["The cat sat on the", "One two three", "Paris is the capital of"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
SERVE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "serve.md"


def code_blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\S*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    model = hf_model(CFG)
    model.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def lm(hf_dir):
    return gptj_flax.load(hf_dir[0], dtype="float32")


@pytest.fixture(scope="module")
def server(lm, hf_dir):
    with RunningServer(
        lm,
        checkpoint=str(hf_dir[0]),
        dtype="float32",
        model_name=NAME,
        max_batch=MAX_BATCH,
        queue_size=64,
    ) as running:
        yield running


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


# A chat template as a fine-tune's card would give one: the tokenizer's special tokens are its
# variables (bos_token), and it refuses what it cannot render with transformers' raise_exception.
CHAT_TEMPLATE = """{{ bos_token }}{% if messages[0].role == 'assistant' %}\
{{ raise_exception('a conversation starts with the system or the user') }}{% endif %}\
{% for m in messages %}{{ m.role[0] | upper }}: {{ m.content }}
{% endfor %}{% if add_generation_prompt %}A:{% endif %}"""  # short turns: the context is 64 tokens
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The cat"},
    {"role": "assistant", "content": "sat."},
    {"role": "user", "content": "One two"},
]
RENDERED = "<|endoftext|>S: Be brief.\nU: The cat\nA: sat.\nU: One two\nA:"


@pytest.fixture(scope="module")
def chat_server(lm, hf_dir, tmp_path_factory):
    """The same model and settings as ``server`` (so the same compiled programs), with ``--chat-template``
    and a request log."""
    directory = tmp_path_factory.mktemp("chat")
    (directory / "chat.jinja").write_text(CHAT_TEMPLATE)
    with RunningServer(
        lm,
        checkpoint=str(hf_dir[0]),
        dtype="float32",
        model_name=NAME,
        max_batch=MAX_BATCH,
        queue_size=64,
        chat_template=str(directory / "chat.jinja"),
        log_file=str(directory / "requests.jsonl"),
    ) as running:
        yield running


@pytest.fixture
def chat_client(chat_server):
    with openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def torch_log_probs(model, tokens) -> np.ndarray:
    """log p(· | tokens[:j+1]) for every j: float64 [len - 1, V] under the HuggingFace model."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def by_text(lm, alternatives: dict[int, float]) -> dict[str, float]:
    """Alternatives as the API names them, by text; of ids that share a text (bytes of an incomplete
    character all show as U+FFFD), the likelier."""
    out: dict[str, float] = {}
    for token, value in sorted(alternatives.items(), key=lambda item: -item[1]):
        out.setdefault(lm.decode([token]), value)
    return out


# -- the openai SDK -----------------------------------------------------------------------------------
def test_plain_and_streamed_completions_match_generate(lm, client):
    settings = dict(temperature=0.8, seed=7)
    extensions = dict(top_k=20, min_p=0.01, repetition_penalty=1.2)
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=10, extra_body=extensions, **settings)
    expected = lm.generate(PROMPTS[0], 10, **settings, **extensions)
    assert out.choices[0].text == expected.text and out.object == "text_completion"
    assert out.usage.prompt_tokens == expected.prompt_tokens
    assert out.usage.completion_tokens == expected.completion_tokens
    assert out.usage.total_tokens == expected.prompt_tokens + expected.completion_tokens

    chunks = list(
        client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10, stream=True, logprobs=3, **settings)
    )
    expected = lm.generate(PROMPTS[1], 10, **settings, return_tokens=True, return_logprobs=True, return_top_logprobs=3)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == [lm.decode([t]) for t in expected.tokens]
    assert [x for lp in streamed for x in lp.token_logprobs] == pytest.approx(expected.logprobs, abs=1e-5)
    tops = [top for lp in streamed for top in lp.top_logprobs]
    for top, alternatives, token in zip(tops, expected.top_logprobs, expected.tokens, strict=True):
        expected_top = by_text(lm, alternatives)
        assert lm.decode([token]) in top and len(top) <= len(expected_top) + 1
        assert {text: top[text] for text in expected_top} == pytest.approx(expected_top, abs=1e-5)
    assert chunks[-1].choices[0].finish_reason == {"eos": "stop", "length": "length"}[expected.finish_reason]


def test_echo_with_logprobs_scores_the_prompt_as_pytorch_does(lm, client, hf_dir):
    prompt = lm.encode(PROMPTS[2])
    out = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=3, temperature=0, echo=True, logprobs=5)
    generated = lm.generate(PROMPTS[2], 3, temperature=0, return_tokens=True, return_logprobs=True)
    choice = out.choices[0]
    assert choice.text == PROMPTS[2] + generated.text
    logprobs = choice.logprobs
    tokens = prompt + generated.tokens
    assert logprobs.tokens == [lm.decode([t]) for t in tokens]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # as OpenAI: nothing before it
    reference = torch_log_probs(hf_dir[1], tokens)
    chosen = reference[np.arange(len(tokens) - 1), tokens[1:]]
    assert logprobs.token_logprobs[1:] == pytest.approx(chosen, abs=1e-4)
    for j, top in enumerate(logprobs.top_logprobs[1:]):
        ids = np.argsort(-reference[j, : lm.decoder.valid_vocab])[:5]
        expected_top = by_text(lm, {int(i): float(reference[j, i]) for i in ids})
        assert top[lm.decode([tokens[j + 1]])] == pytest.approx(chosen[j], abs=1e-4)
        assert len(top) <= len(expected_top) + 1
        assert {text: top[text] for text in expected_top} == pytest.approx(expected_top, abs=1e-4)
    assert logprobs.text_offset == np.cumsum([0] + [len(t) for t in logprobs.tokens[:-1]]).tolist()

    scored_only = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    ).choices[0]
    assert scored_only.text == PROMPTS[2] and scored_only.finish_reason == "length"
    assert scored_only.logprobs.token_logprobs[1:] == pytest.approx(chosen[: len(prompt) - 1], abs=1e-4)


def test_n_samples_and_token_id_prompts_match_generate(lm, client):
    out = client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=8, n=2, temperature=1.0, seed=11)
    expected = lm.generate([PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, 8, temperature=1.0, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [e.text for e in expected]
    assert out.choices[0].text != out.choices[1].text  # each choice draws with its own seed
    again = client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=8, n=2, temperature=1.0, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]

    ids = [lm.encode(p) for p in PROMPTS]
    one = client.completions.create(model=NAME, prompt=ids[0], max_tokens=6, temperature=0)
    assert one.choices[0].text == lm.generate(ids[0], 6, temperature=0).text
    several = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, stop=["e"])
    assert [c.text for c in several.choices] == [c.text for c in lm.generate(ids, 6, temperature=0, stop=["e"])]
    assert several.usage.prompt_tokens == sum(map(len, ids))


def metric(url: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics", timeout=60).text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_one_greedy_token_after_an_echoed_prompt_comes_from_its_scoring_pass_as_the_slots_give_it(lm, client, server):
    """lm-eval's log-likelihood request (echo, logprobs, max_tokens=1, temperature 0) is answered by
    one scoring pass, equal to the decode slots' token and the scoring of the prompt, asked apart."""
    prompts = [lm.encode(p) for p in PROMPTS] + [lm.encode("cat")[:1]]  # a one-token prompt too
    counted = ("gptj_prompt_tokens_total", "gptj_generated_tokens_total")
    before = [metric(server.url, name) for name in counted]
    both = client.completions.create(model=NAME, prompt=prompts, max_tokens=1, echo=True, logprobs=2, temperature=0)
    after = [metric(server.url, name) for name in counted]
    # each prompt ran once, through scoring alone: the slots would have counted its tokens again
    assert [b - a for a, b in zip(before, after)] == [sum(map(len, prompts)), len(prompts)]
    generated = client.completions.create(model=NAME, prompt=prompts, max_tokens=1, logprobs=2, temperature=0)
    scored = client.completions.create(model=NAME, prompt=prompts, max_tokens=0, echo=True, logprobs=2)
    for one, gen, score in zip(both.choices, generated.choices, scored.choices):
        assert one.text == score.text + gen.text and one.finish_reason == gen.finish_reason
        assert one.logprobs.tokens == score.logprobs.tokens + gen.logprobs.tokens
        assert one.logprobs.text_offset == score.logprobs.text_offset + gen.logprobs.text_offset
        expected = score.logprobs.token_logprobs + gen.logprobs.token_logprobs
        assert one.logprobs.token_logprobs[0] is None and expected[0] is None
        assert one.logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)
        for got, want in zip(one.logprobs.top_logprobs, score.logprobs.top_logprobs + gen.logprobs.top_logprobs):
            assert got == want if want is None else got == pytest.approx(want, abs=1e-5)


def test_the_token_after_a_scored_prompt_ends_at_the_eos_as_generation_does(lm):
    """:func:`~gptj_flax.serving.scoring.next_token` on hand-made scores: the most likely token after
    the prompt, an EOS left out of the text, and a one-token prompt with no scores of its own."""
    eos, other = lm.eos_token_id, lm.encode("cat")[0]
    after = {eos: -0.25, other: -1.5}
    scored = Scored([other, other, PLACEHOLDER], np.array([-2.0, -9.0]), [{other: -2.0, eos: -3.0}, after])
    own, completion = next_token(scored, 2, eos, lm.tokenizer)
    assert (
        own.tokens == [other, other]
        and own.logprobs.tolist() == [-2.0]
        and own.top_logprobs == [{other: -2.0, eos: -3.0}]
    )
    assert (completion.text, completion.finish_reason, completion.tokens) == ("", "eos", [eos])
    assert (completion.logprobs, completion.top_logprobs, completion.prompt_tokens) == ([-0.25], [after], 2)
    flipped = {other: -0.25, eos: -1.5}
    own, completion = next_token(Scored([other, PLACEHOLDER], np.array([-9.0]), [flipped]), 0, eos, lm.tokenizer)
    assert own is None and completion.top_logprobs is None
    assert (completion.text, completion.finish_reason, completion.tokens) == (lm.decode([other]), "length", [other])


# -- chat completions ---------------------------------------------------------------------------------
def test_the_chat_template_renders_as_transformers_does(lm):
    assert lm.tokenizer.chat_template is None  # the tiny tokenizer has none: the server gets --chat-template
    rendered = lm.tokenizer.apply_chat_template(
        CHAT, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert rendered == RENDERED
    assert chat.render(lm.tokenizer, CHAT_TEMPLATE, CHAT) == RENDERED


def chat_reference(client, rendered: str, **settings):
    """/v1/completions' answer for the rendered prompt, on the same server."""
    return client.completions.create(model=NAME, prompt=rendered, **settings)


def assert_logprobs_match(lm, content, reference, k: int) -> None:
    """Chat logprobs (a list per token) against the completions logprobs object of the same tokens."""
    assert [entry.token for entry in content] == reference.tokens
    assert [entry.logprob for entry in content] == pytest.approx(reference.token_logprobs, abs=1e-5)
    for entry, top in zip(content, reference.top_logprobs, strict=True):
        assert len(entry.top_logprobs) == k
        values = [alternative.logprob for alternative in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        by_text = {}
        for alternative in entry.top_logprobs:
            by_text.setdefault(alternative.token, alternative.logprob)
        assert by_text == pytest.approx({text: top[text] for text in by_text}, abs=1e-5)


def test_sdk_chat_completion_equals_completions_on_the_rendered_prompt(lm, chat_client, chat_server):
    settings = dict(max_tokens=12, temperature=0)
    out = chat_client.chat.completions.create(model=NAME, messages=CHAT, logprobs=True, top_logprobs=3, **settings)
    reference = chat_reference(chat_client, RENDERED, logprobs=3, **settings).choices[0]
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == NAME
    assert choice.message.role == "assistant" and choice.message.content == reference.text
    assert choice.finish_reason == reference.finish_reason
    assert_logprobs_match(lm, choice.logprobs.content, reference.logprobs, 3)
    # the bytes of the tokens are the text's (the end-of-text token a choice may end with is not part of it)
    tokens = [entry for entry in choice.logprobs.content if entry.token != lm.tokenizer.eos_token]
    assert b"".join(bytes(entry.bytes) for entry in tokens).decode("utf-8", "replace") == reference.text
    assert out.usage.prompt_tokens == len(lm.tokenizer.encode(RENDERED))
    assert out.usage.completion_tokens == len(choice.logprobs.content) <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens

    record = json.loads(open(chat_server.settings.log_file).read().splitlines()[-2])  # then the completion's
    assert record["endpoint"] == "/v1/chat/completions" and record["prompt"] == RENDERED
    assert record["response"] == reference.text


def test_sdk_streamed_chat_equals_the_plain_one_and_ends_with_its_usage(lm, chat_client):
    settings = dict(model=NAME, messages=CHAT, max_completion_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    plain = chat_client.chat.completions.create(**settings)
    chunks = list(chat_client.chat.completions.create(**settings, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = [c.choices[0] for c in chunks[:-1]]
    assert "".join(choice.delta.content or "" for choice in streamed) == plain.choices[0].message.content
    content = [entry for choice in streamed if choice.logprobs for entry in choice.logprobs.content]
    assert [(e.token, e.bytes) for e in content] == [(e.token, e.bytes) for e in plain.choices[0].logprobs.content]
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in plain.choices[0].logprobs.content])
    assert streamed[-1].finish_reason == plain.choices[0].finish_reason
    assert [choice.finish_reason for choice in streamed[:-1]] == [None] * (len(streamed) - 1)
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage  # include_usage: a last chunk of usage
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_n_choices_and_stop_strings_equal_completions(lm, chat_client, chat_server):
    settings = dict(n=2, temperature=1.0, seed=11, stop=["e"], max_tokens=8)
    out = chat_client.chat.completions.create(model=NAME, messages=CHAT[:2], **settings)
    rendered = lm.tokenizer.apply_chat_template(
        CHAT[:2], chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    reference = chat_reference(chat_client, rendered, **settings)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.message.content for c in out.choices] == [c.text for c in reference.choices]
    assert [c.finish_reason for c in out.choices] == [c.finish_reason for c in reference.choices]
    assert out.usage == reference.usage and out.usage.prompt_tokens == len(lm.tokenizer.encode(rendered))

    # streamed over HTTP as it goes out: each choice's role first, every chunk without usage, [DONE] last
    body = {"messages": CHAT[:2], **settings, "stream": True}
    with httpx.stream("POST", chat_server.url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    assert all("usage" not in c and len(c["choices"]) == 1 for c in chunks)
    texts = ["", ""]
    for c in chunks:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert texts == [c.text for c in reference.choices]


def test_a_server_without_a_chat_template_answers_400_naming_the_flag(client, server):
    assert server.service.chat_template is None
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=NAME, messages=CHAT)
    assert refused.value.status_code == 400 and "--chat-template" in refused.value.body["detail"]
    assert httpx.get(server.url + "/v1/models", timeout=60).json()["data"][0]["id"] == NAME


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"messages": [{"content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": None}]}, "content"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "text"),
    ({"messages": [{"role": "user", "content": []}]}, "content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "tool_calls"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"),  # the template refuses it
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"n": MAX_BATCH + 1}, "n"),
    ({"temperature": float("nan")}, "temperature"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"prompt": "x"}, "prompt"),
]


@pytest.mark.parametrize("fields,field", BAD_CHATS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_CHATS)])
def test_bad_chat_requests_are_a_422_naming_the_field(chat_server, fields, field):
    body = {"messages": CHAT[:2], **fields}
    response = httpx.post(
        chat_server.url + "/v1/chat/completions",
        content=json.dumps(body),  # NaN as Python's json writes it, lone surrogates as \uXXXX
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 422, response.text
    assert field in {str(part) for error in response.json()["detail"] for part in error["loc"]}


def test_chat_messages_too_long_for_the_context_are_a_413(chat_server):
    long = [{"role": "user", "content": "one two three four five six seven eight nine ten " * 8}]
    for extra in ({}, {"max_tokens": 1}):
        response = httpx.post(chat_server.url + "/v1/chat/completions", json={"messages": long, **extra}, timeout=60)
        assert response.status_code == 413 and "context of 64 tokens" in response.json()["detail"], response.text
    short = {"messages": CHAT[:2], "temperature": 0}  # without max_tokens: what the context leaves
    out = httpx.post(chat_server.url + "/v1/chat/completions", json=short, timeout=60).json()
    assert out["usage"]["total_tokens"] == CFG.max_len or out["choices"][0]["finish_reason"] == "stop"


def test_the_tokenizers_own_template_is_used_and_a_broken_one_refused(lm, tmp_path):
    tokenizer = copy.deepcopy(lm.tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    assert chat.chat_template(None, tokenizer) == CHAT_TEMPLATE
    assert chat.chat_template(None, lm.tokenizer) is None
    (tmp_path / "other.jinja").write_text("{{ messages | length }}")
    assert chat.chat_template(str(tmp_path / "other.jinja"), tokenizer) == "{{ messages | length }}"  # the flag wins
    tokenizer.chat_template = "{% for m in messages %}"
    with pytest.raises(chat.ChatTemplateError, match="the tokenizer's chat template .* is not a valid Jinja template"):
        chat.chat_template(None, tokenizer)


def test_a_template_that_fails_on_the_messages_is_a_render_error_and_an_empty_file_refused(lm, tmp_path):
    assistant_first = [{"role": "assistant", "content": "x"}]
    with pytest.raises(chat.RenderError, match="refused these messages: a conversation starts with the system"):
        chat.render(lm.tokenizer, CHAT_TEMPLATE, assistant_first)
    with pytest.raises(chat.RenderError, match=r"failed on these messages \(TypeError\)"):
        chat.render(lm.tokenizer, "{{ messages[0].content + 1 }}", CHAT)
    (tmp_path / "empty.jinja").write_text(" \n")
    with pytest.raises(chat.ChatTemplateError, match="empty.jinja is empty: it must be a Jinja chat template"):
        chat.read_chat_template(str(tmp_path / "empty.jinja"))


def test_a_tokens_bytes_are_its_own_also_for_part_of_a_character(lm):
    text = "naïve €5"
    tokens = lm.encode(text)
    assert sum(lm.decode([t]) == "\ufffd" for t in tokens) >= 3  # ï and € are split into byte tokens
    assert b"".join(bytes(chat.token_bytes(lm.tokenizer, t, lm.decode([t]))) for t in tokens) == text.encode()


def test_the_docs_chat_example_gets_a_chat_completion(chat_server):
    """docs/serve.md's curl example of a chat request, sent as curl would send it."""
    words = next(
        shlex.split(line, comments=True)
        for _, block in code_blocks(SERVE_PAGE.read_text())
        for line in block.replace("\\\n", " ").splitlines()
        if "/v1/chat/completions" in line
    )
    response = httpx.post(
        chat_server.url + "/v1/chat/completions",
        content=words[words.index("-d") + 1],
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


# -- tokenizer endpoints and bad input ----------------------------------------------------------------
def test_tokenize_detokenize_and_tokenizer_info(lm, server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        tokens = lm.encode(PROMPTS[0])
        out = http.post("/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True}).json()
        assert out == {
            "count": len(tokens),
            "max_model_len": CFG.max_len,
            "tokens": tokens,
            "token_strs": lm.tokenizer.convert_ids_to_tokens(tokens),
        }
        assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": PROMPTS[0]}
        info = http.get("/tokenizer_info").json()
        assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == CFG.max_len
        eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
        assert eos["tokens"] == [lm.eos_token_id]
        assert http.post("/detokenize", json={"tokens": [lm.decoder.valid_vocab]}).status_code == 422
        assert http.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404


BAD = [
    ({"prompt": "x", "echo": True, "stream": True}, "echo"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 300]}, "prompt"),  # the tokenizer has 300 ids (the embedding 320)
    ({"prompt": [[1, 2], [-1]]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": "x", "n": MAX_BATCH + 1}, "n"),
    ({"prompt": ["x", "y"], "n": 3}, "n"),
    ({"prompt": "x", "n": 10**30}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "top_k": 2**31}, "top_k"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": float("nan")}, "min_p"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"prompt": "x", "repetition_penalty": "__1e309__"}, "repetition_penalty"),
    ({"prompt": "x", "seed": 2**32}, "seed"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    # OpenAI's fields this server does not implement, at a value that would change the output
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -1}, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"50": 10}}, "logit_bias"),
    ({"prompt": "x", "suffix": " the end"}, "suffix"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "temprature": 0}, "temprature"),  # a misspelt field is refused, not ignored
]


@pytest.mark.parametrize("body,field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_completion_requests_are_a_422_naming_the_field(server, body, field):
    text = json.dumps(body).replace('"__1e309__"', "1e309")  # NaN and Infinity as Python's json writes them
    response = httpx.post(
        server.url + "/v1/completions", content=text, headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code == 422, response.text
    assert field in {str(part) for error in response.json()["detail"] for part in error["loc"]}


def test_openai_defaults_of_unimplemented_fields_are_accepted_and_best_of_only_as_n(server):
    neutral = {
        "prompt": "x",
        "max_tokens": 2,
        "temperature": 0,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "suffix": None,
        "best_of": 1,
        "stream_options": None,
    }
    ok = httpx.post(server.url + "/v1/completions", json=neutral, timeout=60)
    assert ok.status_code == 200, ok.text
    refused = httpx.post(server.url + "/v1/completions", json={**neutral, "best_of": 3}, timeout=60)
    assert refused.status_code == 422
    assert "best_of" in refused.text and "not implement" in refused.text


def test_a_prompt_longer_than_the_context_is_a_413(lm, server):
    body = {"prompt": [1] * CFG.max_len, "max_tokens": 0, "echo": True}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    response = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
    assert response.status_code == 413 and "context of 64 tokens" in response.json()["detail"]


# -- lm-eval --------------------------------------------------------------------------------------
def per_request(results, task) -> list[list[float]]:
    """Each document's log-likelihoods (one per choice, or the rolling total), in document order."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[float(r[0]) if isinstance(r, (list, tuple)) else float(r) for r in s["filtered_resps"]] for s in samples]


@pytest.fixture
def serve_script(hf_dir, repo_root):
    """``scripts/serve.py`` serving the HuggingFace directory in float32, as a separate process; its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, str(repo_root / "scripts" / "serve.py"), "--checkpoint", f"hf:{hf_dir[0]}"]
    command += ["--dtype", "float32", "--model-name", NAME, "--port", str(port), "--max-batch", str(MAX_BATCH)]
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GPTJ_FLAX_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root), env.get("PYTHONPATH")) if p)
    process = subprocess.Popen(
        command,
        env={**env, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"

    def ready():
        assert process.poll() is None, process.stdout.read()
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, 300, "serve.py to warm up", interval_s=0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def prompt_counts(url: str) -> tuple[float, float]:
    """The server's prompt tokens and prefilled prompt tokens so far, from /metrics."""
    return metric(url, "gptj_prompt_tokens_total"), metric(url, "gptj_prompt_tokens_prefilled_total")


def test_lm_eval_choices_after_a_shared_context_prefill_fewer_tokens_with_the_prefix_cache(
    lm, hf_dir, server, tmp_path, monkeypatch
):
    """lm-eval's local-completions on a 4-choice task: the server's scoring prefix cache prefills at
    most half the prompt tokens that --no-prefix-cache does, and the log-likelihoods are the same."""
    for variable, value in {**OFFLINE, "HF_HOME": str(tmp_path / "hf-home")}.items():
        monkeypatch.setenv(variable, value)
    index = task_manager(write_tasks(tmp_path / "tasks"), include_defaults=False)

    def evaluate(url):
        before = prompt_counts(url)
        results = simple_evaluate(
            model="local-completions",
            model_args=f"base_url={url}/v1/completions,model={NAME},max_length=64,batch_size={MAX_BATCH}",
            tasks=["tiny_long_choice"],
            task_manager=index,
            log_samples=True,
        )
        after = prompt_counts(url)
        return per_request(results, "tiny_long_choice"), after[0] - before[0], after[1] - before[1]

    settings = {"checkpoint": str(hf_dir[0]), "dtype": "float32", "model_name": NAME, "max_batch": MAX_BATCH}
    with RunningServer(lm, **settings, queue_size=64, no_prefix_cache=True) as uncached:
        plain, prompt, prefilled = evaluate(uncached.url)
        plain_scored = uncached.service.scorer.counts
        assert metric(uncached.url, "gptj_scoring_cache_pages") == 0  # --no-prefix-cache: none kept
    scored_before = server.service.scorer.counts
    cached, cached_prompt, cached_prefilled = evaluate(server.url)
    scored = server.service.scorer.counts
    scored_prompt, scored_prefilled = scored.prompt - scored_before.prompt, scored.prefilled - scored_before.prefilled
    assert [len(choices) for choices in plain] == [4, 4]
    np.testing.assert_allclose(cached, plain, rtol=0, atol=1e-5)
    assert prompt == cached_prompt == prefilled > 0  # every input counted; without the cache all run
    # lm-eval asks for one greedy token beside each score (max_tokens=1): the scoring pass gives it, so
    # no prompt goes through the decode slots too, and every prompt token counted is a scored one.
    assert plain_scored.prompt == plain_scored.prefilled == scored_prompt == prompt
    print(f"/metrics: {prefilled:.0f} prompt tokens prefilled without the cache, {cached_prefilled:.0f} with it")
    assert 2 * cached_prefilled <= prefilled
    assert cached_prefilled == scored_prefilled
    # /metrics shows the scoring cache's pages: those of the contexts and choices just scored
    assert metric(server.url, "gptj_scoring_cache_pages") == server.service.scorer.cache.pages > 0


def test_lm_eval_local_completions_scores_as_lm_evals_hf_model(serve_script, hf_dir, tmp_path, monkeypatch):
    for variable, value in {**OFFLINE, "HF_HOME": str(tmp_path / "hf-home")}.items():
        monkeypatch.setenv(variable, value)
    url = serve_script
    tasks = ["tiny_choice", "tiny_text"]
    index = task_manager(write_tasks(tmp_path / "tasks"), include_defaults=False)
    # local-completions keeps one position for the token it asks for and rolling windows one more for
    # context: max_length 64 there windows as lm-eval's hf model does at 62, in the 64-token context.
    served = simple_evaluate(
        model="local-completions",
        model_args=f"base_url={url}/v1/completions,model={NAME},max_length=64,batch_size={MAX_BATCH}",
        tasks=tasks,
        task_manager=index,
        log_samples=True,
    )
    reference = simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_dir[0]},dtype=float32,max_length=62",
        tasks=tasks,
        task_manager=index,
        device="cpu",
        batch_size=MAX_BATCH,
        log_samples=True,
    )
    assert served["config"]["model"] == "local-completions"
    metrics = httpx.get(url + "/metrics", timeout=60).text
    for path in ("/tokenizer_info", "/tokenize"):  # lm-eval found the server's tokenizer and used it
        assert f'gptj_requests_total{{endpoint="{path}",status="200"}}' in metrics, path
    for task in tasks:
        got, expected = per_request(served, task), per_request(reference, task)
        assert [len(g) for g in got] == [len(e) for e in expected]
        worst = max(abs(a - b) for g, e in zip(got, expected) for a, b in zip(g, e))
        print(f"{task}: {sum(map(len, got))} log-likelihoods, max |served - hf| = {worst:.2e}")
        assert worst <= 1e-3, task
    assert len(make_tokenizer().encode(TEXT_DOCS[0]["text"])) > 62  # the long text really spans several windows
