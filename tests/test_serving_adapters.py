"""LoRA adapters served beside the base by a real server on 127.0.0.1, used by real clients (the
``openai`` SDK and httpx): ``--adapter NAME=DIR``, the ``model`` field on every generation route,
``GET /v1/models``, and ``POST``/``DELETE /v1/adapters`` while the server runs. The references are
each adapter merged into its own model (``gptj_flax.load(base, adapter=DIR)``), run alone."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import threading

import httpx
import openai
import pytest

import gptj_flax
from gptj_flax.cli import serve as serve_cli
from gptj_flax.serving import server as server_module
from gptj_flax.serving.settings import ServeSettings, ServingError, SettingsError, add_arguments, settings_from
from tests import adapter_helpers
from tests.test_serving_engine import counting_compilations
from tests.test_serving_support import (
    CONFIG,
    KEYS,
    HeldModel,
    RunningServer,
    checkpoint_dir,
    no_key_leaks,  # noqa: F401 - the autouse leak scan
    tiny_model,
    wait_until,
    write_keys,
)

NEW = 6
PROMPT = "def add(x):\n    return"
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    return adapter_helpers.three_adapters(str(tmp_path_factory.mktemp("adapters")), checkpoint_dir(), CONFIG)


@pytest.fixture(scope="module")
def merged(adapters) -> dict:
    """The base, and each adapter merged into its own model: the references."""
    return {"base": tiny_model(), **{n: gptj_flax.load(checkpoint_dir(), adapter=p) for n, p in adapters.items()}}


@pytest.fixture(scope="module")
def expected(merged) -> dict[str, str]:
    """Each model's greedy completion of PROMPT: the base, and each adapter merged into its own model."""
    texts = {name: lm.generate(PROMPT, NEW, temperature=0).text for name, lm in merged.items()}
    assert len(set(texts.values())) == len(texts)  # the adapters change the tokens: the checks below can fail
    return texts


@pytest.fixture(scope="module")
def server(adapters, expected, tmp_path_factory):
    directory = tmp_path_factory.mktemp("served")
    write_keys(directory / "keys.txt")
    (directory / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    settings = dict(
        model_name="base",
        adapter=(f"qv4={adapters['qv4']}", f"peft={adapters['peft']}"),
        max_adapters=3,
        adapter_targets="q_proj,k_proj,v_proj,out_proj,fc_in,fc_out",
        max_batch=4,
        queue_size=16,
        prefill_chunk=32,
        api_keys_file=str(directory / "keys.txt"),
        chat_template=str(directory / "chat.jinja"),
    )
    with RunningServer(HeldModel(tiny_model()), **settings) as running:
        yield running


def _completion(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert out.model == model
    return out.choices[0].text


def test_each_request_gets_the_adapter_it_names_on_every_route_and_nothing_recompiles(server, adapters, expected):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0, timeout=120)
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=120)
    with counting_compilations() as lowered:
        models = client.models.list().data
        assert [(m.id, getattr(m, "parent", None)) for m in models] == [
            ("base", None),
            ("qv4", "base"),
            ("peft", "base"),
        ]
        # several requests at once, each its own model: they share the batch
        names = ["peft", "base", "qv4", "peft", "qv4", "base"]
        got: dict[int, str] = {}
        threads = [
            threading.Thread(target=lambda i=i, n=n: got.update({i: _completion(client, n)}))
            for i, n in enumerate(names)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [got[i] for i in range(len(names))] == [expected[n] for n in names]
        chat = client.chat.completions.create(
            model="peft", messages=[{"role": "user", "content": PROMPT}], max_tokens=NEW, temperature=0
        )
        assert (chat.model, chat.choices[0].message.content) == ("peft", expected["peft"])
        streamed = client.completions.create(model="qv4", prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True)
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks) == expected["qv4"] and chunks[0].model == "qv4"
        complete = http.post("/complete", json={"prompt": PROMPT, "length": NEW, "temperature": 0, "model": "qv4"})
        assert complete.json() == {"response": expected["qv4"]}
        # an unknown name is a 404 naming it, on every route
        for path, body in [
            ("/v1/completions", {"model": "nope", "prompt": "a"}),
            ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "a"}]}),
            ("/complete", {"model": "nope", "prompt": "a"}),
        ]:
            answer = http.post(path, json=body)
            assert answer.status_code == 404 and "'nope'" in answer.text, (path, answer.text)
            assert "'qv4'" in answer.text  # and says what there is
    # nothing lowered or compiled (a persistent-cache hit is lowered first), the bank's one write included
    assert lowered == [] and server.service.adapters.compilations() == 1


