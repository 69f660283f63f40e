"""LoRA: config, adapters in the model (zero-init equals the base, every mesh layout), a LoRA run on a
trained base (loss falls, only adapters train and are saved, exact resume, base checked), and the
exports: merge-lora, to-hf --merge-lora and HuggingFace PEFT's format, checked against PEFT itself."""

import dataclasses
import json
import random
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

import gptj_flax
from benchmarks.common import write_random_hf
from gptj_flax import checkpoint, convert, partitioning
from gptj_flax.config import ConfigError, LoraConfig, from_dict
from gptj_flax.convert import lora as lora_lib
from gptj_flax.model import GPTJ, unstack_layers
from gptj_flax.training import hooks, optimizer, start, steps, train
from tests import commands
from tests.training_helpers import MODEL, make_config

LORA = {"rank": 8, "alpha": 16, "targets": ["*"]}
RUN = dict(total_steps=16, warmup_steps=2, anneal_steps=14, lr=1e-2, end_lr=1e-3, val_every=16, ckpt_every=16)


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_corpus()


@pytest.fixture(scope="module")
def base(corpus, tmp_path_factory):
    """A trained demo-sized checkpoint, slimmed to bfloat16 (what a LoRA run holds of it)."""
    root = tmp_path_factory.mktemp("base")
    train(make_config(corpus, root / "run", total_steps=20, val_set={}), progress=False)
    return str(convert.slim(root / "run", root / "bf16"))


@pytest.fixture(scope="module")
def fine_tune_data(tmp_path_factory):
    """A narrow domain the base never saw (one function template), split into train and validation."""
    root, rng = tmp_path_factory.mktemp("fine_tune"), random.Random(0)

    def text(n):
        return "".join(f"def add_{k}(x):\n    return x + {k}\n\n" for k in (rng.randrange(1000) for _ in range(n)))

    (root / "train.txt").write_text(text(3000))
    (root / "val.txt").write_text(text(300))
    return {"train_set": str(root / "train.txt"), "val_set": {"ft": str(root / "val.txt")}}


