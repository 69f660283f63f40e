"""Many LoRA adapters served over one base: each row of a batch applies its own adapter, exactly as
that adapter merged into its own model does, and nothing recompiles as adapters come and go."""

from __future__ import annotations

import dataclasses
import re
import shutil

import jax
import numpy as np
import pytest

import gptj_flax
from gptj_flax.cli import sample as sample_cli
from gptj_flax.config import LoraConfig
from gptj_flax.sampling.adapter_bank import AdapterBank, AdapterConflict, AdapterError, UnknownAdapter
from gptj_flax.sampling.samplers import SamplingError, SamplingParams
from gptj_flax.sampling.slots import Request, Slots
from tests import adapter_helpers
from tests.test_serving_engine import counting_compilations
from tests.test_serving_support import CONFIG, checkpoint_dir, tiny_model

NEW = 5  # tokens generated per row


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    return adapter_helpers.three_adapters(str(tmp_path_factory.mktemp("adapters")), checkpoint_dir(), CONFIG)


@pytest.fixture(scope="module")
def merged(adapters) -> dict:
    """Each adapter merged into its own copy of the base, and the base: the reference."""
    models = {name: gptj_flax.load(checkpoint_dir(), adapter=path) for name, path in adapters.items()}
    return {None: tiny_model(), **models}


def _alone(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    out = model.generate(tokens, NEW, temperature=0, ignore_eos=True, return_tokens=True, return_logprobs=True)
    return np.asarray(out.tokens), np.asarray(out.logprobs)


def _request(tokens, adapter: int) -> Request:
    return Request(list(tokens), NEW, -1, 0, SamplingParams.build(1, temperature=0.0), adapter=adapter)


def _run(slots: Slots, requests: list[Request]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Admit ``requests`` together (a long prompt chunk by chunk), decode them to their end and free
    their rows: each row's tokens and log-probs."""
    places = list(range(len(requests)))
    short = [r for r in requests if slots.prompt_columns(len(r.tokens)) <= slots.chunk]
    firsts = [slots.admit(short, places[: len(short)])] if short else []
    for place, request in enumerate(requests[len(short) :], start=len(short)):
        prefill = slots.start_prefill(request)
        while not prefill.done:
            slots.prefill_chunk(prefill)
        firsts.append(slots.insert(prefill, place))
    outs = [jax.tree.map(lambda *xs: np.concatenate(xs), *firsts)]
    outs += [slots.decode([], 1, highest=len(requests) - 1) for _ in range(NEW - 1)]
    slots.free(places)
    tokens = np.concatenate([o.tokens[: len(requests)] for o in outs], axis=1)
    logprobs = np.concatenate([o.logprobs[: len(requests)] for o in outs], axis=1)
    return list(zip(tokens, logprobs, strict=True))


def _compiled(slots: Slots) -> dict[str, int]:
    """How many times each slot program, and the bank's one, has been compiled."""
    programs = {name: f._cache_size() for name, f in vars(slots.programs).items() if hasattr(f, "_cache_size")}
    assert slots.adapters is not None
    return {**programs, "bank": slots.adapters.compilations()}


class Reference:
    """Each adapter merged into its own model and run alone, a prompt at a time, memoised."""

    def __init__(self, merged: dict):
        self.merged, self.known = merged, {}

    def __call__(self, name, prompt) -> tuple[np.ndarray, np.ndarray]:
        key = (name, tuple(prompt))
        if key not in self.known:
            self.known[key] = _alone(self.merged[name], prompt)
        return self.known[key]

    def check(self, got, names, prompts) -> None:
        for (tokens, logprobs), name, prompt in zip(got, names, prompts, strict=True):
            want_tokens, want_logprobs = self(name, prompt)
            np.testing.assert_array_equal(tokens, want_tokens, err_msg=f"adapter {name}")
            np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5, rtol=0, err_msg=f"adapter {name}")


def test_a_mixed_batch_gives_each_row_its_merged_adapters_output_and_nothing_recompiles(adapters, merged, monkeypatch):
    lm = tiny_model()
    monkeypatch.setattr(lm.decoder, "page_columns", 8)  # pages the prompts fill (the slots read it once)
    bank = AdapterBank.build(lm.config, lm.mesh, adapters, max_adapters=4, base=checkpoint_dir())
    assert bank.slots.rank == 4 and bank.slots.capacity == 5
    assert bank.slots.projections == ("q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out")
    settings = dict(slots=8, length=64, chunk=32, steps=1, top_logprobs=0, adapters=bank)
    plain, cached = Slots(lm.decoder, **settings), Slots(lm.decoder, **settings, prefix_cache=True)
    reference = Reference(merged)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 300, n).tolist() for n in (3, 9, 17, 5, 12, 30, 1, 44)]  # the last one chunked
    mixes = [
        [None, "qv4", "mlp2", "peft", "peft", None, "qv4", "mlp2"],
        ["mlp2", "qv4", None, "peft", "peft", "mlp2", "qv4", None],  # other mixes of the same shapes
        ["peft", None, "qv4", "mlp2", None, "qv4", "peft", "mlp2"],
        ["again", "fifth", "peft", None, "fifth", "again", None, "peft"],  # after the bank changed
    ]

    def run(slots, names, prompts):
        got = _run(slots, [_request(p, bank.index(n)) for p, n in zip(prompts, names, strict=True)])
        reference.check(got, [{"again": "qv4", "fifth": "mlp2"}.get(n, n) for n in names], prompts)
        return slots.counts.cached

    # (the first call of a program on the fresh state adds an entry to jit's cache of its own)
    run(plain, mixes[0], prompts)
    run(plain, mixes[1], prompts)
    # The same prompt on each adapter in turn, the prefix cache holding its pages for the ones
    # before: each finds its own adapter's pages only, never another's (nor the base's).
    shared = prompts[-1]
    found = [run(cached, [name], [shared]) for name in ["peft", None, "qv4", "mlp2", "peft"]]
    assert found == [0, 0, 0, 0, 12]
    for names in mixes[2:]:
        for name, prompt in zip(names, prompts, strict=True):
            reference({"again": "qv4", "fifth": "mlp2"}.get(name, name), prompt)
    compiled = _compiled(plain)
    with counting_compilations() as lowered:
        run(plain, mixes[2], prompts)
        bank.remove("qv4")
        with pytest.raises(UnknownAdapter, match="'qv4'"):
            bank.index("qv4")
        assert bank.add("again", adapters["qv4"]).index == 1  # the row qv4 had
        bank.add("fifth", adapters["mlp2"])
        with pytest.raises(AdapterConflict, match="--max-adapters"):
            bank.add("sixth", adapters["peft"])
        run(plain, mixes[3], prompts)
    assert _compiled(plain) == compiled
    assert lowered == []
    # qv4's pages are still cached, and its successor in the same row does not find them
    assert run(cached, ["again"], [shared]) == 12
    assert bank.bytes_per_adapter == sum(x.nbytes for x in jax.tree.leaves(bank.arrays)) // 5