def _echoed(client: openai.OpenAI, model: str, max_tokens: int):
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, echo=True, logprobs=2
    )
    assert out.model == model
    return out.choices[0]


def test_echo_with_logprobs_scores_the_prompt_with_the_adapter_the_request_names(server, merged, expected):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0, timeout=120)
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=120)
    prompt_tokens = len(merged["base"].encode(PROMPT))
    scores = {name: merged[name].score(PROMPT).logprobs for name in ("base", "qv4", "peft")}
    base = _echoed(client, "base", 0)
    assert base.logprobs.token_logprobs[1:] == pytest.approx(scores["base"], abs=1e-5)
    # the base's prompts are scored through the prefix cache, an adapter's with the bank's program,
    # whose first call compiles it
    assert _echoed(client, "peft", 0).logprobs.token_logprobs[1:] == pytest.approx(scores["peft"], abs=1e-5)
    with counting_compilations() as lowered:
        for name in ("qv4", "peft", "qv4"):
            scored = _echoed(client, name, 0)
            assert scored.text == PROMPT and scored.logprobs.token_logprobs[0] is None
            assert scored.logprobs.token_logprobs[1:] == pytest.approx(scores[name], abs=1e-5), name
            assert max(abs(scores[name] - scores["base"])) > 1e-2  # the adapter changes them: this can fail
            # and with a completion: the echoed prompt's scores, then the generated tokens'
            both = _echoed(client, name, NEW)
            assert both.text == PROMPT + expected[name]
            assert both.logprobs.token_logprobs[1:prompt_tokens] == pytest.approx(scores[name], abs=1e-5)
            generated = merged[name].generate(PROMPT, NEW, temperature=0, return_logprobs=True).logprobs
            assert both.logprobs.token_logprobs[prompt_tokens:] == pytest.approx(generated, abs=1e-5)
    assert lowered == []  # each adapter's scores take the one program
    # a prompt being scored with an adapter holds it, as a request generating with it does
    held, release, started = server.service.model, threading.Event(), threading.Event()
    score = held.score

    def gated(*args, **kwargs):
        started.set()
        release.wait()
        return score(*args, **kwargs)

    held.score = gated
    answer: dict = {}
    request = threading.Thread(target=lambda: answer.update(choice=_echoed(client, "qv4", 0)))
    try:
        request.start()
        assert started.wait(30)
        busy = http.delete("/v1/adapters/qv4")
    finally:
        release.set()
        request.join()
        del held.score
    assert busy.status_code == 409 and "in flight" in busy.text
    assert answer["choice"].logprobs.token_logprobs[1:] == pytest.approx(scores["qv4"], abs=1e-5)