@pytest.fixture(scope="module")
def lora_run(corpus, base, fine_tune_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("lora") / "run"
    result = train(make_config(corpus, run, lora=LORA, **RUN, **fine_tune_data), init_from=base, progress=False)
    return run, result


# --------------------------------------------------------------------------------------------
# Config


def test_lora_config_is_validated_by_name():
    assert LoraConfig().projections == ("q_proj", "v_proj")
    assert LoraConfig(targets=("*_proj",)).projections == ("q_proj", "k_proj", "v_proj", "out_proj")
    with pytest.raises(
        ConfigError, match=r"'qproj' matches no projection .*q_proj, k_proj, v_proj, out_proj, fc_in, fc_out"
    ):
        LoraConfig(targets=("qproj",))
    with pytest.raises(ConfigError, match="train.lora.rank must be a positive integer, got 0"):
        LoraConfig(rank=0)
    with pytest.raises(ConfigError, match="train.lora.alpha must be a finite positive number"):
        LoraConfig(alpha=-1)
    raw = {"model": MODEL, "train": {"batch_size": 8, "lora": {"rank": 4, "alpah": 1}}}
    with pytest.raises(ConfigError, match=r"unknown key train.lora.'alpah' \(did you mean 'alpha'\?\)"):
        from_dict(raw)
    with pytest.raises(ConfigError, match="train.freeze and train.lora are both set"):
        from_dict({"model": MODEL, "train": {"batch_size": 8, "lora": {}, "freeze": ["wte"]}})
    config = from_dict({"model": MODEL, "train": {"batch_size": 8, "lora": {"rank": 4, "targets": ["fc_*"]}}})
    assert config.train.lora == LoraConfig(rank=4, targets=("fc_*",))
    assert from_dict(json.loads(json.dumps(config.to_dict()))) == config  # saved with checkpoints


# --------------------------------------------------------------------------------------------
# The model


def _model_config(scan: bool):
    return dataclasses.replace(make_config({"train": "x", "val": "x", "tokenizer": "x"}, "r").model, scan_layers=scan)


@pytest.mark.parametrize("scan", [True, False])
def test_zero_initialised_adapters_give_the_base_models_logits(scan):
    mc = _model_config(scan)
    lora = LoraConfig(**LORA)
    variables = nn.meta.unbox(GPTJ(mc, lora).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, mc.vocab_size)
    base_logits = GPTJ(mc).apply({"params": variables["params"]}, tokens)
    np.testing.assert_array_equal(GPTJ(mc, lora).apply(variables, tokens), base_logits)
    # A is PEFT's kaiming-uniform (±1/sqrt(fan_in)), B zero; a non-zero B changes the logits.
    layer = variables["lora"]["layers"] if scan else variables["lora"]["layer_0"]
    a, b = layer["attn"]["q_proj_lora"]["a"], layer["attn"]["q_proj_lora"]["b"]
    assert a.dtype == b.dtype == jnp.float32 and not np.any(b)
    assert 0.5 / np.sqrt(mc.d_model) < np.abs(a).max() <= 1 / np.sqrt(mc.d_model)
    bumped = jax.tree.map(lambda x: x + 0.01, variables["lora"])
    moved = GPTJ(mc, lora).apply({"params": variables["params"], "lora": bumped}, tokens)
    assert np.abs(moved - base_logits).max() > 1e-3


@pytest.mark.parametrize("scan", [True, False])
def test_a_lora_step_runs_alike_on_every_mesh_layout(scan):
    """Adapters shard by their logical names (the rank never split) on every layout in LAYOUTS."""
    mc = _model_config(scan)
    config = make_config({"train": "x", "val": "x", "tokenizer": "x"}, "r", lora=LORA)
    config = config.replace(model=mc)
    model = GPTJ(mc, config.train.lora)
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, mc.vocab_size)
    batch = gptj_flax.data.Batch(tokens, jnp.ones_like(tokens), jnp.ones((8, 16), jnp.int32))
    base_params = nn.meta.unbox(GPTJ(mc).init(jax.random.key(2), jnp.zeros((1, 1), jnp.int32)))["params"]
    results = {}
    for layout in partitioning.LAYOUTS:
        mesh = partitioning.make_mesh(layout)
        tx = optimizer.make_optimizer(config.train)
        _, base_shardings = convert.param_targets(lora_lib.base_model_config(config), mesh)
        base = jax.device_put(jax.tree.map(lambda x: x.astype(jnp.bfloat16), base_params), base_shardings)
        state = steps.create_state(model, tx, mesh, jax.random.key(0))
        shardings = steps.state_shardings(model, tx, mesh)
        step = steps.compile_train_step(
            model,
            tx,
            shardings,
            data_sharding=steps.batch_sharding(mesh, accumulated=False),
            lr_fn=optimizer.schedule(config.train),
            base_shardings=base_shardings,
        )
        with partitioning.sharding_scope(mesh):
            for _ in range(2):
                state, metrics = step(state, batch, base)
        results[layout] = (float(metrics["loss"]), jax.tree.map(np.asarray, state.params))
    ref_loss, ref_params = results["dp"]
    for layout, (loss, params) in results.items():
        assert abs(loss - ref_loss) < 1e-5, layout
        for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, err_msg=layout)


# --------------------------------------------------------------------------------------------
# A LoRA run


def test_a_lora_fine_tune_of_a_trained_checkpoint_lowers_validation_loss(lora_run, corpus, base):
    run, result = lora_run
    before, after = result.val[0]["loss_ft"], result.val[RUN["total_steps"]]["loss_ft"]
    print(f"LoRA val loss {before:.4f} -> {after:.4f}")
    assert after < before - 0.5
    # Step 0 is the base itself (B = 0): its loss is the base checkpoint's, evaluated without LoRA.
    config = checkpoint.Checkpointer(run, read_only=True).read_config()
    mesh = partitioning.make_mesh(config.mesh)
    params = convert.load_init_params(base, config, mesh)
    plain = steps.compile_eval_step(
        GPTJ(config.model),
        convert.param_targets(config.model, mesh)[1],
        data_sharding=steps.batch_sharding(mesh, accumulated=False),
    )
    val = gptj_flax.data.make_eval_sets(
        config.train.val_set,
        seq_len=config.model.max_len,
        batch_size=8,
        n_batches=2,
        tokenizer=gptj_flax.data.load_tokenizer(corpus["tokenizer"]),
    )
    baseline = hooks.evaluate(plain, params, val, steps.batch_sharding(mesh, accumulated=False))
    assert abs(baseline["loss_ft"] - before) < 1e-5