def test_an_adapter_the_bank_cannot_serve_is_refused_with_the_reason_and_changes_nothing(adapters, tmp_path):
    lm = tiny_model()
    bank = AdapterBank.build(
        lm.config, lm.mesh, {"mlp2": adapters["mlp2"]}, max_adapters=3, rank=3, base=checkpoint_dir()
    )
    assert (bank.slots.rank, bank.slots.projections) == (3, ("out_proj", "fc_in"))
    before = jax.tree.map(np.asarray, bank.arrays)
    other = dataclasses.replace(CONFIG, d_model=32, n_heads=2)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "weights").write_bytes(b"another base")
    corrupt = shutil.copytree(adapters["peft"], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    lora = LoraConfig(rank=2, alpha=4.0, targets=("fc_in",))
    cases = {
        "wide": (
            adapter_helpers.lora_run(str(tmp_path / "wide"), checkpoint_dir(), other, lora, seed=4),
            "d_model: 32 there, 64",
        ),
        "wide-peft": (
            adapter_helpers.peft_adapter(str(tmp_path / "wide-peft"), other, seed=5, r=2, target_modules=["fc_in"]),
            "made for a model of other dimensions",
        ),
        "moved": (
            adapter_helpers.lora_run(str(tmp_path / "moved"), f"hf:{tmp_path / 'elsewhere'}", CONFIG, lora, seed=6),
            f"was trained on the base hf:{tmp_path / 'elsewhere'}",
        ),
        "corrupt": (str(corrupt), "adapter_model.safetensors"),
        "missing": (str(tmp_path / "nowhere"), "does not exist"),
        "qv4": (adapters["qv4"], "rank 4, above this bank's 3: restart with --max-adapter-rank 4"),
        "peft": (adapters["peft"], "adapts k_proj, fc_out, which this bank does not cover"),
        "bad/name": (adapters["mlp2"], "adapter name 'bad/name' is not valid"),
    }
    for name, (path, reason) in cases.items():
        with pytest.raises(AdapterError, match=re.escape(reason)) as raised:
            bank.add(name, path)
        assert "Traceback" not in str(raised.value)
        assert not isinstance(raised.value, AdapterConflict)
    with pytest.raises(AdapterConflict, match="'mlp2' is loaded already"):
        bank.add("mlp2", adapters["mlp2"])
    assert list(bank.adapters) == ["mlp2"]
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, bank.arrays), before)
    assert bank.add("mlp2-again", adapters["mlp2"]).index == 2  # the bank still takes a good one