def test_adapters_are_added_and_removed_while_the_server_runs(server, adapters, expected, tmp_path):
    held = server.service.model
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0, timeout=120)
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=120)
    corrupt = shutil.copytree(adapters["peft"], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"garbage")
    narrow = dataclasses.replace(CONFIG, d_model=32, n_heads=2)
    other = adapter_helpers.peft_adapter(str(tmp_path / "other"), narrow, 7, r=2, target_modules=["q_proj"])
    with counting_compilations() as lowered:
        assert httpx.post(server.url + "/v1/adapters", json={"name": "x", "path": adapters["mlp2"]}).status_code == 401
        assert httpx.delete(server.url + "/v1/adapters/qv4").status_code == 401
        added = http.post("/v1/adapters", json={"name": "mlp2", "path": adapters["mlp2"]})
        assert added.status_code == 201, added.text
        assert added.json() | {"path": None} == {
            "id": "mlp2",
            "object": "adapter",
            "parent": "base",
            "path": None,
            "rank": 2,
            "projections": ["out_proj", "fc_in"],
        }
        assert _completion(client, "mlp2") == expected["mlp2"]
        full = http.post("/v1/adapters", json={"name": "more", "path": adapters["mlp2"]})
        assert full.status_code == 409 and "--max-adapters" in full.text
        taken = http.post("/v1/adapters", json={"name": "base", "path": adapters["mlp2"]})
        assert taken.status_code == 409 and "base model's name" in taken.text
        # A request in flight on an adapter holds it: its removal is refused until the request ends.
        held.gate.clear()
        answer: dict = {}
        request = threading.Thread(target=lambda: answer.update(text=_completion(client, "peft")))
        try:
            request.start()
            wait_until(lambda: held.waiting, what="the request to reach the prefill")
            busy = http.delete("/v1/adapters/peft")
        finally:
            held.gate.set()  # whatever happened, the request goes on (and the server can stop)
            request.join()
        assert busy.status_code == 409 and "in flight" in busy.text
        assert answer["text"] == expected["peft"]
        removed = http.delete("/v1/adapters/peft")
        assert removed.status_code == 200 and removed.json()["id"] == "peft"
        gone = http.post("/v1/completions", json={"model": "peft", "prompt": "a"})
        assert gone.status_code == 404 and "'peft'" in gone.text
        assert http.delete("/v1/adapters/peft").status_code == 404
        # adapters that cannot be served: a 400 saying why, and the server goes on serving
        for path, reason in [
            (str(corrupt), "adapter_model.safetensors"),
            (other, "other dimensions"),
            ("/nowhere", "does not exist"),
        ]:
            refused = http.post("/v1/adapters", json={"name": "bad", "path": path})
            assert refused.status_code == 400 and reason in refused.text, refused.text
        assert [m.id for m in client.models.list().data] == ["base", "qv4", "mlp2"]
        again = http.post("/v1/adapters", json={"name": "peft2", "path": adapters["peft"]})  # into the freed row
        assert again.status_code == 201
        assert _completion(client, "peft2") == expected["peft"]
        assert _completion(client, "base") == expected["base"]
    # nothing lowered or compiled (a persistent-cache hit is lowered first), the bank's one write included
    assert lowered == [] and server.service.adapters.compilations() == 1


def test_a_bare_adapter_directory_is_merged_into_the_base_as_before(adapters, monkeypatch, run_command):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ckpt = checkpoint_dir()
    merged = settings_from(parser.parse_args(["--checkpoint", ckpt, "--adapter", adapters["qv4"]]), environ={})
    assert (merged.merged_adapter, merged.served_adapters, merged.adapter_slots) == (adapters["qv4"], {}, 0)
    named = settings_from(
        parser.parse_args(["--checkpoint", ckpt]),
        environ={"GPTJ_FLAX_ADAPTER": f"a={adapters['qv4']},b={adapters['peft']}"},
    )
    assert (named.merged_adapter, named.served_adapters) == (None, {"a": adapters["qv4"], "b": adapters["peft"]})
    assert named.adapter_slots == 2
    with pytest.raises(SettingsError, match="bare directory"):
        ServeSettings(checkpoint=ckpt, adapter=(adapters["qv4"], f"b={adapters['peft']}"))
    with pytest.raises(SettingsError, match="'a' is another --adapter's"):
        ServeSettings(checkpoint=ckpt, adapter=(f"a={adapters['qv4']}", f"a={adapters['peft']}"))
    with pytest.raises(SettingsError, match="--max-adapters"):
        ServeSettings(checkpoint=ckpt, adapter=(f"a={adapters['qv4']}",), max_adapters=0)
    # gptj-serve hands a bare directory to load(adapter=…), which merges it; and holds no bank
    loaded = {}

    def load(path, **kwargs):
        loaded.update(kwargs)
        raise ServingError("loaded")

    monkeypatch.setattr(server_module, "load", load)
    ran = run_command(serve_cli.main, "--checkpoint", ckpt, "--adapter", adapters["qv4"], "--port", "0")
    assert (ran.status, ran.error_lines()) == (1, ["error: loaded"]) and loaded["adapter"] == adapters["qv4"]