def test_only_the_adapters_train_and_are_saved(lora_run, base, corpus):
    run, result = lora_run
    ckpt = checkpoint.Checkpointer(run, read_only=True)
    config = ckpt.read_config()
    meta = ckpt.read_json(None, "meta")
    ckpt.close()
    adapters = lora_lib.read_adapter(run).adapters
    paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(adapters)}
    assert len(paths) == 2 * 6 and all("_lora']" in p for p in paths)  # a and b of the six projections
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(adapters))
    # The optimiser state holds moments of the adapters and nothing of the base.
    tx = optimizer.make_optimizer(config.train)
    opt_state = jax.eval_shape(tx.init, adapters)
    adam = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert jax.tree.structure(adam[0].mu) == jax.tree.structure(adapters)
    identity = lora_lib.BaseIdentity.from_meta(meta, str(run))
    assert identity.path.endswith("bf16/20") and len(identity.checksum) == 64
    # The base is held frozen in bfloat16.
    held = start.LoraBase.start(config, partitioning.make_mesh(config.mesh), meta, None)
    assert {x.dtype for x in jax.tree.leaves(held.base)} == {jnp.dtype(jnp.bfloat16)}


def test_the_adapter_checkpoint_size_is_printed_next_to_the_bases(corpus, tmp_path, repo_root, run_command):
    config = make_config(corpus, tmp_path / "run", lora={"rank": 4}, total_steps=2, ckpt_every=2, val_set={})
    # A base wide enough that the checkpoint's fixed overheads (which vary from save to save, 0.12 MiB
    # once beside a 1.07 MiB base at d_model 128) do not hide the ratio: 2 layers, d_model 256.
    config = config.replace(model=dataclasses.replace(config.model, d_model=256))
    write_random_hf(tmp_path / "hf", config.model)
    base = f"hf:{tmp_path / 'hf'}"
    path = tmp_path / "config.json"
    gptj_flax.config.save_config(config, path)
    out = run_command(
        commands.script("train.py"), "--config", path, "--init-from", base, "--no-progress", cwd=repo_root
    )
    assert out.status == 0, out.err[-3000:]
    line = next(line for line in out.out.splitlines() if line.startswith("LoRA checkpoint step 2:"))
    print(line)
    ckpt_mib, base_mib = (float(x.split(" MiB")[0].split()[-1]) for x in line.split(";"))
    assert f"LoRA base {base}" in out.err and "held in bfloat16" in out.err
    assert ckpt_mib * 10 < base_mib
    assert abs(base_mib - lora_lib.disk_bytes(checkpoint.absolute_path(tmp_path / "hf")) / 2**20) < 0.01


def test_resuming_a_lora_run_is_exact_and_checks_its_base(corpus, base, tmp_path):
    local_base = tmp_path / "base"
    shutil.copytree(base, local_base)
    settings = dict(lora=LORA, total_steps=6, warmup_steps=1, anneal_steps=5, ckpt_every=3, val_set={})
    straight = train(make_config(corpus, tmp_path / "straight", **settings), init_from=str(local_base), progress=False)
    first = train(
        make_config(corpus, tmp_path / "resumed", **settings), init_from=str(local_base), stop_after=3, progress=False
    )
    second = train(
        make_config(corpus, tmp_path / "resumed", **settings), progress=False
    )  # no init_from: the recorded base
    assert first.step == 3 and second.step == 6 and min(second.losses) == 4
    for step in range(1, 7):
        assert abs({**first.losses, **second.losses}[step] - straight.losses[step]) <= 1e-6, step
    a, b = lora_lib.read_adapter(tmp_path / "straight").adapters, lora_lib.read_adapter(tmp_path / "resumed").adapters
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)

    more = make_config(corpus, tmp_path / "resumed", **{**settings, "total_steps": 8})
    config_file = next((local_base / "20").glob("config/*"))
    config_file.write_bytes(config_file.read_bytes() + b" ")
    with pytest.raises(
        lora_lib.LoRAError, match=rf"the base model {local_base}/20 changed since .*restore the original base"
    ):
        train(more, progress=False)
    shutil.rmtree(local_base)
    with pytest.raises(lora_lib.LoRAError, match=rf"trained on the base model {local_base}/20, which no longer exists"):
        train(more, progress=False)