def test_load_keeps_several_adapters_and_each_prompt_names_its_own(adapters, merged, run_command):
    lm = gptj_flax.load(checkpoint_dir(), adapters=adapters)
    assert list(lm.adapters.adapters) == ["qv4", "mlp2", "peft"]
    reference = Reference(merged)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 300, n).tolist() for n in (4, 11, 7, 20)]
    names = [None, "qv4", "mlp2", "peft"]
    outs = lm.generate(
        prompts, NEW, temperature=0, ignore_eos=True, return_tokens=True, return_logprobs=True, adapter=names
    )
    reference.check([(np.asarray(o.tokens), np.asarray(o.logprobs)) for o in outs], names, prompts)
    text = "def add(x):"
    streamed = "".join(lm.stream(text, NEW, temperature=0, adapter="peft"))
    assert streamed == merged["peft"].generate(text, NEW, temperature=0).text
    with pytest.raises(UnknownAdapter, match="'nope'"):
        lm.generate(text, 2, adapter="nope")
    with pytest.raises(SamplingError, match="has no adapters"):
        tiny_model().generate(text, 2, adapter="qv4")
    # gptj-sample: NAME=DIR adapters beside the base, each --model completing the prompt in one batch
    argv = [checkpoint_dir(), "--prompt", text, "--temperature", "0", "--max-new-tokens", str(NEW)]
    for name in ("qv4", "peft"):
        argv += ["--adapter", f"{name}={adapters[name]}"]
    ran = run_command(sample_cli.main, *argv, "--model", "peft", "--model", "base", "--model", "qv4")
    assert ran.status == 0, ran.err
    blocks = re.findall(r"^===== (\w+), sample 0 \(\w+, \d+ tokens\) =====\n(.*?)\n(?====== |\Z)", ran.out, re.M | re.S)
    assert [name for name, _ in blocks] == ["peft", "base", "qv4"]
    for name, got in blocks:
        assert got == merged[None if name == "base" else name].generate(text, NEW, temperature=0).text
    refused = run_command(sample_cli.main, *argv, "--model", "mlp2")
    assert refused.status == 2 and "--model mlp2: no --adapter mlp2=DIR given" in refused.err


def _scores(scored) -> tuple[np.ndarray, list[dict[int, float]]]:
    return np.asarray(scored.logprobs), scored.top_logprobs


def test_scoring_a_mixed_batch_gives_each_text_its_merged_adapters_log_probs_and_nothing_recompiles(adapters, merged):
    lm = gptj_flax.load(checkpoint_dir(), adapters=adapters, max_adapters=4)
    rng = np.random.default_rng(2)
    texts = [rng.integers(1, 300, n).tolist() for n in (6, 13, 9, 20, 4, 17, 11, 2)]
    names = [None, "qv4", "mlp2", "peft", "qv4", None, "peft", "mlp2"]
    want = {(n, tuple(t)): _scores(merged[n].score(t, top_logprobs=3)) for n in set(names) for t in texts}

    def check(got, names):
        for scored, name, text in zip(got, names, texts, strict=True):
            logprobs, top = want[({"again": "qv4"}.get(name, name), tuple(text))]
            np.testing.assert_allclose(scored.logprobs, logprobs, atol=1e-5, rtol=0, err_msg=f"adapter {name}")
            assert list(scored.top_logprobs[-1]) == list(top[-1]), name  # the same alternatives, in order
            np.testing.assert_allclose(list(scored.top_logprobs[-1].values()), list(top[-1].values()), atol=1e-5)

    check(lm.score(texts, top_logprobs=3, adapter=names), names)
    for name in ("qv4", "mlp2", "peft"):  # each adapter changes the scores: the check above can fail
        assert np.max(np.abs(want[(name, tuple(texts[3]))][0] - want[(None, tuple(texts[3]))][0])) > 1e-2
    compiled = lm.decoder.compilations()
    with counting_compilations() as lowered:
        check(lm.score(texts, top_logprobs=3, adapter=names[::-1]), names[::-1])
        check(lm.score(texts, top_logprobs=3, adapter=None), [None] * len(texts))  # the base: the same program
        lm.adapters.remove("qv4")
        with pytest.raises(UnknownAdapter, match="'qv4'"):
            lm.score(texts[0], adapter="qv4")
        assert lm.adapters.add("again", adapters["qv4"]).index == 1
        lm.adapters.add("fourth", adapters["mlp2"])
        mix = ["again", "fourth", "again", None, "peft", "again", "fourth", None]
        check(lm.score(texts, top_logprobs=3, adapter=mix), [{"fourth": "mlp2"}.get(n, n) for n in mix])
    assert lm.decoder.compilations() == compiled and lowered == []
    single = lm.score(texts[1], adapter="peft")  # one text and one name
    np.testing.assert_allclose(single.logprobs, want[("peft", tuple(texts[1]))][0], atol=1e-5, rtol=0)
    with pytest.raises(SamplingError, match="2 values for 8 prompts"):
        lm.score(texts, adapter=["peft", None])
    with pytest.raises(SamplingError, match="has no adapters"):
        tiny_model().score(texts[0], adapter="peft")