def test_a_lora_run_needs_a_base(corpus, tmp_path):
    with pytest.raises(ConfigError, match="train.lora is set but .* start a LoRA run with --init-from BASE"):
        train(make_config(corpus, tmp_path / "run", lora=LORA), progress=False)


# --------------------------------------------------------------------------------------------
# Exports


def _hf_logits(directory, tokens, adapter=None):
    import torch
    from transformers import GPTJForCausalLM

    model = GPTJForCausalLM.from_pretrained(directory, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def test_peft_export_loads_in_peft_and_matches_our_merged_model(lora_run, base, tmp_path, repo_root, run_command):
    run, _ = lora_run
    adapter = lora_lib.read_adapter(run)
    config = adapter.config
    mesh = partitioning.make_mesh(partitioning.ONE_DEVICE)
    f32 = config.replace(model=dataclasses.replace(config.model, param_dtype="float32"))
    params = convert.load_init_params(base, f32, mesh)
    tokens = jax.random.randint(jax.random.key(3), (2, 24), 0, config.model.vocab_size)
    live = np.asarray(GPTJ(config.model, adapter.lora).apply({"params": params, "lora": adapter.adapters}, tokens))
    merged = lora_lib.merge_adapters(params, adapter.adapters, adapter.lora)
    ours = np.asarray(GPTJ(config.model).apply({"params": merged}, tokens))
    assert np.abs(ours - live).max() <= 1e-4
    base_logits = np.asarray(GPTJ(config.model).apply({"params": params}, tokens))
    assert np.abs(ours - base_logits).max() > 1e-2  # the adapters trained to something

    def cli(*args):
        out = run_command(commands.script("convert.py"), *args, cwd=repo_root)
        assert out.status == 0, out.err[-3000:]
        return out.out

    cli("to-hf", base, str(tmp_path / "hf_base"))
    assert "PEFT LoRA adapter" in cli("to-peft", str(run), str(tmp_path / "peft"))
    with_peft = _hf_logits(tmp_path / "hf_base", tokens, tmp_path / "peft")
    print("PEFT vs ours max |diff|:", np.abs(with_peft - ours).max())
    assert np.abs(with_peft - ours).max() <= 1e-4

    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["peft_type"]) == (8, 16, "LORA")

    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    d, f = config.model.d_model, config.model.ff_dim
    assert tensors["base_model.model.transformer.h.1.attn.q_proj.lora_A.weight"].shape == (8, d)
    assert tensors["base_model.model.transformer.h.1.attn.q_proj.lora_B.weight"].shape == (d, 8)
    assert tensors["base_model.model.transformer.h.0.mlp.fc_in.lora_B.weight"].shape == (f, 8)

    cli("merge-lora", str(run), str(tmp_path / "merged"))
    cli("to-hf", str(tmp_path / "merged"), str(tmp_path / "hf_merged"))
    via_merge = _hf_logits(tmp_path / "hf_merged", tokens)
    print("merge-lora + to-hf vs ours max |diff|:", np.abs(via_merge - ours).max())
    assert np.abs(via_merge - ours).max() <= 1e-4
    cli("to-hf", "--merge-lora", str(run), str(tmp_path / "hf_direct"))
    assert np.abs(_hf_logits(tmp_path / "hf_direct", tokens) - ours).max() <= 1e-4

    # load(base, adapter=…) merges the same adapters: a LoRA run, or the PEFT directory.
    for source in (run, tmp_path / "peft"):
        lm = gptj_flax.load(base, dtype="float32", adapter=source)
        got = np.asarray(GPTJ(lm.decoder.config).apply({"params": lm.decoder.params}, tokens))
        assert np.abs(got - ours).max() <= 1e-4, source
    with pytest.raises(gptj_flax.sampling.SamplingError, match="was trained on the base"):
        gptj_flax.load(tmp_path / "merged", adapter=run)


# --------------------------------------------------------------------------------------------
# QLoRA: adapters on an int8 base


def _int8(config):
    return config.replace(model=dataclasses.replace(config.model, quantize="int8"))


@pytest.fixture(scope="module")
def qlora_run(corpus, base, fine_tune_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("qlora") / "run"
    config = _int8(make_config(corpus, run, lora=LORA, **RUN, **fine_tune_data))
    return run, train(config, init_from=base, progress=False)


def test_an_int8_model_trains_only_adapters(corpus, base, tmp_path):
    with pytest.raises(ConfigError, match=r"model.quantize='int8' without train.lora.*QLoRA"):
        train(_int8(make_config(corpus, tmp_path / "run")), init_from=base, progress=False)


def test_a_qlora_base_is_the_int8_model_that_load_quantises(corpus, base):
    """At step 0 (B = 0) a QLoRA model's logits are the int8 base model's, as load(quantize="int8") makes it."""
    config = _int8(make_config(corpus, "unused", lora=LORA))
    mesh = partitioning.make_mesh(config.mesh)
    held = convert.load_init_params(base, config.replace(model=lora_lib.base_model_config(config)), mesh)
    attn = held["layers"]["attn"]
    assert attn["q_proj"].dtype == jnp.int8 and attn["q_proj_scale"].dtype == jnp.float32
    int8_base = gptj_flax.load(base, quantize="int8")  # unrolled layers, as decoding runs them
    held = unstack_layers(jax.tree.map(np.asarray, held))
    jax.tree.map(np.testing.assert_array_equal, held, jax.tree.map(np.asarray, int8_base.decoder.params))

    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, config.model.vocab_size)
    lora = GPTJ(dataclasses.replace(config.model, scan_layers=False), config.train.lora)
    fresh = nn.meta.unbox(lora.init(jax.random.key(0), tokens[:, :1]))["lora"]
    ours = lora.apply({"params": held, "lora": fresh}, tokens)
    theirs = GPTJ(dataclasses.replace(int8_base.config, scan_layers=False)).apply(
        {"params": int8_base.decoder.params}, tokens
    )
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_a_qlora_fine_tune_lowers_validation_loss_from_the_int8_bases(qlora_run, lora_run):
    run, result = qlora_run
    before, after = result.val[0]["loss_ft"], result.val[RUN["total_steps"]]["loss_ft"]
    float_before, float_after = (lora_run[1].val[s]["loss_ft"] for s in (0, RUN["total_steps"]))
    print(f"QLoRA val loss {before:.4f} -> {after:.4f}; LoRA on the bf16 base {float_before:.4f} -> {float_after:.4f}")
    assert after < before - 0.5
    assert before != float_before and abs(before - float_before) < 0.05  # int8 rounding moves the base a little
    config = checkpoint.Checkpointer(run, read_only=True).read_config()
    assert config.model.quantize == "int8" and config.train.lora is not None


def test_a_merged_qlora_run_is_the_model_it_trained(qlora_run, base, tmp_path):
    """merge-lora and load(base, adapter=…) both merge into the dequantised int8 base: the logits of the
    trained QLoRA model itself (int8 base plus unmerged adapters)."""
    run, _ = qlora_run
    merged = lora_lib.merge_lora(run, tmp_path / "merged")
    merged_model = gptj_flax.load(merged)
    assert merged_model.config.quantize is None and merged_model.param_dtype == "float32"
    adapted = gptj_flax.load(base, adapter=run)

    config = checkpoint.Checkpointer(run, read_only=True).read_config()
    mesh = partitioning.make_mesh(partitioning.ONE_DEVICE)
    held = convert.load_init_params(base, config.replace(model=lora_lib.base_model_config(config)), mesh)
    trained = GPTJ(config.model, config.train.lora)
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, config.model.vocab_size)
    ours = np.asarray(trained.apply({"params": held, "lora": lora_lib.read_adapter(run, mesh).adapters}, tokens))
    # merge-lora writes float32; load() merges into the base's own dtype (bfloat16 here), a rounding more
    for model, atol in ((merged_model, 1e-4), (adapted, 0.05)):
        unrolled = dataclasses.replace(model.config, scan_layers=False)  # as decoding holds them
        logits = np.asarray(GPTJ(unrolled).apply({"params": model.decoder.params}, tokens))
        print("merged QLoRA vs trained max |diff|:", np.abs(logits - ours).max())
        np.testing.assert_allclose(logits, ours, atol=atol, rtol=0)
    base_logits = np.asarray(GPTJ(config.model).apply({"params": held}, tokens))
    assert np.abs(base_logits - ours).max() > 0.5  # the adapters changed the model
